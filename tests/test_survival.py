"""Runs that survive, part six: the last write of a run, and the commands on a run's edges.

A kill while the final results are written leaves nothing the rerun cannot complete; eval.py
evaluates only the lengths a step's folder lacks, keeps the evaluation seed with each row and
refuses to mix seeds; a probe config never writes into a training run; sample.py refuses a NaN
temperature in one line.
"""

import json
import os
import signal
import time

import pytest
from helpers.tiny_config import result_row, tiny_config
from helpers.train_process import (
    run_command,
    run_training,
    start_training,
    subprocess_env,
)

import configs.kernel_probe
from jrope import results
from jrope.errors import CheckpointError, UsageError
from jrope.experiments import kernel_probe
from jrope.train import evaluation
from jrope.train.trainer import evaluate_checkpoint, train_and_evaluate


def _eval_records(workdir) -> list[str]:
    """The evaluation names logged in metrics.jsonl ('eval_16'), in file order."""
    with open(os.path.join(str(workdir), "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    return [
        k.partition("/")[0] for r in records for k in r if k.startswith("eval_") and "/loss" in k
    ]


# 1. The final write.


def test_a_kill_as_the_results_table_is_written_leaves_logs_the_rerun_completes(
    tmp_path, monkeypatch
):
    cfg = tiny_config(**{"eval.lengths": (8, 16), "mesh.data": -1})
    workdir = str(tmp_path)
    write = evaluation.write_results_atomically

    def killed(*args, **kwargs):  # the process ends as the table that marks the result is written
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluation, "write_results_atomically", killed)
    with pytest.raises(KeyboardInterrupt):
        train_and_evaluate(cfg, workdir)
    assert _eval_records(workdir) == ["eval_8", "eval_16"]  # logged before the table
    assert not (evaluation.results_dir(workdir, 2) / evaluation.RESULTS_CSV).exists()
    monkeypatch.setattr(evaluation, "write_results_atomically", write)
    train_and_evaluate(cfg, workdir)  # evaluates again: the records of the first try give way
    assert _eval_records(workdir) == ["eval_8", "eval_16"]
    assert (evaluation.results_dir(workdir, 2) / evaluation.RESULTS_CSV).exists()


def test_a_stop_at_a_periodic_evaluation_is_evaluated_again_on_resume(tmp_path, monkeypatch):
    settings = {"num_steps": 8, "eval.every_steps": 4, "checkpoint.every_steps": 4}
    cfg = tiny_config(**settings, **{"eval.lengths": (8,), "mesh.data": -1})
    workdir = str(tmp_path)
    write = evaluation.write_results_atomically

    def killed(*args, **kwargs):  # stopped as step 4's table is written, its checkpoint saved
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluation, "write_results_atomically", killed)
    with pytest.raises(KeyboardInterrupt):
        train_and_evaluate(cfg, workdir)
    monkeypatch.setattr(evaluation, "write_results_atomically", write)
    train_and_evaluate(cfg, workdir)  # resumes at step 4: its evaluation first
    with open(tmp_path / "metrics.jsonl", encoding="utf-8") as f:
        evaluated = [record["step"] for record in map(json.loads, f) if "eval_8/loss" in record]
    assert evaluated == [4, 8]
    assert (evaluation.results_dir(workdir, 4) / evaluation.RESULTS_CSV).exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_signal_as_the_final_table_appears_loses_no_evaluation_row(tmp_path, signum):
    env, workdir = subprocess_env(1), tmp_path / "run"
    args = ("--config.num_steps=8", "--config.eval.lengths=(8,16,32)")
    process = start_training(workdir, env, *args)
    table = workdir / "eval_step8" / evaluation.RESULTS_CSV
    while not table.exists() and process.poll() is None:
        time.sleep(0.0005)
    process.send_signal(signum)
    process.wait(timeout=60)
    run_training(workdir, env, *args)  # says it finished, or evaluates again
    assert _eval_records(workdir) == ["eval_8", "eval_16", "eval_32"]


# 2. sample.py's flags.


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_sample_refuses_a_temperature_that_is_no_finite_number_at_or_above_zero(tmp_path, value):
    args = ["sample.py", f"--workdir={tmp_path}", "--prompt=a", f"--temperature={value}"]
    refused = run_command(args, subprocess_env(1))
    assert refused.returncode == 2
    assert refused.stderr == f"--temperature must be finite, >= 0, got {float(value)}.\n"
    assert len(refused.stderr.splitlines()) == 1


# 6 and 15. eval.py at more lengths, and at another evaluation seed.


