"""`python -m jrope.compare`: the method x seed comparison (jrope.experiments.compare)."""

from jrope.experiments.compare import run_main

if __name__ == "__main__":
    run_main()
