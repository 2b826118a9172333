"""Where the metrics land: metrics.jsonl and TensorBoard event files, on a local disk or a bucket.

Every path goes through `etils.epath`, so a workdir may be a local folder or
an object store (`gs://bucket/run`, with the `gcs` extra). Object stores
cannot append to an object: there a log is kept in memory and the whole
object is rewritten, at most every UPLOAD_INTERVAL_S seconds and whenever
the log is flushed or closed (checkpoints, preemption, the end of the run).
A local log is appended to and flushed line by line.

TensorBoard event files are written by tensorboardX, which for `gs://`
would need the google-cloud-storage client; `EpathEventFile` takes that
prefix over (tensorboardX's `register_writer_factory`), so event files reach
a bucket the same way as everything else.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable

from etils import epath
from tensorboardX import record_writer

from jrope.data.files import is_uri, write_atomically

# Longest time between two rewrites of an object in a bucket while a run logs.
UPLOAD_INTERVAL_S = 30.0
# Object-store prefixes whose TensorBoard event files go through epath.
_EVENT_FILE_PREFIXES = ("gs",)


class JsonLinesLog:
    """A text log of one line per record at `path` (continued when it exists).

    Args:
      path: the log file; its folder is created if missing.
      keep: which of the lines already there to keep (a resumed run drops the
        records it will write again); None keeps them all.
    """

    def __init__(self, path: epath.PathLike, keep: Callable[[str], bool] | None = None):
        self._path = epath.Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None
        self._buffer = None
        history = self._path.read_text() if self._path.exists() else ""
        kept = "".join(line for line in history.splitlines(True) if keep is None or keep(line))
        if is_uri(self._path):
            self._buffer = io.StringIO(kept)  # a resumed run keeps its history
            self._buffer.seek(0, io.SEEK_END)
            self._uploaded_at = time.monotonic()
            return
        if kept != history:
            write_atomically(str(self._path), [kept.encode("utf-8")])
        self._file = self._path.open("a")

    def write(self, line: str) -> None:
        """Appends `line` (no newline) to the log."""
        if self._file is not None:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except OSError as error:  # a file object's errors do not name the file
                raise OSError(error.errno, error.strerror, str(self._path)) from error
            return
        self._buffer.write(line + "\n")
        if time.monotonic() - self._uploaded_at >= UPLOAD_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        """Everything written so far is in the file (rewritten whole on an object store)."""
        if self._file is not None:
            self._file.flush()
            return
        self._path.write_text(self._buffer.getvalue())
        self._uploaded_at = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()


class EpathEventFile:
    """One TensorBoard event file on an object store, written through epath.

    tensorboardX hands it the framed records; they are kept in memory and the
    object is rewritten whole (at most every UPLOAD_INTERVAL_S seconds on
    tensorboardX's periodic flushes, always on close).
    """

    def __init__(self, path: str):
        self._path = epath.Path(path)
        self._records = io.BytesIO()
        self._uploaded_at = -float("inf")

    def write(self, data: bytes) -> None:
        self._records.write(data)

    def flush(self) -> None:
        if time.monotonic() - self._uploaded_at >= UPLOAD_INTERVAL_S:
            self._upload()

    def close(self) -> None:
        self._upload()

    def _upload(self) -> None:
        self._path.write_bytes(self._records.getvalue())
        self._uploaded_at = time.monotonic()


class _EpathEventFiles:
    """tensorboardX's writer factory interface: opens event files, needs no folders made."""

    def open(self, path: str) -> EpathEventFile:
        return EpathEventFile(path)

    def directory_check(self, path: str) -> None:
        del path  # object stores have no folders to create


for _prefix in _EVENT_FILE_PREFIXES:
    record_writer.register_writer_factory(_prefix, _EpathEventFiles())


def tensorboard_writer(logdir: epath.PathLike):
    """A tensorboardX SummaryWriter for `logdir` (local, or an object store through epath)."""
    from tensorboardX import SummaryWriter

    return SummaryWriter(str(logdir))
