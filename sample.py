"""Generate text from a trained byte-level run: python sample.py --workdir=DIR --prompt="...".

A clone's entry point to jrope.sample (python -m jrope.sample); --help lists the flags.
"""

from jrope.sample import run_main

if __name__ == "__main__":
    run_main()
