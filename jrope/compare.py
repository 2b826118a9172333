"""`python -m jrope.compare` (jrope-compare): the method x seed comparison of
jrope.experiments.compare, imported only once the command runs, so that an install without the
'train' extra is told to add it."""

from jrope import command_line


def _define_flags(argv: list[str]) -> None:
    from jrope.experiments import compare

    compare.define_flags(argv)


def _main(argv: list[str]) -> None:
    from jrope.experiments import compare

    compare.main(argv)


def run_main() -> None:
    """python -m jrope.compare, or jrope-compare."""
    command_line.run(_main, _define_flags)


if __name__ == "__main__":
    run_main()
