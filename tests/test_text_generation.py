"""Text from a trained run's workdir: loading without the data, sample.py, and the workdirs it refuses.

A 2-step byte-level run on a small text file (scaled-exact Jordan-RoPE,
the WikiText configs' encoding) gives sample.py a real workdir.
"""

import itertools
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest
from helpers.tiny_config import tiny_config, tiny_text_config_dict
from helpers.train_process import REPO_ROOT, subprocess_env

from jrope.errors import CheckpointError, UsageError
from jrope.experiments.text_generation import load_text_run
from jrope.model.generation import GenerationSettings
from jrope.train.checkpoints import Checkpointer
from jrope.train.config import TrainConfig
from jrope.train.trainer import train_and_evaluate

SAMPLE_SCRIPT = os.path.join(REPO_ROOT, "sample.py")
PROMPTS = [" = Section 3", "Le homard"]


@pytest.fixture(scope="module")
def text_workdir(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("text_run")
    config = tiny_text_config_dict(tmp_path, **{"eval.lengths": (16,)})
    # The corpus goes away with the run's data: sampling must not need it.
    train_and_evaluate(TrainConfig.from_config_dict(config), str(tmp_path / "run"))
    os.remove(config.data.path)
    return str(tmp_path / "run")


def _sample(workdir, *flags, tmp_path):
    command = [sys.executable, SAMPLE_SCRIPT, f"--workdir={workdir}", *flags]
    env = subprocess_env(1)
    return subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, cwd=REPO_ROOT
    )


@pytest.mark.slow
def test_cached_and_recomputed_text_agree_at_offsets_0_and_60000(text_workdir):
    run = load_text_run(text_workdir)
    assert run.step == 2 and run.cfg.pe.name == "jordan_exact_scaled"
    for offset in (0, 60000):
        settings = {"num_tokens": 24, "position_offset": offset, "rebase_bound": 8}
        cached = run.generate(PROMPTS, GenerationSettings(**settings))
        recomputed = run.generate(PROMPTS, GenerationSettings(use_cache=False, **settings))
        assert cached == recomputed
        assert all(len(text.encode()) <= 24 for text in cached)


@pytest.mark.slow
def test_sample_py_prints_the_same_text_with_and_without_the_cache(text_workdir, tmp_path):
    flags = ["--prompt= = Section", "--num_tokens=16", "--temperature=0"]
    flags += ["--position_offset=60000", "--rebase_bound=8"]
    cached = _sample(text_workdir, *flags, tmp_path=tmp_path)
    recomputed = _sample(text_workdir, *flags, "--no_cache", tmp_path=tmp_path)
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert recomputed.returncode == 0, recomputed.stderr[-2000:]
    assert cached.stdout == recomputed.stdout and cached.stdout.strip()
    refused = _sample(text_workdir, "--prompt=x", "--position_offset=2147483600", tmp_path=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "at most 45 new tokens fit" in refused.stderr and "Traceback" not in refused.stderr
    assert refused.stderr.count("\n") == 1  # before the damping's note: the refusal alone
    no_room = _sample(text_workdir, "--prompt=x", "--position_offset=2147483646", tmp_path=tmp_path)
    assert no_room.returncode == 2, no_room.stderr
    assert "an offset of at most" in no_room.stderr and "Traceback" not in no_room.stderr
    # Positions that fit int32, a cache that fits no memory: refused by XLA's count, before it runs.
    huge = _sample(text_workdir, "--prompt=x", "--num_tokens=2147483000", tmp_path=tmp_path)
    assert huge.returncode == 2, huge.stderr
    refusal = huge.stderr.splitlines()[-1]  # (after the damping's warning)
    assert refusal.startswith("--num_tokens=2147483000: generating needs ")
    assert refusal.endswith("; lower --num_tokens or the prompts.")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_end_sample_py_within_seconds(text_workdir, signum):
    command = [sys.executable, SAMPLE_SCRIPT, f"--workdir={text_workdir}", "--prompt=x"]
    command += ["--num_tokens=200000", "-v", "0"]  # minutes of generation; -v 0: "Loaded ..."
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env=subprocess_env(1), cwd=REPO_ROOT
    )
    log = "".join(itertools.takewhile(lambda line: "Loaded" not in line, process.stderr))
    time.sleep(3)  # compiling, then generating
    sent = time.monotonic()
    process.send_signal(signum)
    log += process.communicate(timeout=60)[1]
    # Nothing to save: the default action, as a shell's status 128 + signum.
    assert process.returncode == -signum and time.monotonic() - sent < 5, log[-2000:]
    assert "Traceback" not in log


def test_a_synthetic_task_workdir_is_refused(tmp_path):
    # A checkpoint holding a synthetic-task config: refused from the config, before any state.
    checkpointer = Checkpointer(
        str(tmp_path / "checkpoints"),
        every_steps=1,
        max_to_keep=1,
        config_json=tiny_config().to_json_dict(),
    )
    checkpointer.save(1, {"step": jnp.zeros((), jnp.int32)}, force=True)
    checkpointer.wait_until_finished()
    checkpointer.close()
    with pytest.raises(UsageError, match="holds a 'synthetic' run, whose tokens are no text"):
        load_text_run(str(tmp_path))
    assert os.listdir(tmp_path / "checkpoints") == ["1"]  # nothing was touched


def test_a_probe_workdir_an_empty_one_or_a_file_is_refused(tmp_path):
    (tmp_path / "kernel_probe.csv").write_text("seed,task,method,context,split,mse\n")
    with pytest.raises(CheckpointError, match="holds no finished checkpoint; point it at a"):
        load_text_run(str(tmp_path))
    with pytest.raises(CheckpointError, match="holds no finished checkpoint"):
        load_text_run(str(tmp_path / "nothing_here"))
    assert not (tmp_path / "nothing_here").exists()
    with pytest.raises(
        CheckpointError, match=r"kernel_probe\.csv is a file, not a run's folder\.$"
    ):
        load_text_run(str(tmp_path / "kernel_probe.csv"))  # no advice to train into a file


@pytest.mark.slow
def test_sample_py_and_eval_py_refuse_a_workdir_without_a_checkpoint_alike(tmp_path):
    env = subprocess_env(1)
    sampled = _sample(str(tmp_path), "--prompt=x", tmp_path=tmp_path)
    evaluated = subprocess.run(
        [sys.executable, "eval.py", f"--workdir={tmp_path}", "--config.eval.lengths=(64,)"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    for result in (sampled, evaluated):
        assert result.returncode == 4, result.stderr
        assert (
            result.stderr
            == f"--workdir {tmp_path} holds no finished checkpoint; point it at a trained run.\n"
        )
