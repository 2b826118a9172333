"""Train one model: python -m jrope.train --config=<experiment> --workdir=DIR (docs/runs.md)."""

import functools

from absl import flags

from jrope import command_line


def main(argv: list[str]) -> None:
    from jrope.train.config import TrainConfig  # here: --help and a bad flag need no JAX
    from jrope.train.trainer import train_and_evaluate

    train_and_evaluate(TrainConfig.from_config_dict(flags.FLAGS.config), flags.FLAGS.workdir)


run_main = functools.partial(command_line.run, main, lambda argv: command_line.define_run_flags())
if __name__ == "__main__":
    run_main()
