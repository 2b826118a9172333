"""Train one model: python -m jrope.train --config=<experiment> --workdir=<dir>.

In a clone, python train.py with the same flags; the console script jrope-train too.
--config takes an experiment's name (quickstart, synthetic_cpu, ...) or a config
file's path (configs/quickstart.py).

Resumes automatically from the latest checkpoint in <workdir>; a finished run
is reported and left as it is. Any config key can be overridden on the
command line, e.g. --config.pe.name=rope.

On SIGTERM (a preemption notice) the run checkpoints its current step and
exits with status 143; the same command resumes it. Errors end with their
message and an exit status per kind (jrope.command_line; --verbose adds the
traceback). Multi-process runs (one process per host) add --multiprocess, or
--coordinator_address, --num_processes and --process_id
(jrope.command_line).
"""

from absl import flags
from ml_collections import config_flags

from jrope import command_line
from jrope.errors import UsageError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config: its name (quickstart, ...) or file.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and results.")
command_line.define_process_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise UsageError(f"Unexpected arguments: {argv[1:]}; training takes flags only (--help).")
    command_line.start_processes()  # before anything starts a JAX backend
    # Imported here: a mistake on the command line is reported without loading the trainer.
    from jrope.train.trainer import train_and_evaluate

    train_and_evaluate(_CONFIG.value, _WORKDIR.value)


def run_main() -> None:
    """The command line: python -m jrope.train, jrope-train, or a clone's train.py."""
    command_line.run(main, usage=__doc__)


if __name__ == "__main__":
    run_main()
