"""A workdir damaged outside its checkpoints: logs read tolerantly (damaged lines set aside in a
side file, named once), a lock whose content cannot be read, a result table that cannot be read,
entries of the wrong kind (a file where a folder belongs, or the reverse); and the unclear cases
around them: two damaged checkpoints, a full disk writing results."""

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest
from etils import epath
from helpers.tiny_config import result_row, tiny_config
from helpers.train_process import REPO_ROOT, subprocess_env

from jrope import results, saved_run_config
from jrope.errors import CheckpointError, ConfigError, UsageError, WorkdirBusy
from jrope.results import JsonLinesLog
from jrope.train import evaluation, outputs
from jrope.train.checkpoints import (
    DIGESTS_ITEM,
    LOCK_FILE,
    Checkpointer,
    WorkdirLock,
    restore_compatible,
)
from jrope.train.outputs import MetricsLogger
from jrope.train.setup import RunEnvironment, check_run, set_up_run

ONE_CPU = RunEnvironment(num_devices=1, process_count=1, platform="cpu")
RANDOM_BYTES = bytes(range(256))[::-1] + b"\x00\xff\n\xfe{not json"  # invalid UTF-8 and JSON


def _lines(path) -> list[dict]:
    """Every line of a JSON-lines file, parsed (fails on any line that does not parse)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def _records(*steps) -> bytes:
    return b"".join(
        json.dumps({"step": step, "train/loss": 1.0}).encode() + b"\n" for step in steps
    )


def test_random_bytes_after_the_records_are_set_aside_and_named_once(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_records(1, 2) + RANDOM_BYTES)
    log = JsonLinesLog(path)
    log.write(json.dumps({"step": 3}))
    log.close()
    assert [record["step"] for record in _lines(path)] == [1, 2, 3]
    side = tmp_path / "metrics.jsonl.damaged"
    assert side.read_bytes() == RANDOM_BYTES + b"\n"  # kept as they were, the cut line closed
    said = capsys.readouterr().out
    assert said.count(str(side)) == 1 and "set aside" in said
    JsonLinesLog(path).close()  # a clean log: nothing more to say
    assert capsys.readouterr().out == ""


def test_a_log_of_random_bytes_is_set_aside_whole(tmp_path):
    path = tmp_path / "starts.jsonl"
    path.write_bytes(RANDOM_BYTES[:200])
    outputs.append_start_record(str(tmp_path), {"start_step": 0})
    assert _lines(path) == [{"start_step": 0}]
    assert (tmp_path / "starts.jsonl.damaged").read_bytes().rstrip(b"\n") == RANDOM_BYTES[:200]


def test_a_record_cut_short_is_closed_before_the_next_is_appended(tmp_path):
    """A full disk while the start record was written: the next start's record gets its own line."""
    path = tmp_path / "starts.jsonl"
    whole = json.dumps({"start_step": 0}).encode() + b"\n"
    cut = json.dumps({"start_step": 8, "config": {"seed": 0}}).encode()[:20]
    path.write_bytes(whole + cut)
    outputs.append_start_record(str(tmp_path), {"start_step": 8})
    assert _lines(path) == [{"start_step": 0}, {"start_step": 8}]
    assert (tmp_path / "starts.jsonl.damaged").read_bytes() == cut + b"\n"
    # A record that lost only its newline is whole: it stays, on its own line.
    path.write_bytes(whole.rstrip(b"\n"))
    outputs.append_start_record(str(tmp_path), {"start_step": 16})
    assert _lines(path) == [{"start_step": 0}, {"start_step": 16}]


