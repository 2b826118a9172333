"""The commands on a finished run's workdir damaged outside its checkpoints, as a user meets them:
each damage to a log, the lock or a result table is set aside and the command goes on (status 0);
an entry of the wrong kind, a workdir the OS cannot create and a stray argument end with one
message and status 2. Subprocesses of train.py and eval.py on the tiny subprocess config."""

import json
import os
import shutil

import numpy as np
import pytest
from helpers import train_process
from helpers.tiny_config import tiny_config_dict

from jrope.experiments import compare

pytestmark = pytest.mark.slow

STEPS = 16  # two checkpoints of the subprocess config (one every 8 steps)
RUN = (f"--config={train_process.RUN_CONFIG}", f"--config.num_steps={STEPS}")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return train_process.subprocess_env(1)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, env):
    workdir = tmp_path_factory.mktemp("finished") / "run"
    train_process.run_training(workdir, env, f"--config.num_steps={STEPS}")
    return workdir


@pytest.fixture
def workdir(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def _random_bytes(count: int) -> bytes:
    return np.random.default_rng(count).bytes(count)


def _train(workdir, env, *args):
    return train_process.run_command(["train.py", *RUN, f"--workdir={workdir}", *args], env)


def _evaluate(workdir, env):
    return train_process.run_command(["eval.py", f"--workdir={workdir}"], env)


def _log_records(path) -> list[dict]:
    """Every line of a JSON-lines log, parsed: fails on any line that does not parse."""
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def _assert_clean_exit(done, status: int = 0) -> None:
    assert done.returncode == status, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_random_bytes_appended_to_the_metrics_log_are_set_aside(workdir, env):
    damage = _random_bytes(300)
    with open(workdir / "metrics.jsonl", "ab") as log:
        log.write(damage)
    done = _train(workdir, env, "--config.num_steps=24")
    _assert_clean_exit(done)
    side = workdir / "metrics.jsonl.damaged"
    assert side.read_bytes().replace(b"\n", b"") == damage.replace(b"\n", b"")
    assert done.stdout.count(str(side)) == 1
    train_steps = [r["step"] for r in _log_records(workdir / "metrics.jsonl") if "train/loss" in r]
    assert train_steps == list(range(1, 25))


@pytest.mark.parametrize("damage", ["random_bytes", "last_line_cut"])
def test_a_damaged_start_record_is_set_aside_and_the_next_start_gets_its_own_line(
    workdir, env, damage
):
    path = workdir / "starts.jsonl"
    if damage == "random_bytes":  # the whole log replaced
        damaged, kept, before = _random_bytes(200), [], b""
    else:  # a full disk while a second start's record was written
        before = path.read_bytes()
        damaged, kept = before[: len(before) // 2], [0]
    path.write_bytes(before + damaged)
    done = _train(workdir, env, "--config.num_steps=24")
    _assert_clean_exit(done)
    records = _log_records(path)
    assert [record["start_step"] for record in records] == [*kept, STEPS]
    side = workdir / "starts.jsonl.damaged"
    assert side.read_bytes().replace(b"\n", b"") == damaged.replace(b"\n", b"")
    assert done.stdout.count(str(side)) == 1


def test_a_lock_holding_random_bytes_is_taken_over(workdir, env):
    (workdir / "run.lock").write_bytes(_random_bytes(100))
    done = _train(workdir, env)
    _assert_clean_exit(done)
    assert "Taking over" in done.stdout and "Finished earlier" in done.stdout
    assert (workdir / "run.lock").read_bytes() == b""  # released cleanly


def test_a_garbage_result_table_is_set_aside_and_evaluated_again(workdir, env):
    table = workdir / f"eval_step{STEPS}" / "eval.csv"
    good = table.read_text()
    table.write_text("method,seed\ngarbage,xx\n")
    done = _evaluate(workdir, env)
    _assert_clean_exit(done)
    assert (table.parent / "eval.csv.damaged").read_text() == "method,seed\ngarbage,xx\n"
    assert "set aside" in done.stdout
    assert table.read_text() == good  # the same sequences, the same checkpoint: the same row


def test_a_finished_runs_garbage_result_table_is_evaluated_again_by_the_train_command(workdir, env):
    table = workdir / f"eval_step{STEPS}" / "eval.csv"
    good = table.read_text()
    table.write_bytes(_random_bytes(64))
    done = _train(workdir, env)
    _assert_clean_exit(done)
    assert "Finished earlier" not in done.stdout and "set aside" in done.stdout
    assert table.read_text() == good


@pytest.mark.parametrize(
    "entry, command",
    [("checkpoints", _train), (f"eval_step{STEPS}", _evaluate)],
    ids=["checkpoints_train", "eval_step_eval"],
)
def test_a_file_where_a_folder_belongs_ends_with_one_message(workdir, env, entry, command):
    shutil.rmtree(workdir / entry)
    (workdir / entry).write_text("")
    before = sorted(os.listdir(workdir))
    done = command(workdir, env)
    _assert_clean_exit(done, 2)
    assert (
        f"{workdir / entry} is a file where the run keeps a folder; move it aside: mv "
        in done.stderr
    )
    assert sorted(os.listdir(workdir)) == before


def test_a_workdir_the_os_cannot_create_ends_with_one_message(env):
    done = train_process.run_command(["train.py", *RUN, "--workdir=/proc/x"], env)
    _assert_clean_exit(done, 2)
    assert done.stderr.strip() == (
        "--workdir /proc/x: No such file or directory; choose a writable --workdir."
    )
    assert "Training" not in done.stdout


@pytest.mark.parametrize("script", ["train.py", "eval.py", "sample.py"])
def test_a_stray_positional_argument_ends_with_one_line(tmp_path, env, script):
    args = {"train.py": [*RUN], "eval.py": [*RUN], "sample.py": ["--prompt=a"]}[script]
    done = train_process.run_command(
        [script, *args, f"--workdir={tmp_path}", "extra_positional"], env
    )
    _assert_clean_exit(done, 2)
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert done.stderr == "Unexpected arguments ['extra_positional']; flags only.\n"


def test_the_comparison_evaluates_a_run_again_whose_table_is_garbage(tmp_path, capsys):
    config = tiny_config_dict(**{"mesh.data": -1})
    rows = compare.run_comparison(config, ["rope"], [0], str(tmp_path))
    table = tmp_path / "rope" / "seed0" / "eval_step2" / "eval.csv"
    table.write_text("method,seed\ngarbage,xx\n")
    capsys.readouterr()
    again = compare.run_comparison(config, ["rope"], [0], str(tmp_path))
    assert "set aside" in capsys.readouterr().out
    assert (table.parent / "eval.csv.damaged").read_text() == "method,seed\ngarbage,xx\n"
    assert [row["loss"] for row in again] == [row["loss"] for row in rows]


def test_eval_refuses_a_checkpoint_whose_saved_config_is_garbage(workdir, env):
    saved = workdir / "checkpoints" / str(STEPS) / "config" / "metadata"
    saved.write_bytes(_random_bytes(100))
    done = _evaluate(workdir, env)
    _assert_clean_exit(done, 4)
    checkpoint = workdir / "checkpoints" / str(STEPS)
    assert done.stderr.startswith(f"Checkpoint {checkpoint} has a config that cannot be read (")
    aside = workdir / "damaged_checkpoints"
    assert done.stderr.endswith(
        f"; resume from step 8: mkdir -p {aside} && mv {checkpoint} {aside}/.\n"
    )
