"""One run per workdir: a lock taken when a training run starts.

Two runs writing one workdir save into the same checkpoint directories and
log every step twice; the second must be refused before it writes anything.

The lock is an advisory `flock` on `<workdir>/run.lock`, held by process 0
of the run for its whole life. The kernel releases it when the process ends,
however it ends: a run killed with -9 leaves no lock behind, only the file,
whose contents (the host and process id of its last holder) tell the next
run that it takes over from a run that did not finish cleanly. A clean end
empties the file. flock works on local disks and on NFS (Linux maps it to
NFS locks).

Object stores (gs://...) have no locks: there the run says so and goes on,
and keeping to one run per workdir is the user's part.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from absl import logging

from jrope.data.files import is_uri
from jrope.errors import WorkdirBusy

LOCK_FILE = "run.lock"


class WorkdirLock:
    """Context manager holding `<workdir>/run.lock` (a no-op when `enabled` is False).

    enabled: only one process of a multi-process run takes the lock.
    """

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._enabled = enabled and not is_uri(workdir)
        self._file = None
        self.previous_holder: dict | None = None  # a holder that ended without releasing it
        if enabled and is_uri(workdir):
            logging.warning(
                "%s is on an object store, which has no locks: make sure no other run uses this "
                "workdir while this one runs.",
                workdir,
            )

    def __enter__(self) -> WorkdirLock:
        if not self._enabled:
            return self
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        handle = open(self.path, "a+", encoding="utf-8")  # noqa: SIM115 (held until __exit__)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(handle)
            handle.close()
            raise WorkdirBusy(
                f"Another run is using {os.path.dirname(self.path)}: {describe_holder(holder)} "
                f"holds {self.path}. Wait for it to end (or stop it), or choose another --workdir."
            ) from None
        self.previous_holder = _read_holder(handle)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_this_process()) + "\n")
        handle.flush()
        self._file = handle
        return self

    def __exit__(self, *exc_info) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()  # an empty file: released cleanly
        self._file.flush()
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None


def _this_process() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _read_holder(handle) -> dict | None:
    handle.seek(0)
    text = handle.read().strip()
    try:
        return json.loads(text) if text else None
    except json.JSONDecodeError:
        return {"host": "?", "pid": "?", "started": text[:40]}


def describe_holder(holder: dict | None) -> str:
    """'process 1234 on host-a (started 2026-12-01 10:00:00)'."""
    if holder is None:
        return "a process that wrote no details"
    return f"process {holder['pid']} on {holder['host']} (started {holder['started']})"
