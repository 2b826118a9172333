"""Train one model: python -m jrope.train --config=<experiment> --workdir=DIR (docs/runs.md)."""

from absl import flags

from jrope import command_line


def main(argv: list[str]) -> None:
    command_line.start_processes()
    from jrope.train.config import TrainConfig  # here: a bad flag is told without JAX
    from jrope.train.trainer import train_and_evaluate

    train_and_evaluate(TrainConfig.from_config_dict(flags.FLAGS.config), flags.FLAGS.workdir)


def run_main() -> None:
    command_line.run(main, lambda argv: command_line.define_run_flags())  # also jrope-train


if __name__ == "__main__":
    run_main()
