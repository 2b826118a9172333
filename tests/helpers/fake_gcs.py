"""An in-memory stand-in for Google Cloud Storage, so that gs:// paths work offline.

etils.epath reads and writes gs:// paths through fsspec when TensorFlow is
absent; registering this filesystem for the 'gs' and 'gcs' protocols sends
them to a dict in memory. Like GCS, and unlike a local disk, an object
cannot be appended to: opening one in append mode fails, so a writer that
would append on a bucket is caught here.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
from typing import ClassVar

from etils.epath import backend
from fsspec.implementations.memory import MemoryFileSystem

# The module (fsspec.registry, the attribute, is a read-only view of its table).
_REGISTRY = importlib.import_module("fsspec.registry")


class FakeGCS(MemoryFileSystem):
    """gs://bucket/... objects in memory (MemoryFileSystem with GCS's no-append rule)."""

    protocol = ("gs", "gcs")
    root_marker = ""
    store: ClassVar[dict] = {}  # replaced per test by install()
    pseudo_dirs: ClassVar[list] = [""]

    def __init__(self, *args, finalize_on_close: bool = False, **kwargs):
        del finalize_on_close  # epath passes GCS's option; memory needs none
        super().__init__(*args, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "a" in mode:
            raise NotImplementedError(f"GCS objects cannot be appended to: {path}")
        return super()._open(path, mode, **kwargs)


def install(monkeypatch, buckets=("bucket",)) -> FakeGCS:
    """Sends gs:// to a fresh in-memory store holding empty `buckets`; undone after the test."""
    monkeypatch.setattr(FakeGCS, "store", {})
    monkeypatch.setattr(FakeGCS, "pseudo_dirs", [""])
    for protocol in FakeGCS.protocol:
        monkeypatch.setitem(_REGISTRY._registry, protocol, FakeGCS)
    # epath keeps one filesystem per protocol: a fresh cache for the test's duration.
    cached = backend._FileSystemSpecBackend._get_filesystem
    monkeypatch.setattr(
        backend._FileSystemSpecBackend, "_get_filesystem", functools.lru_cache()(cached.__wrapped__)
    )
    filesystem = FakeGCS()
    for bucket in buckets:
        filesystem.mkdir(f"gs://{bucket}")
    return filesystem


def local_entries(directory) -> list[str]:
    """Everything under a local directory, relative paths (to show nothing was written there)."""
    root = pathlib.Path(directory)
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))
