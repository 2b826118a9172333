"""Train one model: python -m jrope.train --config=<experiment> --workdir=DIR (docs/runs.md)."""

from jrope.commands import train as run_main

if __name__ == "__main__":
    run_main()
