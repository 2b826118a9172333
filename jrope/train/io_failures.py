"""Disk full and other storage failures: found in any exception, told in one line.

A failed write surfaces in many shapes: an OSError from Python code (the
metrics log, the result files), or an error of orbax or tensorstore whose
message carries the operating system's words ("No space left on device")
somewhere in a chain of wrapped exceptions. `find_io_failure` digs the cause
and the path out of any of them, so that the run ends with one message naming
both (jrope.train.cli) instead of a page of tracebacks.
"""

from __future__ import annotations

import errno
import os
import re

from jrope.errors import RunIOError

# Failures of the storage itself, not of the program: the fix is outside it.
IO_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS)
_STRERRORS = {os.strerror(code): code for code in IO_ERRNOS}
# A path in a library's message, quoted (tensorstore: 'Error writing local file "/w/..."').
_QUOTED_PATH = re.compile(r"""["']((?:/|gs://)[^"']+)["']""")


def find_io_failure(error: BaseException) -> tuple[str, str | None] | None:
    """(cause, path or None) of the first storage failure in `error`'s chain, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RunIOError):
            return error.cause, error.path
        if isinstance(error, OSError) and error.errno in IO_ERRNOS:
            return os.strerror(error.errno), error.filename
        text = str(error)
        for words in _STRERRORS:
            if words in text:
                path = _QUOTED_PATH.search(text)
                return words, path.group(1) if path else None
        error = error.__cause__ or error.__context__
    return None
