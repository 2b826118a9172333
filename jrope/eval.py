"""Evaluate a run's latest checkpoint at eval.lengths: python -m jrope.eval --workdir=DIR; its saved
config is the default --config, and a probe config runs the kernel probe (docs/runs.md)."""

from jrope.commands import evaluate as run_main

if __name__ == "__main__":
    run_main()
