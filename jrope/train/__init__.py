"""The training harness: run config and checks, state, sharding, checkpoints, trainer, evaluation, runtime."""
