from jrope.train.__main__ import __doc__, run_main  # noqa: F401 (--help prints __doc__)

run_main()
