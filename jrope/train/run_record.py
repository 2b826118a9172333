"""What produced a workdir: one record per start of a training run, in `<workdir>/starts.jsonl`.

A result is only as good as the knowledge of what made it. Each start
(the first, and every resume) appends one JSON line: the time, the host and
process id, the command line and working directory, the step it starts from,
the versions of Python, jax, jaxlib, flax, optax and orbax, the devices,
and the whole resolved config (every key, FieldReferences resolved: what
the run really used). Nothing earlier is rewritten, so the file also tells
when settings changed on a resume.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import socket
import sys
import time
from typing import Any

import jax
from etils import epath

from jrope.train.config import TrainConfig

RECORD_FILE = "starts.jsonl"
_VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def start_record(cfg: TrainConfig, start_step: int) -> dict[str, Any]:
    """The record of this start (see the module docstring)."""
    devices = jax.devices()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "start_step": start_step,
        "versions": {"python": platform.python_version(), **_package_versions()},
        "devices": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "count": len(devices),
            "process_count": jax.process_count(),
        },
        "config": cfg.to_json_dict(),
    }


def append_start_record(workdir: str, record: dict[str, Any]) -> epath.Path:
    """Append `record` as one line of `<workdir>/starts.jsonl`; returns the file's path."""
    path = epath.Path(workdir) / RECORD_FILE
    earlier = path.read_text() if path.exists() else ""
    path.write_text(earlier + json.dumps(record) + "\n")  # whole-file writes work on object stores
    return path


def _package_versions() -> dict[str, str]:
    versions = {}
    for name in _VERSIONED:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions
