"""The training harness: config, setup (the checks before step 1, then the run's parts), trainer,
checkpoints, evaluation, outputs, runtime."""
