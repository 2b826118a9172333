"""Paths that may be local or on an object store, and writing a local data file whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable

from etils import epath


def is_uri(path: epath.PathLike) -> bool:
    """Whether `path` names an object store (`gs://bucket/...`) rather than a local file."""
    return "://" in os.fspath(path)


def resolved(path: epath.PathLike) -> epath.Path:
    """`path` as an epath.Path: local paths made absolute (with ~ expanded), URIs as they are.

    Never `os.path.abspath` a URI: that turns `gs://bucket/run` into a local
    folder `gs:/bucket/run`.
    """
    if is_uri(path):
        return epath.Path(path)
    return epath.Path(os.path.abspath(os.path.expanduser(os.fspath(path))))


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