def test_side_files_accumulate_every_recovery(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for damage in (b"first\n", b"second"):
        path.write_bytes(_records(1) + damage)
        JsonLinesLog(path).close()
    assert (tmp_path / "metrics.jsonl.damaged").read_bytes() == b"first\nsecond\n"


def test_the_metrics_log_of_a_resumed_run_keeps_whole_records_and_sets_the_rest_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    hand_edited = b'{"note": "no step"}\n[1, 2]\n'  # a JSON object without a step stays
    path.write_bytes(_records(1, 2, 3, 4) + hand_edited + RANDOM_BYTES)
    logger = MetricsLogger(
        str(tmp_path),
        every_steps=1,
        num_steps=8,
        tensorboard=False,
        start_step=2,
    )
    logger.close()
    kept = _lines(path)
    assert [record.get("step") for record in kept] == [1, 2, None]  # steps 3, 4 are redone
    assert (tmp_path / "metrics.jsonl.damaged").read_bytes() == b"[1, 2]\n" + RANDOM_BYTES + b"\n"


def test_a_lock_holding_random_bytes_is_taken_over_like_a_stale_one(tmp_path):
    (tmp_path / LOCK_FILE).write_bytes(RANDOM_BYTES[:100])
    with WorkdirLock(str(tmp_path)) as lock:
        assert lock.previous_holder  # shown as it reads, its bad bytes replaced
        assert f"training by process {os.getpid()} on" in (tmp_path / LOCK_FILE).read_text()
    assert (tmp_path / LOCK_FILE).read_bytes() == b""  # released cleanly


@pytest.mark.parametrize("content", [RANDOM_BYTES[:100], b"[1, 2]", b"17"])
def test_a_lock_with_unreadable_content_held_by_a_live_process_is_refused(tmp_path, content):
    path = tmp_path / LOCK_FILE
    path.write_bytes(content)
    with open(path, "rb") as holder:  # another open file: flock sees another holder
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(WorkdirBusy, match=r"run\.lock is held") as refused:
            WorkdirLock(str(tmp_path)).__enter__()
    assert refused.value.exit_status == 6
    assert path.read_bytes() == content  # the holder's file is left as it is


def test_a_workdir_the_os_cannot_create_is_a_setting_to_fix(tmp_path):
    with pytest.raises(UsageError, match=r"--workdir /proc/x: No such file or directory; choose"):
        WorkdirLock("/proc/x").__enter__()
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(UsageError, match="Not a directory; choose a writable --workdir") as refused:
        WorkdirLock(str(blocked / "run")).__enter__()
    assert refused.value.exit_status == 2


def _write_table(out_dir, text: bytes) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / evaluation.RESULTS_CSV).write_bytes(text)


@pytest.mark.parametrize(
    "text",
    [
        b"method,seed\ngarbage,xx\n",  # a header and a garbage row
        b"",  # emptied
        RANDOM_BYTES,  # not UTF-8
        ",".join(evaluation.CSV_COLUMNS).encode() + b"\n",  # a header and no row
        ",".join(evaluation.CSV_COLUMNS).encode() + b"\nrope,0,eight,8,,8,1,1,1,1,1\n",
    ],
    ids=["garbage_row", "empty", "random_bytes", "no_rows", "bad_number"],
)
def test_a_result_table_that_cannot_be_read_is_set_aside(tmp_path, capsys, text):
    out_dir = tmp_path / "eval_step8"
    _write_table(out_dir, text)
    assert evaluation.readable_results(out_dir) is None
    aside = out_dir / "eval.csv.damaged"
    assert aside.read_bytes() == text and not (out_dir / "eval.csv").exists()
    assert f"set aside as {aside}; evaluating again" in capsys.readouterr().out
    _write_table(out_dir, text)  # damaged again: the first one stays
    assert evaluation.readable_results(out_dir) is None
    assert (out_dir / "eval.csv.damaged2").read_bytes() == text


def test_a_readable_result_table_is_read_as_it_is(tmp_path):
    row = result_row()
    out_dir = tmp_path / "eval_step8"
    results.write_csv(out_dir / evaluation.RESULTS_CSV, [row], evaluation.CSV_COLUMNS)
    assert evaluation.readable_results(out_dir) == [row]
    assert evaluation.readable_results(tmp_path / "eval_step9") is None
    assert sorted(os.listdir(out_dir)) == ["eval.csv"]


