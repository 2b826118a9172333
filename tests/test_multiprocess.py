"""A real multi-process run: two `train.py` processes with 4 CPU devices each, one 8-device mesh.

The processes find each other through `jax.distributed` (a coordinator on 127.0.0.1, a free
port) and run cross-process collectives with gloo. Each loads half of every batch. The losses,
the evaluation and the final parameters must match one process with 8 devices (up to the
order of the float32 sums in the all-reduce). A SIGTERM to one process stops both at one
agreed step with one checkpoint, from which both resume.
"""

import re
import signal

import numpy as np
import pytest
from helpers.train_process import (
    checkpoint_arrays,
    checkpoint_steps,
    free_port,
    log_tail,
    start_training,
    subprocess_env,
    train_records,
    wait_for_step,
)

from jrope import results

NUM_STEPS = 16
STEPS_FLAG = f"--config.num_steps={NUM_STEPS}"


def _start_pair(workdir, env, tag):
    port = free_port()
    return [
        start_training(
            workdir,
            env,
            STEPS_FLAG,
            "--verbosity=0",  # each process's device line (an INFO record)
            f"--coordinator_address=127.0.0.1:{port}",
            "--num_processes=2",
            f"--process_id={index}",
            log_path=f"{workdir}.{tag}.process{index}.log",
        )
        for index in range(2)
    ]


def _wait_all(processes, timeout=300):
    return [process.wait(timeout=timeout) for process in processes]


@pytest.fixture(scope="module")
def pair_env(tmp_path_factory):
    """Environment of the 4-device processes; their compilation cache is shared by this module's runs."""
    return subprocess_env(4)


@pytest.fixture(scope="module")
def single_process_run(tmp_path_factory):
    """One process with 8 devices, the reference: started at once, awaited by `finished`."""
    workdir = tmp_path_factory.mktemp("single") / "run"
    process = start_training(workdir, subprocess_env(8), STEPS_FLAG)

    def finished():
        assert process.wait(timeout=300) == 0, log_tail(process)
        return workdir

    yield finished
    process.kill()  # only if a test failed before waiting for it
    process.wait()


def _assert_matches_single_process(workdir, single_process_run):
    single = single_process_run()
    got, want = train_records(workdir), train_records(single)
    assert (
        [r["step"] for r in got][-NUM_STEPS:]
        == [r["step"] for r in want]
        == list(range(1, NUM_STEPS + 1))
    )
    np.testing.assert_allclose(
        [r["train/loss"] for r in got][-NUM_STEPS:], [r["train/loss"] for r in want], rtol=1e-5
    )
    for got_array, want_array in zip(
        checkpoint_arrays(workdir, NUM_STEPS), checkpoint_arrays(single, NUM_STEPS), strict=False
    ):
        np.testing.assert_allclose(got_array, want_array, rtol=1e-5, atol=1e-6)
    got_loss, want_loss = (
        float(results.read_csv(run / f"eval_step{NUM_STEPS}" / "eval.csv")[0]["loss"])
        for run in (workdir, single)
    )
    assert got_loss == pytest.approx(want_loss, rel=1e-5)


@pytest.mark.slow
def test_two_processes_train_like_one_process_with_eight_devices(
    tmp_path_factory, pair_env, single_process_run
):
    workdir = tmp_path_factory.mktemp("pair") / "run"
    processes = _start_pair(workdir, pair_env, "run")
    assert _wait_all(processes) == [0, 0], "\n".join(log_tail(p) for p in processes)
    for index, process in enumerate(processes):
        log = log_tail(process, lines=100_000)
        assert f"JAX process {index} of 2; local devices" in log and "all devices 8." in log
    # The console lines come from process 0 alone.
    log = log_tail(processes[0], lines=100_000)
    assert "mesh {'data': 8, 'fsdp': 1, 'tensor': 1} over 8 cpu devices, 2 process(es)" in log
    assert "Training rope" not in log_tail(processes[1], lines=100_000)
    _assert_matches_single_process(workdir, single_process_run)


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_one_step_and_both_resume(
    tmp_path_factory, pair_env, single_process_run
):
    workdir = tmp_path_factory.mktemp("preempted") / "run"
    processes = _start_pair(workdir, pair_env, "first")
    wait_for_step(workdir, 3, processes[0])
    processes[1].send_signal(signal.SIGTERM)  # the notice reaches one host only
    assert _wait_all(processes) == [143, 143], "\n".join(log_tail(p) for p in processes)
    stopped = [
        int(
            re.search(
                r"Preempted \(SIGTERM\) at step (\d+): saved ", log_tail(p, lines=100_000)
            ).group(1)
        )
        for p in processes
    ]
    assert stopped[0] == stopped[1] < NUM_STEPS and checkpoint_steps(workdir)[-1] == stopped[0]

    resumed = _start_pair(workdir, pair_env, "second")
    assert _wait_all(resumed) == [0, 0], "\n".join(log_tail(p) for p in resumed)
    resumed_from = f"Resuming from checkpoint {workdir / 'checkpoints' / str(stopped[0])}."
    assert resumed_from in log_tail(resumed[0], 100_000)  # the console is process 0's
    _assert_matches_single_process(workdir, single_process_run)
