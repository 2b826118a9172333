"""Runs that survive, part three: faults and bad inputs that once lost or mislabelled results.

Concurrent evaluations keep their rows; the last good checkpoint is one saved with no update
being skipped; memory is checked for every evaluation and sampling setting before step 1; a
resume refuses settings that change what its results mean; a checkpoint without digests is
refused like a damaged one; Ctrl-C and SIGTERM in the train loop save the step and end with their
status; command-line mistakes are one message each.
"""

import contextlib
import dataclasses
import os
import re
import signal
import threading
import time

import jax.numpy as jnp
import pytest
from helpers.tiny_config import tiny_config, tiny_config_dict, tiny_text_config_dict
from helpers.train_process import (
    RUN_CONFIG,
    checkpoint_steps,
    log_tail,
    run_command,
    start_training,
    subprocess_env,
    wait_for_step,
)

from jrope.errors import (
    CheckpointError,
    ConfigError,
    TrainingPreempted,
    UsageError,
    WorkdirBusy,
)
from jrope.experiments.compare import comparison_axes
from jrope.model import generation
from jrope.model.generation import GenerationSettings, SamplingSettings
from jrope.train import checkpoints, evaluation
from jrope.train.checkpoints import LOCK_FILE, Checkpointer, WorkdirLock, config_differences
from jrope.train.config import TrainConfig
from jrope.train.setup import set_up_run
from jrope.train.trainer import PreemptionWatch

TINY = f"--config={RUN_CONFIG}"


# 1. Concurrent evaluations.


def test_an_evaluation_waits_for_another_and_training_is_refused_meanwhile(tmp_path, capsys):
    workdir = str(tmp_path / "run")
    entered = threading.Event()
    with WorkdirLock(workdir, role="evaluation"):
        with pytest.raises(WorkdirBusy, match=r"run\.lock is held \(evaluation by process"):
            WorkdirLock(workdir, role="training").__enter__()

        def second_evaluation():
            with WorkdirLock(workdir, role="evaluation"):
                entered.set()

        waiting = threading.Thread(target=second_evaluation)
        waiting.start()
        time.sleep(0.5)
        assert not entered.is_set()  # it waits while the first holds the lock
    waiting.join(timeout=10)
    assert entered.is_set()
    assert re.search(r"Waiting for .*run\.lock \(evaluation by process", capsys.readouterr().out)


def test_an_evaluation_during_training_is_refused(tmp_path):
    workdir = tmp_path / "run"
    with WorkdirLock(str(workdir), role="training"):
        with pytest.raises(WorkdirBusy) as busy:
            WorkdirLock(str(workdir), role="evaluation").__enter__()
    assert "is held (training by process" in str(busy.value)
    assert busy.value.exit_status == 6


def test_a_lock_file_that_is_a_directory_is_named_with_the_fix(tmp_path):
    (tmp_path / LOCK_FILE).mkdir()
    with pytest.raises(UsageError, match=r"run\.lock: Is a directory; choose a writable --workdir"):
        WorkdirLock(str(tmp_path)).__enter__()


def _row(length, loss, distance=None):
    return {
        "method": "rope",
        "seed": 0,
        "step": 12,
        "length": length,
        "distance": distance,
        "num_sequences": 4,
        "loss": loss,
        "accuracy": 0.5,
        "bits_per_byte": float("nan"),
        "r2": float("nan"),
        "r2_pooled": float("nan"),
    }


def test_a_second_evaluation_merges_its_lengths_into_the_step_folder(tmp_path):
    out_dir = evaluation.results_dir(str(tmp_path), 12)
    evaluation.write_results_atomically(
        [_row(256, 1.0), _row(512, 2.0)], out_dir, task="classification"
    )
    earlier = evaluation.read_results(out_dir)
    merged = evaluation.merge_rows(earlier, [_row(512, 3.0), _row(1024, 4.0)])
    evaluation.write_results_atomically(merged, out_dir, task="classification")
    rows = evaluation.read_results(out_dir)
    assert [(row["length"], row["loss"]) for row in rows] == [(256, 1.0), (512, 3.0), (1024, 4.0)]
    assert sorted(os.listdir(tmp_path)) == ["eval_step12"]  # no second folder, no staging left
    assert "| 1024 |" in (out_dir / "eval.md").read_text()


