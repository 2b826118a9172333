"""Runs that survive: SIGKILL and SIGTERM mid-run, unfinished saves, corrupt or foreign checkpoints.

The interruption tests run `python train.py` as a subprocess (tests/helpers/train_process.py) and
compare against one uninterrupted run of the same command: the final checkpoint must be
bitwise equal (step, parameters, optimizer state) and so must the logged final loss.
"""

import os
import shutil
import signal

import numpy as np
import pytest
from helpers.tiny_config import tiny_config
from helpers.train_process import (
    checkpoint_arrays,
    checkpoint_steps,
    log_tail,
    run_training,
    start_training,
    subprocess_env,
    train_records,
    wait_for_checkpoint,
    wait_for_step,
)

from jrope.errors import CheckpointError
from jrope.train.checkpoints import LOCK_FILE
from jrope.train.trainer import train_and_evaluate

NUM_STEPS = 60  # tests/helpers/subprocess_run_config.py
EVERY_STEPS = 8


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Workdir of one run of train.py from start to end (it also fills the compilation cache)."""
    workdir = tmp_path_factory.mktemp("uninterrupted") / "run"
    run_training(workdir, subprocess_env(1))
    return workdir


def _assert_same_end(resumed, uninterrupted):
    assert checkpoint_steps(resumed)[-1] == NUM_STEPS
    for got, want in zip(
        checkpoint_arrays(resumed, NUM_STEPS),
        checkpoint_arrays(uninterrupted, NUM_STEPS),
        strict=False,
    ):
        np.testing.assert_array_equal(got, want)  # bitwise: same dtype, same values
    got_last, want_last = train_records(resumed)[-1], train_records(uninterrupted)[-1]
    assert got_last["step"] == want_last["step"] == NUM_STEPS
    assert got_last["train/loss"] == want_last["train/loss"]


def _unfinished_saves(workdir) -> list[str]:
    """The temporary directories of interrupted saves in the workdir's checkpoints."""
    return [path.name for path in (workdir / "checkpoints").glob("*.orbax-checkpoint-tmp*")]


@pytest.mark.slow
def test_sigkill_at_any_step_then_rerun_ends_bitwise_equal(tmp_path, uninterrupted):
    env = subprocess_env(1)
    workdir = tmp_path / "run"
    process = start_training(workdir, env)
    wait_for_checkpoint(workdir, EVERY_STEPS, process)  # then kill at whatever step it is at
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    killed_at = train_records(workdir)[-1]["step"]
    latest = checkpoint_steps(workdir)[-1]
    assert EVERY_STEPS <= latest <= killed_at < NUM_STEPS
    assert not os.path.exists(workdir / f"eval_step{NUM_STEPS}")
    # A save interrupted mid-write leaves a temporary directory; plant one for a later step than
    # any finished checkpoint, holding a real checkpoint's files: it must never be restored.
    shutil.copytree(
        workdir / "checkpoints" / str(latest),
        workdir / "checkpoints" / f"{NUM_STEPS - 4}.orbax-checkpoint-tmp-17",
    )

    rerun = run_training(workdir, env)
    log = log_tail(rerun, lines=10_000)
    assert f"Resuming from checkpoint {workdir / 'checkpoints' / str(latest)}." in log
    assert _unfinished_saves(workdir) == []  # orbax removed the leftover
    _assert_same_end(workdir, uninterrupted)
    # The resumed run dropped the killed run's records after the checkpoint and logged those
    # steps again: every step once, in order.
    steps = [record["step"] for record in train_records(workdir)]
    assert steps == list(range(1, NUM_STEPS + 1))


@pytest.mark.slow
def test_sigterm_saves_the_current_step_and_rerun_resumes_there(tmp_path, uninterrupted):
    env = subprocess_env(1)
    workdir = tmp_path / "run"
    process = start_training(workdir, env)
    wait_for_step(workdir, EVERY_STEPS + 3, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 143, log_tail(process)
    log = log_tail(process, lines=10_000)
    stopped_at = train_records(workdir)[-1]["step"]
    saved = workdir / "checkpoints" / str(stopped_at)
    assert f"Preempted (SIGTERM) at step {stopped_at}: saved {saved}; run again to resume." in log
    # The checkpoint is of the step the run stopped at, finished (not a temporary directory).
    assert checkpoint_steps(workdir)[-1] == stopped_at and EVERY_STEPS + 3 <= stopped_at < NUM_STEPS
    assert _unfinished_saves(workdir) == []

    rerun = run_training(workdir, env)
    assert f"Resuming from checkpoint {saved}." in log_tail(rerun, lines=10_000)
    _assert_same_end(workdir, uninterrupted)


@pytest.fixture(scope="module")
def trained_two_steps(tmp_path_factory):
    """A workdir holding checkpoint 2 of the tiny jordan_rope config (d_model 32)."""
    workdir = tmp_path_factory.mktemp("trained") / "run"
    train_and_evaluate(tiny_config(**{"mesh.data": -1}), str(workdir))
    return workdir


def _snapshot(directory) -> dict[str, tuple[int, int]]:
    """Every file under `directory` but the workdir lock (which records each run that takes it):
    relative path -> (size, modification time in ns)."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            if name == LOCK_FILE:
                continue
            path = os.path.join(root, name)
            files[os.path.relpath(path, directory)] = (
                os.path.getsize(path),
                os.stat(path).st_mtime_ns,
            )
    return files


@pytest.mark.slow
@pytest.mark.parametrize("truncated", ["array_chunks", "_METADATA"])
def test_truncated_checkpoint_file_names_the_checkpoint_and_deletes_nothing(
    tmp_path, trained_two_steps, truncated
):
    workdir = tmp_path / "run"
    shutil.copytree(trained_two_steps, workdir)
    state_dir = workdir / "checkpoints" / "2" / "state"
    if truncated == "array_chunks":
        # Every chunk file: OCDBT directories also hold files a restore never reads, and cutting
        # only such a file would change nothing.
        files = [p for p in state_dir.rglob("*") if p.is_file() and p.parent.name == "d"]
    else:
        files = [state_dir / "_METADATA"]
    for path in files:
        os.truncate(path, path.stat().st_size // 2)
    before = _snapshot(workdir)
    with pytest.raises(CheckpointError) as caught:
        train_and_evaluate(tiny_config(num_steps=4, **{"mesh.data": -1}), str(workdir))
    message = str(caught.value)
    assert message.startswith(f"Checkpoint {workdir / 'checkpoints' / '2'} cannot be read (")
    assert message.endswith("); start again in another --workdir.")  # none earlier has digests
    assert _snapshot(workdir) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, difference",
    [
        ({"model.d_model": 64}, "model.d_model is 32 there, 64 now"),
        ({"pe.name": "rope"}, "pe.name is 'jordan_rope' there, 'rope' now"),
        (
            {"opt.clip_norm": 0.0},
            "opt.clip_norm is 1.0 there, 0.0 now (another optimizer state)",
        ),
    ],
)
def test_checkpoint_of_other_parameters_is_refused_with_the_difference(
    tmp_path, trained_two_steps, overrides, difference
):
    workdir = tmp_path / "run"
    shutil.copytree(trained_two_steps, workdir)
    before = _snapshot(workdir)
    with pytest.raises(CheckpointError) as caught:
        train_and_evaluate(tiny_config(num_steps=4, **{"mesh.data": -1}, **overrides), str(workdir))
    message = str(caught.value)
    assert message == (
        f"{workdir / 'checkpoints' / '2'} holds other settings: {difference}; name them in "
        "checkpoint.accept_changes, or use another --workdir."
    )
    assert _snapshot(workdir) == before
