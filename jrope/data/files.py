"""Paths that may be local or on an object store: writing a local file whole or not at all, an
object written whole from memory, and whether a bucket URI can be used at all."""

from __future__ import annotations

import io
import math
import os
import tempfile
import threading
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

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
    """Writes the chunks to ``path`` through a temporary file in the same folder, renamed into
    place: a reader never sees half a file, and racing processes rename the same bytes."""
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


# Longest time between two rewrites of an object in a bucket while a run logs.
UPLOAD_INTERVAL_S = 30.0


class BucketObject:
    """A file-like object in a bucket, written whole from memory: on `flush` at most every
    UPLOAD_INTERVAL_S (the first at once unless `uploaded_at` says otherwise), on `upload`."""

    def __init__(self, path: epath.PathLike, data: bytes = b"", uploaded_at: float = -math.inf):
        self._path = epath.Path(path)
        self._data = io.BytesIO(data)
        self._data.seek(0, io.SEEK_END)
        self._uploaded_at = uploaded_at

    def write(self, data: bytes) -> None:
        self._data.write(data)

    def flush(self) -> None:
        if time.monotonic() - self._uploaded_at >= UPLOAD_INTERVAL_S:
            self.upload()

    def upload(self) -> None:
        self._path.write_bytes(self._data.getvalue())
        self._uploaded_at = time.monotonic()

    close = upload


# How long a bucket may take to answer before the run stops (offline, gcsfs retries for minutes).
STORAGE_TIMEOUT_S = 30.0
# URI schemes etils.epath reads and writes (through fsspec: gcsfs, s3fs, adlfs).
SUPPORTED_SCHEMES = ("gs", "s3", "az")


def uri_problem(
    uri: str, what: str, *, must_exist: bool = False, timeout_s: float = STORAGE_TIMEOUT_S
) -> str | None:
    """Why `uri` cannot be used, e.g. for what='--workdir'; None when its bucket answered
    within `timeout_s` and, with `must_exist` (data), the object or folder itself is there."""
    parts = urlsplit(uri)
    bucket = f"{parts.scheme}://{parts.netloc}"
    if parts.scheme not in SUPPORTED_SCHEMES or not parts.netloc:
        return (
            f"{what} {uri}: not a local path and not a bucket URI jrope can use "
            f"({', '.join(s + '://bucket/...' for s in SUPPORTED_SCHEMES)}); fix the path."
        )
    answer: dict = {}

    def ask() -> None:
        try:
            answer["exists"] = epath.Path(uri if must_exist else bucket).exists()
        except BaseException as error:  # noqa: BLE001  (any failure is reported, named)
            answer["error"] = error

    thread = threading.Thread(target=ask, name=f"probe {bucket}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    error = answer.get("error")
    if thread.is_alive():
        return (
            f"{what} {uri}: bucket {bucket} did not answer within {timeout_s:g} s; check the "
            "network and the credentials (gcloud auth application-default login), or use a "
            "local path."
        )
    if isinstance(error, ImportError):
        install = f"install fsspec's {parts.scheme} filesystem"
        if parts.scheme == "gs":
            install = "pip install 'jrope[gcs]' (or: pip install gcsfs)"
        return f"{what} {uri}: reading {parts.scheme}:// needs its filesystem: {install}."
    if error is not None:
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        return (
            f"{what} {uri}: cannot reach bucket {bucket} ({type(error).__name__}: {cause}); "
            "check the bucket name, the network and the credentials."
        )
    if answer["exists"]:
        return None
    if must_exist:
        return f"{what} {uri} does not exist in bucket {bucket}; fix the path."
    return (
        f"{what} {uri}: bucket {bucket} does not exist or these credentials cannot see it; "
        f"create it (gcloud storage buckets create {bucket}) or fix the name."
    )