# 2. The last good checkpoint.


def _small_state(value: float):
    return {"step": jnp.array(0, jnp.int32), "params": {"w": jnp.full((4,), value, jnp.float32)}}


def test_a_checkpoint_saved_while_skipping_is_never_the_last_good_one(tmp_path):
    checkpointer = Checkpointer(
        str(tmp_path / "checkpoints"), every_steps=1, max_to_keep=10, config_json={}
    )
    for step in (1, 2, 3):
        checkpointer.save(step, _small_state(1.0))
    checkpointer.wait_until_finished()
    # Skipping from step 3 on: checkpoint 2 led straight into it, 3 was saved during it.
    described = checkpoints.describe_last_good(checkpointer, before=2)
    assert described == str(tmp_path / "checkpoints" / "1")
    assert checkpoints.describe_last_good(checkpointer).endswith("3")  # no skips
    checkpointer.close()

    only_skipping = Checkpointer(
        str(tmp_path / "other"), every_steps=1, max_to_keep=10, config_json={}
    )
    only_skipping.save(6, _small_state(1.0))
    assert checkpoints.describe_last_good(only_skipping, before=1) == "the start"
    only_skipping.close()


# 4. What a resume may change.


def test_a_resume_refuses_settings_that_change_the_results_and_names_them():
    saved = tiny_config().to_json_dict()

    def differences(purpose="resume", **overrides):
        return config_differences(saved, tiny_config(**overrides).to_json_dict(), purpose=purpose)

    for key, value in [
        ("seed", 1),
        ("data.temperature", 0.5),
        ("batch_size", 16),
        ("opt.learning_rate", 1e-5),
        ("opt.weight_decay", 0.5),
    ]:
        refused, _ = differences(**{key: value})
        assert any(line.startswith(f"{key} is ") for line in refused), (key, refused)
    refused, changed = differences(
        **{"eval.lengths": (16, 32), "log.every_steps": 5, "checkpoint.every_steps": 7}
    )
    assert refused == [] and len(changed) == 3
    assert differences(num_steps=10) == ([], ["num_steps is 2 there, 10 now"])  # constant lr
    refused, _ = differences(num_steps=10, **{"opt.schedule": "cosine"})
    assert any("schedule spans num_steps" in line for line in refused)
    accepted = {"opt.learning_rate": 1e-5, "checkpoint.accept_changes": "opt.learning_rate"}
    assert differences(**accepted)[0] == []
    # An evaluation may use other optimiser settings, never another seed (its rows' label).
    assert differences("evaluate", **{"opt.learning_rate": 1e-5})[0] == []
    assert "seed is 0 there, 1 now" in differences("evaluate", seed=1)[0]


def test_what_defines_the_result_is_refused_everywhere_unless_accepted_the_parameters_always():
    saved = tiny_config().to_json_dict()

    def refused(purpose, **overrides):
        return config_differences(saved, tiny_config(**overrides).to_json_dict(), purpose=purpose)[
            0
        ]

    kernel = {"data.kernel": "damped_mixed"}
    for purpose in ("resume", "evaluate"):  # compare checks a finished run as a resume
        assert refused(purpose, **kernel) == [
            "data.kernel is 'mixed_raw' there, 'damped_mixed' now"
        ]
        assert refused(purpose, **kernel, **{"checkpoint.accept_changes": "data.kernel"}) == []
        wider = {"model.num_layers": 3, "checkpoint.accept_changes": "model"}
        assert refused(purpose, **wider) == ["model.num_layers is 2 there, 3 now"]


# 5. A checkpoint without digests.


