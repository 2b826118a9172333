"""Runs that survive, part two, driven through `python train.py` as a user runs it.

Damaged checkpoints are refused with nothing changed on disk; a finished run is left byte for
byte; one run per workdir, and a killed run's lock is taken over; every check before the first
step; a full disk ends with one message and the last good checkpoint intact; 'skip' gives up.
"""

import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
from helpers.train_process import (
    REPO_ROOT,
    RUN_CONFIG,
    TRAIN_SCRIPT,
    checkpoint_arrays,
    checkpoint_steps,
    log_tail,
    run_command,
    run_training,
    start_training,
    subprocess_env,
    train_records,
    wait_for_checkpoint,
)

from jrope.train.checkpoints import LOCK_FILE

TINY = f"--config={RUN_CONFIG}"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return subprocess_env(1)


def _train(workdir, env, *args) -> subprocess.CompletedProcess:
    return run_command(["train.py", TINY, f"--workdir={workdir}", *args], env)


def _contents(workdir) -> dict[str, str]:
    """Every file under the workdir but its lock: relative path -> SHA-256 of its bytes."""
    digests = {}
    for root, _, names in os.walk(workdir):
        for name in names:
            if name != LOCK_FILE:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    digests[os.path.relpath(path, workdir)] = hashlib.sha256(f.read()).hexdigest()
    return digests


def _largest_data_file(workdir, step: int) -> str:
    data = os.path.join(workdir, "checkpoints", str(step), "state", "ocdbt.process_0", "d")
    return max((os.path.join(data, name) for name in os.listdir(data)), key=os.path.getsize)


