from jrope.eval import __doc__, run_main  # noqa: F401 (--help prints __doc__)

run_main()
