"""Running `python train.py` as a subprocess in tests: start, watch the step, read the results.

Subprocesses do not run conftest.py, so their environment is set here: CPU
only, a chosen number of fake devices, the test process's compile-time
settings (TEST_XLA_FLAGS, most XLA optimizations off) and a persistent
compilation cache shared by the runs of the tests, so that a rerun loads the
executables the first run compiled instead of compiling again (the same
executables: results stay bitwise equal).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp

from . import SHARED_COMPILATION_CACHE, TEST_XLA_FLAGS

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN_SCRIPT = os.path.join(REPO_ROOT, "train.py")
RUN_CONFIG = os.path.join(REPO_ROOT, "tests", "helpers", "subprocess_run_config.py")


def subprocess_env(num_devices: int, compilation_cache: str | None = None) -> dict[str, str]:
    """The environment of a subprocess run; compilation_cache: None for the shared one, '' for
    none, or a folder of its own (a cache that starts empty)."""
    if compilation_cache is None:
        compilation_cache = SHARED_COMPILATION_CACHE
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={num_devices}",
        JAX_DISABLE_MOST_OPTIMIZATIONS="true",
        JAX_COMPILATION_CACHE_DIR=compilation_cache,
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        PYTHONUNBUFFERED="1",
    )
    # Bytecode written (next to the sources, git-ignored) and read back: where the environment
    # turns writing off, each of the suite's hundred or so runs would compile jrope's modules
    # again, about 0.5 s of CPU each.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def start_training(
    workdir, env: dict[str, str], *extra_args: str, log_path=None
) -> subprocess.Popen:
    """`python train.py --config=<tiny config> --workdir=<workdir> <extra_args>`, output to `log_path`."""
    log_path = log_path or f"{workdir}.log"
    command = [
        sys.executable,
        TRAIN_SCRIPT,
        f"--config={RUN_CONFIG}",
        f"--workdir={workdir}",
        *extra_args,
    ]
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    process.log_path = log_path
    return process


def run_command(
    args: list[str], env: dict[str, str], timeout: float = 240
) -> subprocess.CompletedProcess:
    """`python <args>` from the repository root, as a user types it; stdout and stderr captured."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_training(
    workdir, env: dict[str, str], *extra_args: str, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Run train.py to completion; AssertionError with its log tail if it fails."""
    process = start_training(workdir, env, *extra_args)
    returncode = process.wait(timeout=timeout)
    assert returncode == 0, f"train.py exited with {returncode}:\n{log_tail(process)}"
    return process


def log_tail(process: subprocess.Popen, lines: int = 40) -> str:
    with open(process.log_path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def train_records(workdir) -> list[dict]:
    """The metrics.jsonl records holding training metrics, in file order."""
    path = os.path.join(str(workdir), "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.endswith("\n")]
    return [record for record in records if "train/loss" in record]


def wait_for_step(workdir, step: int, process: subprocess.Popen, timeout: float = 180) -> int:
    """Poll metrics.jsonl until a training step >= `step` is logged; returns the step seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = train_records(workdir)
        if records and records[-1]["step"] >= step:
            return records[-1]["step"]
        if process.poll() is not None:
            raise AssertionError(
                f"train.py ended ({process.returncode}) before step {step}:\n{log_tail(process)}"
            )
        time.sleep(0.02)
    raise AssertionError(f"no step {step} within {timeout} s:\n{log_tail(process)}")


def wait_for_checkpoint(
    workdir, step: int, process: subprocess.Popen, timeout: float = 180
) -> None:
    """Poll until checkpoint `step` is finished (renamed from its temporary directory)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.isdir(os.path.join(str(workdir), "checkpoints", str(step))):
            return
        if process.poll() is not None:
            raise AssertionError(
                f"train.py ended ({process.returncode}) before checkpoint {step}:\n{log_tail(process)}"
            )
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint {step} within {timeout} s:\n{log_tail(process)}")


def checkpoint_steps(workdir) -> list[int]:
    directory = os.path.join(str(workdir), "checkpoints")
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def checkpoint_arrays(workdir, step: int) -> list[np.ndarray]:
    """Every array of checkpoint `step`'s train state (step, params, optimizer state), as numpy.

    Read as host arrays, whatever devices wrote them (another process's device ids included).
    """
    path = os.path.join(str(workdir), "checkpoints", str(step), "state")
    checkpointer = ocp.PyTreeCheckpointer()
    leaves_metadata = checkpointer.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), leaves_metadata)
    restored = checkpointer.restore(path, restore_args=as_numpy)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(restored)]


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it for a socket bound to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