@pytest.mark.slow
def test_a_checkpoint_without_digests_is_refused_unless_accepted(tmp_path):
    cfg = tiny_config(**{"mesh.data": -1})
    run = set_up_run(cfg)
    checkpointer = _checkpointer(tmp_path, cfg.to_json_dict())
    checkpointer.save(2, run.init_state(), force=True)
    checkpointer.wait_until_finished()
    digests = tmp_path / "checkpoints" / "2" / checkpoints.DIGESTS_ITEM
    for path in sorted(digests.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    digests.rmdir()
    with pytest.raises(CheckpointError) as refused:
        checkpoints.restore_compatible(checkpointer, run.layout.abstract, 2)
    assert "has no digests (accept_missing_digests=True takes it)" in str(refused.value)
    assert refused.value.exit_status == 4
    checkpointer.close()
    accepting = _checkpointer(tmp_path, cfg.to_json_dict(), accept_missing_digests=True)
    state = checkpoints.restore_compatible(accepting, run.layout.abstract, 2)
    assert int(state["step"]) == 0
    accepting.close()


def test_a_checkpoint_written_before_a_key_existed_resumes_with_its_default(tmp_path):
    cfg = TrainConfig.from_config_dict(tiny_text_config_dict(tmp_path))
    run = set_up_run(cfg)
    older = cfg.to_json_dict()
    del older["data"]["pack"]  # a key this checkpoint's code did not have yet
    older["eval"]["max_hours"] = 1.0  # and a retired one
    with contextlib.closing(_checkpointer(tmp_path, older)) as checkpointer:
        checkpointer.save(2, run.init_state(), force=True)
    with contextlib.closing(_checkpointer(tmp_path, cfg.to_json_dict())) as checkpointer:
        state = checkpoints.restore_compatible(checkpointer, run.layout.abstract, 2)
    assert int(state["step"]) == 0
    packed = TrainConfig.from_config_dict(tiny_text_config_dict(tmp_path, **{"data.pack": True}))
    with (
        contextlib.closing(_checkpointer(tmp_path, packed.to_json_dict())) as checkpointer,
        pytest.raises(CheckpointError, match="data.pack is False there, True now"),
    ):
        checkpoints.restore_compatible(checkpointer, run.layout.abstract, 2)


def _checkpointer(tmp_path, config_json, **options) -> Checkpointer:
    """The checkpoints of a run with `config_json` in tmp_path/checkpoints."""
    directory = str(tmp_path / "checkpoints")
    return Checkpointer(directory, every_steps=1, max_to_keep=2, config_json=config_json, **options)


def test_sample_num_tokens_is_checked_against_int32_positions():
    settings = GenerationSettings(num_tokens=10**10, sampling=SamplingSettings(0.0, 0, 1.0, 0))
    with pytest.raises(UsageError, match=r"--num_tokens=10000000000 .* int32") as big:
        generation.check_request(settings, 10)
    # The count named fits: the last new token's position is 10 + most - 1 <= 2**31 - 2.
    most = int(re.search(r"at most (\d+) new tokens fit", str(big.value)).group(1))
    assert most == 2**31 - 2 - 10
    generation.check_request(dataclasses.replace(settings, num_tokens=most), 10)
    with pytest.raises(UsageError, match="--position_offset="):
        offset = dataclasses.replace(settings, num_tokens=1, position_offset=2**31 - 11)
        generation.check_request(offset, 10)


# 6. Signals and command-line mistakes.


def test_ctrl_c_in_the_loop_asks_for_a_save_and_ends_with_130():
    with PreemptionWatch() as watch:
        assert watch.signum is None
        os.kill(os.getpid(), signal.SIGINT)
        assert watch.signum == signal.SIGINT
        # A second Ctrl-C does not wait for the save: the handler from before the loop takes it.
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        watch.signum = None  # as a save answers it
    stopped = TrainingPreempted(2, "/w/checkpoints/2", signal.SIGINT)
    assert stopped.exit_status == 130 and str(stopped).startswith("Interrupted (Ctrl-C) at step 2")
    assert TrainingPreempted(2, "/w/checkpoints/2").exit_status == 143


def test_a_signal_no_save_answered_takes_effect_when_the_watch_ends():
    with pytest.raises(KeyboardInterrupt):  # Python's own Ctrl-C, as it was before the watch
        with PreemptionWatch():
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.parametrize(
    "methods, seeds, problem",
    [
        (["rope"], [], "--seeds is empty"),
        (["rope"], ["0", "0"], "--seeds lists 0 more than once"),
        (["rope", "rope"], ["0"], "--methods lists rope more than once"),
        ([], ["0"], "--methods is empty: use --methods=rope,jordan_rope"),
    ],
)
def test_compare_refuses_empty_and_repeated_seeds_and_methods(methods, seeds, problem):
    with pytest.raises(UsageError, match=problem):
        comparison_axes(methods, seeds)


def test_a_negative_seed_is_one_config_problem(tmp_path):
    with pytest.raises(ConfigError) as refused:
        TrainConfig.from_config_dict(tiny_config_dict(seed=-1, **{"mesh.data": -1}))
    assert refused.value.problems == ("seed must be an integer in [0, 4294967295], got -1.",)


@pytest.mark.slow
def test_command_line_mistakes_end_in_one_line_with_their_status(tmp_path):
    env = subprocess_env(1)
    bad_config = tmp_path / "raises.py"
    bad_config.write_text("def get_config():\n    settings = {}\n    return settings['foo']\n")
    result = run_command(["eval.py", f"--config={bad_config}", f"--workdir={tmp_path}"], env)
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"{bad_config}, line 3: KeyError: 'foo'.\n"
    result = run_command(
        ["-m", "jrope.compare", TINY, "--methods=rope", "--seeds=", f"--workdir={tmp_path}/c"], env
    )
    assert result.returncode == 2 and "--seeds is empty" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "c" / "comparison.csv").exists()