WRONG_KINDS = [
    ("checkpoints", "file", "a folder"),
    ("eval_step2", "file", "a folder"),
    ("tensorboard", "file", "a folder"),
    ("metrics.jsonl", "folder", "a file"),
    ("starts.jsonl", "folder", "a file"),
]


@pytest.mark.parametrize("name, kind, what", WRONG_KINDS, ids=[w[0] for w in WRONG_KINDS])
@pytest.mark.parametrize("evaluation", [False, True])
def test_an_entry_of_the_wrong_kind_is_named_before_anything_runs(
    tmp_path, name, kind, what, evaluation
):
    entry = tmp_path / name
    entry.mkdir() if kind == "folder" else entry.write_text("")
    with pytest.raises(ConfigError) as refused:
        check_run(tiny_config(), str(tmp_path), ONE_CPU, evaluation=evaluation)
    problem = f"{entry} is a {kind} where the run keeps {what}; move it aside: mv {entry} "
    assert problem in str(refused.value)
    assert refused.value.exit_status == 2
    assert os.path.exists(entry)  # nothing moved or deleted


@pytest.fixture
def permissions(monkeypatch):
    """Root reads and writes anything: its os.access as another user's, by the owner's bits."""
    if os.geteuid() == 0:
        access = os.access

        def owner_access(path, mode):
            bits = os.stat(path).st_mode
            denied = [
                m for m, bit in ((os.R_OK, 0o400), (os.W_OK, 0o200)) if mode & m and not bits & bit
            ]
            return access(path, mode) and not denied

        monkeypatch.setattr(os, "access", owner_access)


@pytest.mark.parametrize("evaluation", [False, True])
def test_a_log_or_result_folder_the_run_cannot_write_is_named_before_anything_runs(
    tmp_path, permissions, evaluation
):
    log, results_folder = tmp_path / "metrics.jsonl", tmp_path / "eval_step2"
    log.write_text("")
    results_folder.mkdir()
    for path in (log, results_folder):
        path.chmod(0o555 if path.is_dir() else 0o444)
    with pytest.raises(ConfigError) as refused:
        check_run(tiny_config(), str(tmp_path), ONE_CPU, evaluation=evaluation)
    for path in (log, results_folder):
        fix = f"{path} is not writable; chmod -R u+w {path}, or use another --workdir."
        assert fix in str(refused.value)
    assert refused.value.exit_status == 2


def test_an_evaluation_reads_a_checkpoints_folder_it_may_not_write(tmp_path, permissions):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints").chmod(0o555)
    with pytest.raises(CheckpointError, match="holds no finished checkpoint"):
        check_run(tiny_config(), str(tmp_path), ONE_CPU, evaluation=True)
    with pytest.raises(ConfigError, match="checkpoints is not writable"):
        check_run(tiny_config(), str(tmp_path), ONE_CPU, evaluation=False)


def test_a_prompt_that_is_not_utf8_ends_with_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "sample.py", f"--workdir={tmp_path}", b"--prompt=\xff"],
        capture_output=True, text=True, env=subprocess_env(1), cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr == "flag --prompt=['\\udcff']: --prompt must be UTF-8 text; see --help.\n"


def test_a_checkpoint_array_without_read_permission_is_named_as_such(tmp_path, permissions):
    cfg = tiny_config(**{"mesh.data": 1})
    run = set_up_run(cfg, devices=jax.devices()[:1])
    checkpointer = Checkpointer(
        str(tmp_path / "checkpoints"), every_steps=1, max_to_keep=3, config_json=cfg.to_json_dict()
    )
    assert checkpointer.save(1, run.init_state())
    checkpointer.wait_until_finished()
    array = next(
        p for p in (tmp_path / "checkpoints" / "1").rglob("*") if p.is_file() and "d/" in str(p)
    )
    array.chmod(0o200)
    with pytest.raises(CheckpointError) as refusal:
        restore_compatible(checkpointer, run.layout.abstract, 1)
    checkpointer.close()
    assert str(refusal.value) == (f"{array}: permission denied; chmod -R u+rX {array.parents[3]}.")


