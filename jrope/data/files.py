"""Writing a data file whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable


def write_atomically(path: str, chunks: Iterable[bytes]) -> None:
    """Writes the chunks to ``path`` through a temporary file in the same folder, renamed into place.

    A reader never sees half a file; processes that race to write the same
    file each write their own temporary file and rename it over the same
    name with the same bytes.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".partial-")
    try:
        with os.fdopen(handle, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the file from other users
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