@pytest.mark.slow
def test_ctrl_c_saves_the_current_step_and_sigterm_in_the_final_evaluation_says_so(tmp_path):
    env = subprocess_env(1)
    workdir = tmp_path / "run"
    process = start_training(workdir, env)
    wait_for_step(workdir, 3, process)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 130, log_tail(process)
    log = log_tail(process, lines=10_000)
    assert re.search(r"Interrupted \(Ctrl-C\) at step (\d+): saved .*; run again", log), log
    assert "Traceback" not in log

    # The final evaluation at a long length takes seconds: SIGTERM arrives during it.
    long_eval = ["--config.eval.lengths=(8,4096)", "--config.eval.num_sequences=64"]
    process = start_training(workdir, env, *long_eval, log_path=f"{workdir}.2.log")
    deadline = time.monotonic() + 240
    while "Evaluating step 60" not in log_tail(process, lines=10_000):
        assert process.poll() is None and time.monotonic() < deadline, log_tail(process)
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # outside the loop: the command ends at once
    assert process.wait(timeout=60) == -signal.SIGTERM, log_tail(process)  # a shell: 143
    assert not (workdir / "eval_step60").exists()
    assert 60 in checkpoint_steps(workdir)  # the last step was saved before its evaluation


@pytest.mark.slow
def test_the_named_last_good_checkpoint_resumes_and_a_changed_seed_is_refused(tmp_path):
    env = subprocess_env(1)
    workdir = tmp_path / "run"
    # The warm-up's first step takes no update (learning rate 0), its second ruins the
    # parameters: step 3 is the first non-finite one, so checkpoint 2 is not good either.
    diverging = [
        "--config.opt.learning_rate=1e38",
        "--config.opt.warmup_steps=4",
        "--config.opt.nonfinite=skip",
        "--config.opt.max_consecutive_skips=4",
        "--config.checkpoint.every_steps=1",
        "--config.checkpoint.max_to_keep=10",
    ]
    result = run_command(["train.py", TINY, f"--workdir={workdir}", *diverging], env)
    assert result.returncode == 5, result.stderr
    named = re.search(r"resume from \S+/checkpoints/(\d+), later ones", result.stderr)
    assert named, result.stderr
    good = int(named.group(1))
    (workdir / "aside").mkdir()
    for name in os.listdir(workdir / "checkpoints"):
        if int(name) > good:
            os.rename(workdir / "checkpoints" / name, workdir / "aside" / name)
    assert good == 1, result.stderr
    resumed = [
        "--config.opt.learning_rate=1e-3",
        "--config.opt.warmup_steps=4",
        "--config.opt.nonfinite=skip",
    ]
    result = run_command(["train.py", TINY, f"--workdir={workdir}", *resumed], env)
    assert result.returncode == 4 and "opt.learning_rate is 1e+38 there" in result.stderr
    result = run_command(
        ["train.py", TINY, f"--workdir={workdir}", *resumed, "--config.seed=1"], env
    )
    assert result.returncode == 4 and "seed is 0 there, 1 now" in result.stderr
    accept = "--config.checkpoint.accept_changes=opt.learning_rate"
    result = run_command(["train.py", TINY, f"--workdir={workdir}", *resumed, accept], env)
    assert result.returncode == 0, result.stderr
    assert f"Resuming from checkpoint {workdir / 'checkpoints' / str(good)}." in result.stdout
