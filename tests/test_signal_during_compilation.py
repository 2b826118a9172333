"""SIGTERM and Ctrl-C while the run compiles (after "Training ...", before the train step has
compiled) or while eval.py compiles its evaluation end the command with the signal's status, never
with a crash of the interpreter's shutdown (a segmentation fault, status 139 in a shell): in the
train loop once the step is saved (143 or 130, and one line), elsewhere at once, by the signal
itself (which a shell reports as 143 or 130). The tries spread the signal over the compilation, a
compilation cache that starts empty each time."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import train_process

DELAYS_S = (0.3, 1.0, 1.7)  # after the line the command prints before compiling
STOP_LINES = {
    signal.SIGTERM: "Preempted (SIGTERM) at step",
    signal.SIGINT: "Interrupted (Ctrl-C) at",
}


def _user_env(cache_dir) -> dict[str, str]:
    """A user's environment: XLA's optimizations on, a compilation cache that starts empty."""
    env = train_process.subprocess_env(1, str(cache_dir))
    del env["JAX_DISABLE_MOST_OPTIMIZATIONS"]
    return env


def _stop_while(command, marker: str, delay: float, signum: int, env, log_path):
    """Starts `command`, sends `signum` `delay` seconds after `marker` is printed; (status, log,
    the log as it was when the signal was sent)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, *command],
            cwd=train_process.REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 240
    while marker not in log_path.read_text(errors="replace"):
        assert process.poll() is None, log_path.read_text(errors="replace")
        assert time.monotonic() < deadline
        time.sleep(0.005)
    time.sleep(delay)
    log_at_signal = log_path.read_text(errors="replace")
    process.send_signal(signum)
    status = process.wait(timeout=240)
    return status, log_path.read_text(errors="replace"), log_at_signal


def _assert_stopped(status: int, log: str, signum: int) -> None:
    assert status in (128 + signum, -signum), log  # after the save, or by the signal
    assert "Fatal Python error" not in log and "Traceback" not in log, log  # nothing swallowed
    if status > 0:
        assert log.rstrip().splitlines()[-1].startswith(STOP_LINES[signum]), log


@pytest.mark.slow
def test_a_signal_while_the_run_compiles_ends_with_its_status_and_one_line(tmp_path):
    during_compilation = 0
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGTERM)  # each signal at least once
    for index, (delay, signum) in enumerate(zip(DELAYS_S, signals, strict=True)):
        workdir = tmp_path / f"run{index}"
        command = ["train.py", f"--config={train_process.RUN_CONFIG}", f"--workdir={workdir}"]
        env = _user_env(tmp_path / f"cache{index}")
        status, log, log_at_signal = _stop_while(
            command, "Training ", delay, signum, env, tmp_path / f"run{index}.log"
        )
        _assert_stopped(status, log, signum)
        # A stop that comes inside the compilation may take effect after it (at step 1, saved).
        during_compilation += "Compiling the train step ... done" not in log_at_signal
    assert during_compilation  # at least one signal came before the train step had compiled


@pytest.mark.slow
def test_a_signal_while_eval_compiles_ends_with_its_status_and_one_line(tmp_path):
    workdir = tmp_path / "run"
    # Trained from the tests' shared cache: only the evaluation's compilation is under test.
    train_process.run_training(workdir, train_process.subprocess_env(1), "--config.num_steps=8")
    env = _user_env(tmp_path / "cache")
    stopped = 0
    for index, delay in enumerate((0.1, 0.4, 0.8)):
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)
        os.mkdir(tmp_path / "cache")  # the evaluation compiles again
        status, log, _ = _stop_while(
            # A length the step lacks each time: one it holds is not evaluated again.
            ["eval.py", f"--workdir={workdir}", f"--config.eval.lengths=({16 + 8 * index},)"],
            "Evaluating step",
            delay,
            signal.SIGTERM,
            env,
            tmp_path / f"eval{index}.log",
        )
        if "eval.md:" in log:  # the evaluation was written before the signal came
            assert status in (0, -signal.SIGTERM), log  # done, or ended by it while exiting
            assert "Traceback" not in log and "Fatal Python error" not in log, log
            continue
        assert status == -signal.SIGTERM  # outside the train loop the signal ends it at once
        _assert_stopped(status, log, signal.SIGTERM)
        stopped += 1
    assert stopped  # at least one signal came before the evaluation was written
