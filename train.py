"""Train one model: python train.py --config=configs/<experiment>.py --workdir=<dir>.

A clone's entry point to jrope.train (python -m jrope.train); --help lists the flags.
"""

from jrope.train.__main__ import run_main

if __name__ == "__main__":
    run_main()
