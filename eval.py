# A clone's `python -m jrope.eval`; its docstring is what --help prints.
from jrope.eval import __doc__, run_main  # noqa: F401

run_main()
