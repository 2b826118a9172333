# A clone's `python -m jrope.train`; its docstring is what --help prints.
from jrope.train.__main__ import __doc__, run_main  # noqa: F401

run_main()
