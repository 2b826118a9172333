"""Train one model: python train.py --config=configs/<experiment>.py --workdir=<dir>.

Resumes automatically from the latest checkpoint in <workdir>. Any config key
can be overridden on the command line, e.g. --config.pe.name=rope.

On SIGTERM (a preemption notice) the run checkpoints its current step and
exits with status 143; the same command resumes it. Multi-process runs (one
process per host) add --multiprocess, or --coordinator_address,
--num_processes and --process_id (jrope.train.distributed).
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from jrope.train import distributed, huge_pages
from jrope.train.config import TrainConfig
from jrope.train.preemption import PREEMPTED_EXIT_CODE, TrainingPreempted
from jrope.train.trainer import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and results.")
_PROCESS_FLAGS = distributed.define_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    distributed.initialize_from_flags(_PROCESS_FLAGS)  # before anything starts a JAX backend
    try:
        train_and_evaluate(TrainConfig.from_config_dict(_CONFIG.value), _WORKDIR.value)
    except TrainingPreempted as preempted:
        logging.warning("%s", preempted)
        sys.exit(PREEMPTED_EXIT_CODE)


if __name__ == "__main__":
    huge_pages.restart_with_huge_pages()
    app.run(main)
