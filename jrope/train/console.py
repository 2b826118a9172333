"""What the person running a command reads: progress, timings, results and where they went.

These lines are the program's output, not log records: they go to stdout,
from process 0 only, whatever the log level (jrope.train.runtime hides library
log records below WARNING unless --log_level asks for them). Warnings and
errors stay on stderr.
"""

from __future__ import annotations

import jax


def say(message: str, end: str = "\n") -> None:
    """Print `message` on stdout (process 0 only), flushed at once."""
    if jax.process_index() == 0:
        print(message, end=end, flush=True)


def duration(seconds: float) -> str:
    """'4.2 s', '3 min 05 s' or '2 h 07 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
