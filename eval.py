"""Evaluate a run across lengths: python eval.py --workdir=DIR [--config.eval.lengths='(256,4096)'].

A clone's entry point to jrope.eval (python -m jrope.eval); --help lists the flags.
"""

from jrope.eval import run_main

if __name__ == "__main__":
    run_main()
