"""python -m jrope.compare: methods x seeds, side by side (jrope/experiments/compare.py)."""

from jrope.commands import compare as run_main

if __name__ == "__main__":
    run_main()
