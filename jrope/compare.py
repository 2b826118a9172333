"""`python -m jrope.compare` (jrope-compare): the method x seed comparison of
jrope.experiments.compare, imported only once the command runs, so that an install without the
'train' extra is told to add it."""

from absl import flags

from jrope import command_line


def _define_flags(argv: list[str]) -> None:
    command_line.define_run_flags()
    flags.DEFINE_list("methods", None, "Position-encoding names to compare.")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds of every method.")


def _main(argv: list[str]) -> None:
    from jrope.experiments import compare

    compare.main(argv)


def run_main() -> None:
    """python -m jrope.compare, or jrope-compare."""
    command_line.run(_main, _define_flags)


if __name__ == "__main__":
    run_main()
