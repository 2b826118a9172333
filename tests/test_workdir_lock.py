"""One run per workdir: the lock refuses a second holder, names the first, and is taken over."""

import json
import os
import socket

import pytest

from jrope.errors import WorkdirBusy
from jrope.train.workdir_lock import LOCK_FILE, WorkdirLock


def test_a_second_holder_is_refused_with_the_first_ones_host_and_pid(tmp_path):
    with WorkdirLock(str(tmp_path / "run")) as lock:
        assert lock.previous_holder is None
        with pytest.raises(WorkdirBusy) as refused:
            WorkdirLock(str(tmp_path / "run")).__enter__()
        message = str(refused.value)
        assert f"process {os.getpid()} on {socket.gethostname()} (started " in message
        assert message.endswith("Wait for it to end (or stop it), or choose another --workdir.")
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""  # released cleanly
    with WorkdirLock(str(tmp_path / "run")) as lock:  # and free again
        assert lock.previous_holder is None


def test_the_lock_of_a_process_that_died_is_taken_over(tmp_path):
    # What a killed run leaves: the file with its holder, but no lock (the kernel dropped it).
    holder = {"host": "elsewhere", "pid": 12345, "started": "2026-12-01 10:00:00"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder) + "\n")
    with WorkdirLock(str(tmp_path)) as lock:
        assert lock.previous_holder == holder
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_only_the_enabled_process_locks_and_object_stores_are_not_locked(tmp_path):
    with WorkdirLock(str(tmp_path), enabled=False):
        with WorkdirLock(str(tmp_path)):  # another process of the same run: no conflict
            pass
    with WorkdirLock("gs://bucket/run") as lock:  # warns; nothing to lock
        assert lock.previous_holder is None
