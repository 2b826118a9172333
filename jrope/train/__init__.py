"""The training harness: config, setup (its checks, then its parts), trainer, checkpoints, evaluation, damping,
outputs, runtime."""
