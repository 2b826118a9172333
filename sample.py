# A clone's `python -m jrope.sample`; its docstring is what --help prints.
from jrope.sample import __doc__, run_main  # noqa: F401

run_main()