def _flip_one_bit(data: bytes, attempt: int) -> bytes:
    damaged = bytearray(data)
    damaged[(len(data) // 2 + 97 * attempt) % len(data)] ^= 0x10
    return bytes(damaged)


def _write_random_bytes(data: bytes, attempt: int) -> bytes:
    damaged = bytearray(data)
    start = (max(len(data) // 2 - 2048, 0) + 509 * attempt) % len(data)
    damaged[start : start + 4096] = os.urandom(len(damaged[start : start + 4096]))
    return bytes(damaged)


def _damage_until_the_state_changes(path, original: bytes, damage, workdir, intact) -> None:
    """Write damage(original, attempt) to `path` for attempt 0, 1, ... until checkpoint 16 reads
    differently (or not at all): a flipped bit in a byte no restore reads is no damage."""
    for attempt in range(20):
        with open(path, "wb") as f:
            f.write(damage(original, attempt))
        try:
            restored = checkpoint_arrays(workdir, 16)
        except Exception:  # unreadable: damage enough
            return
        if any(not np.array_equal(a, b) for a, b in zip(restored, intact, strict=False)):
            return
    raise AssertionError(f"no damage of {path} changed what checkpoint 16 restores")


def _strict_json_lines(path) -> list[dict]:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    with open(path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


@pytest.mark.slow
def test_finished_run_is_left_as_it_is_and_damage_is_refused_with_nothing_changed(tmp_path, env):
    workdir = tmp_path / "run"
    assert _train(workdir, env, "--config.num_steps=16").returncode == 0
    finished = _contents(workdir)
    assert "eval_step16/eval.csv" in finished and "checkpoints/8/digests/metadata" in finished

    # The same command again: the run is finished, its results stay byte for byte.
    again = _train(workdir, env, "--config.num_steps=16")
    assert again.returncode == 0, again.stderr
    assert f"Finished earlier: python eval.py --workdir={workdir} evaluates again." in again.stdout
    assert "| 8 |" in again.stdout  # the results table, read back
    assert _contents(workdir) == finished

    # Fewer steps than the latest checkpoint: refused with the fix, nothing written.
    fewer = _train(workdir, env, "--config.num_steps=8")
    assert fewer.returncode == 2
    assert f"num_steps = 8 is below {workdir}'s latest checkpoint, step 16" in fewer.stderr
    assert "set num_steps >= 16, or use python eval.py" in fewer.stderr
    assert _contents(workdir) == finished

    damaged_file = _largest_data_file(workdir, 16)
    original = open(damaged_file, "rb").read()
    intact = checkpoint_arrays(workdir, 16)
    for damage in (_flip_one_bit, _write_random_bytes):
        _damage_until_the_state_changes(damaged_file, original, damage, workdir, intact)
        before = _contents(workdir)
        refused = _train(workdir, env, "--config.num_steps=16")
        assert refused.returncode == 4, refused.stdout + refused.stderr
        message = refused.stderr
        assert "Traceback" not in message
        checkpoint = workdir / "checkpoints" / "16"
        # Either the digests differ, or the damage breaks the compression: the array is named.
        assert re.search(
            rf"^Checkpoint {checkpoint} (digest mismatch in (params|opt_state)/\S+"
            rf"|cannot be read \(.*(params|opt_state)\.)",
            message,
        ), message
        aside = workdir / "damaged_checkpoints"
        assert message.endswith(
            f"; resume from step 8: mkdir -p {aside} && mv {checkpoint} {aside}/.\n"
        )
        assert _contents(workdir) == before  # nothing deleted, results untouched
    assert finished["eval_step16/eval.csv"] == _contents(workdir)["eval_step16/eval.csv"]


@pytest.mark.slow
def test_one_run_per_workdir_and_a_killed_runs_lock_is_taken_over(tmp_path, env):
    workdir = tmp_path / "run"
    first = start_training(workdir, env, "--config.num_steps=100000")
    try:
        wait_for_checkpoint(workdir, 8, first)
        second = _train(workdir, env, "--config.num_steps=100000")
        assert second.returncode == 6, second.stderr
        assert (
            f"{workdir / LOCK_FILE} is held (training by process {first.pid} on "
            f"{socket.gethostname()} since " in second.stderr
        )
        assert second.stderr.endswith("wait, or use another --workdir.\n")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    latest = checkpoint_steps(workdir)[-1]
    end = latest + 8
    resumed = run_training(workdir, env, f"--config.num_steps={end}")
    log = log_tail(resumed, lines=10_000)
    assert f"Taking over {workdir / LOCK_FILE} (training by process {first.pid} on" in log
    # Each step once (the killed run's steps after its checkpoint were dropped), valid JSON.
    assert [record["step"] for record in train_records(workdir)] == list(range(1, end + 1))
    records = _strict_json_lines(workdir / "metrics.jsonl")
    assert sum("eval_8/loss" in record for record in records) == 1
    assert (workdir / LOCK_FILE).read_text() == ""  # released cleanly


@pytest.mark.slow
def test_every_problem_of_the_config_is_reported_at_once(tmp_path):
    result = run_command(
        [
            "train.py",
            TINY,
            f"--workdir={tmp_path}/run",
            "--config.model.compute_dtype=float16",  # one section's choice
            "--config.opt.schedule=linear",  # another's
            "--config.eval.num_sequences=0",  # an evaluation size
            "--config.pe.name=jordan_ropee",  # the encoding
            "--config.batch_size=7",  # the batch against the 2 devices: once the config converts
        ],
        subprocess_env(2),
    )
    assert result.returncode == 2
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert result.stderr.startswith("Found before compiling (docs/runs.md):\n  - ")
    assert len(problems) == 4, result.stderr
    for key in ("model.compute_dtype", "opt.schedule", "eval.num_sequences", "pe.name"):
        assert any(key in problem for problem in problems), key
    assert not (tmp_path / "run").exists()


# Stabilized Jordan-RoPE at a learning rate of 1e38: after the first update its damping and
# shear overflow, so every later step is non-finite and so is the evaluation.
DIVERGING = [
    "--config.pe.name=jordan_rope",
    "--config.opt.learning_rate=1e38",
    "--config.opt.nonfinite=skip",
]


@pytest.mark.slow
def test_skip_gives_up_after_too_many_skipped_steps_in_a_row(tmp_path, env):
    workdir = tmp_path / "run"
    result = _train(workdir, env, *DIVERGING, "--config.opt.max_consecutive_skips=4")
    assert result.returncode == 5, result.stderr
    gave_up = re.search(
        r"Steps (\d+) to (\d+) skipped \((loss|grad_norm) not finite\): resume from ",
        result.stderr,
    )
    assert gave_up and int(gave_up.group(2)) - int(gave_up.group(1)) == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert not list(workdir.glob("eval_step*"))


@pytest.mark.slow
def test_a_nan_evaluation_is_a_failure_not_a_result(tmp_path, env):
    workdir = tmp_path / "run"
    result = _train(workdir, env, *DIVERGING, "--config.opt.max_consecutive_skips=1000")
    assert result.returncode == 5, result.stderr
    assert re.search(
        r"Loss of .*/checkpoints/60 not finite at length 8 \(nan\); nothing written",
        result.stderr,
    ), result.stderr
    assert not list(workdir.glob("eval_step*"))
    records = _strict_json_lines(workdir / "metrics.jsonl")
    assert not [record for record in records if "eval_8/loss" in record]
    assert "nan" in {record["train/grad_norm"] for record in records}  # as a string


@pytest.mark.slow
def test_a_full_disk_ends_with_one_message_and_the_last_checkpoint_resumes(tmp_path):
    # A file-size limit stands in for a full disk: a write beyond it fails (EFBIG) as one beyond
    # the free space would (ENOSPC). Checkpoint files stay below it; metrics.jsonl grows past it.
    workdir = tmp_path / "run"
    env = subprocess_env(1)
    del env["JAX_COMPILATION_CACHE_DIR"]  # its files would meet the limit too
    limit = 40_000
    # Set in a small Python that then becomes train.py (exec), not in a preexec_fn: forking
    # this multithreaded (JAX) process to run Python code in the child could deadlock.
    with_size_limit = [
        sys.executable,
        "-c",
        "import os, resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n",
    ]
    command = [sys.executable, TRAIN_SCRIPT, TINY, f"--workdir={workdir}", "--config.num_steps=200"]
    failed = subprocess.run(
        with_size_limit + command[1:], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert failed.returncode == 7, failed.stderr
    assert failed.stderr == "Storage failure: File too large; free space and run it again.\n"
    latest = checkpoint_steps(workdir)[-1]
    resumed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming from checkpoint {workdir / 'checkpoints' / str(latest)}." in resumed.stdout
    assert [record["step"] for record in train_records(workdir)] == list(range(1, 201))
