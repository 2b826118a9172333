"""python -m jrope.compare: methods x seeds, side by side (jrope/experiments/compare.py)."""

import functools

from absl import flags

from jrope import command_line


def define_flags(argv: list[str]) -> None:
    command_line.define_run_flags()
    flags.DEFINE_list("methods", None, "Encoding names.")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Run seeds.")


def main(argv: list[str]) -> None:
    from jrope.experiments import compare  # here: without the 'train' extra, it is named

    compare.main(argv)


run_main = functools.partial(command_line.run, main, define_flags)
if __name__ == "__main__":
    run_main()
