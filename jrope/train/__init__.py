"""The training harness: config, checks, setup, trainer, checkpoints, evaluation, damping,
outputs, runtime."""