def _scores(row):
    return row["length"], row["num_sequences"], row["eval_seed"], row["loss"], row["accuracy"]


def test_eval_stopped_before_its_table_logs_its_rows_once_when_run_again(tmp_path, monkeypatch):
    settings = {"mesh.data": -1, "eval.lengths": (8,)}
    train_and_evaluate(tiny_config(**settings), str(tmp_path))
    more = tiny_config(**settings | {"eval.lengths": (8, 16)})
    write = evaluation.write_results_atomically

    def killed(*args, **kwargs):  # the rows are logged, the table is not written
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluation, "write_results_atomically", killed)
    with pytest.raises(KeyboardInterrupt):
        evaluate_checkpoint(more, str(tmp_path))
    monkeypatch.setattr(evaluation, "write_results_atomically", write)
    evaluate_checkpoint(more, str(tmp_path))  # length 16 again: its first record gives way
    assert _eval_records(tmp_path) == ["eval_8", "eval_16"]


def test_eval_adds_only_the_lengths_a_step_lacks_and_refuses_another_eval_seed(tmp_path, capsys):
    settings = {"mesh.data": -1, "eval.lengths": (8,)}
    train_and_evaluate(tiny_config(**settings), str(tmp_path))
    trained = evaluation.read_results(evaluation.results_dir(str(tmp_path), 2))
    assert [row["eval_seed"] for row in trained] == [tiny_config().eval.seed]
    capsys.readouterr()
    more = tiny_config(**settings | {"eval.lengths": (8, 16)})
    rows = evaluate_checkpoint(more, str(tmp_path))
    assert "Evaluating step 2 at lengths 16 (" in capsys.readouterr().out
    assert [_scores(row) for row in rows[:1]] == [_scores(row) for row in trained]
    assert [row["length"] for row in rows] == [8, 16]
    again = evaluate_checkpoint(more, str(tmp_path))  # nothing to evaluate
    assert [_scores(row) for row in again] == [_scores(row) for row in rows]
    assert "holds every length asked." in capsys.readouterr().out
    assert _eval_records(tmp_path) == ["eval_8", "eval_16"]

    other_seed = tiny_config(**settings | {"eval.seed": 5})
    out_dir = evaluation.results_dir(str(tmp_path), 2)
    with pytest.raises(UsageError) as refused:
        evaluate_checkpoint(other_seed, str(tmp_path))
    assert str(refused.value) == (
        f"eval.seed = 5, but {out_dir}/eval.csv holds eval.seed 0; set --config.eval.seed=0, "
        f"or mv {out_dir} {out_dir}.eval_seed0"
    )
    assert [_scores(row) for row in evaluation.read_results(out_dir)] == list(map(_scores, rows))
    with pytest.raises(CheckpointError, match=r"^No finished checkpoint .*checkpoints/3\.$"):
        evaluate_checkpoint(more, str(tmp_path), step=3)  # a step never saved is no damage
    for data in (tmp_path / "checkpoints" / "2" / "state" / "d").iterdir():
        data.write_bytes(data.read_bytes()[:10])
    with pytest.raises(CheckpointError, match="cannot be read"):  # restored, with nothing to do
        evaluate_checkpoint(more, str(tmp_path))


def test_a_table_written_before_the_eval_seed_column_reads_and_is_added_to(tmp_path):
    row = result_row()
    del row["eval_seed"]
    out_dir = tmp_path / "eval_step8"
    results.write_csv(out_dir / evaluation.RESULTS_CSV, [row], evaluation.CSV_COLUMNS[:-1])
    earlier = evaluation.read_results(out_dir)
    assert earlier == [row | {"eval_seed": None}]
    cfg = tiny_config(**{"eval.lengths": (8, 16), "eval.num_sequences": 8, "eval.seed": 5})
    assert evaluation.lengths_to_evaluate(cfg.eval, cfg.model.compute_dtype, earlier, out_dir) == (
        16,
    )


# 7. A probe config on a run's workdir.


@pytest.mark.parametrize("entry", ["checkpoints", "starts.jsonl", "comparison.csv"])
def test_a_probe_refuses_the_workdir_of_a_run(tmp_path, entry):
    (tmp_path / entry).mkdir() if entry == "checkpoints" else (tmp_path / entry).write_text("{}\n")
    with pytest.raises(UsageError, match=rf"holds a run \({entry}\): a probe writes its tables"):
        kernel_probe.run(configs.kernel_probe.get_config(), str(tmp_path))
    assert os.listdir(tmp_path) == [entry]