def test_a_workdir_whose_training_has_not_saved_yet_is_busy_while_it_trains(tmp_path):
    holder = "training by process 12345 on elsewhere since 2026-12-01 10:00:00"
    (tmp_path / LOCK_FILE).write_text(holder + "\n")
    ended = (
        f"--workdir {tmp_path} holds no finished checkpoint: the training there ({holder}) "
        "ended before its first save; train it again."
    )
    with pytest.raises(CheckpointError) as before_flags:  # eval.py's --config, sample.py
        saved_run_config.config_file(str(tmp_path))
    with pytest.raises(CheckpointError) as before_compiling:  # eval.py --config=<experiment>
        check_run(tiny_config(), str(tmp_path), ONE_CPU, evaluation=True)
    assert str(before_flags.value) == str(before_compiling.value) == ended
    with WorkdirLock(str(tmp_path)):  # a training that runs: status 6, as once it has saved
        with pytest.raises(WorkdirBusy) as busy:
            saved_run_config.config_file(str(tmp_path))
    assert busy.value.exit_status == 6
    assert str(busy.value).startswith(f"{tmp_path / LOCK_FILE} is held (training by process ")
    assert str(busy.value).endswith(
        "saved no checkpoint yet: wait for it to end, or use another --workdir."
    )


@pytest.mark.slow
def test_two_damaged_checkpoints_are_both_moved_aside_by_the_advice(tmp_path):
    cfg = tiny_config(**{"mesh.data": 1})
    run = set_up_run(cfg, devices=jax.devices()[:1])
    state = run.init_state()
    checkpointer = Checkpointer(
        str(tmp_path / "checkpoints"), every_steps=1, max_to_keep=3, config_json=cfg.to_json_dict()
    )
    for step in (1, 2, 3):
        assert checkpointer.save(step, state)
    checkpointer.wait_until_finished()
    for step in (2, 3):  # the last two lost their digests: neither can be checked
        shutil.rmtree(tmp_path / "checkpoints" / str(step) / DIGESTS_ITEM)
    with pytest.raises(CheckpointError) as refusal:
        restore_compatible(checkpointer, run.layout.abstract, 3)
    checkpointer.close()
    directory = tmp_path / "checkpoints"
    aside = tmp_path / "damaged_checkpoints"
    message = str(refusal.value)
    assert f"{directory / '3'} has no digests" in message
    assert (
        f"from step 1: mkdir -p {aside} && mv {directory / '2'} {directory / '3'} {aside}/"
        in message
    )


def test_a_storage_failure_writing_results_leaves_no_staging(tmp_path, monkeypatch):
    def full_disk(rows, out_dir, *, task):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "eval.png").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(evaluation, "write_results", full_disk)
    out_dir = epath.Path(tmp_path) / "eval_step8"
    with pytest.raises(OSError) as failed:
        evaluation.write_results_atomically([], out_dir, task="language_model")
    assert failed.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []  # no .eval_step8.tmp-<pid> left behind


def test_eval_reads_a_garbled_saved_config_as_a_damaged_checkpoint(tmp_path):
    saved = tmp_path / "checkpoints" / "8" / "config" / "metadata"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(RANDOM_BYTES)
    (tmp_path / "checkpoints" / "4" / DIGESTS_ITEM).mkdir(parents=True)  # an earlier, checked one
    with pytest.raises(CheckpointError) as refused:
        saved_run_config.get_config(str(tmp_path))
    aside = tmp_path / "damaged_checkpoints"
    assert str(refused.value).startswith(f"Checkpoint {saved.parent.parent} has a config that ")
    assert str(refused.value).endswith(
        f"; resume from step 4: mkdir -p {aside} && mv {saved.parent.parent} {aside}/."
    )
