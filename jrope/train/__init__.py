"""The training harness: config, checks, setup, trainer, checkpoints, evaluation, outputs, runtime."""
