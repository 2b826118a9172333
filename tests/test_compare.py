"""The method comparison: trains each (method, seed) once, then tabulates mean and spread."""

import copy
import os
import shutil

import pytest
from helpers.tiny_config import tiny_config_dict
from helpers.train_process import REPO_ROOT

from configs import synthetic
from jrope.errors import UsageError
from jrope.experiments import compare
from jrope.train import evaluation


@pytest.mark.slow
def test_comparison_trains_each_run_once_and_tabulates(tmp_path, capsys):
    config = tiny_config_dict(**{"mesh.data": -1})  # the batch of 8 over the 8 test devices
    workdir = str(tmp_path)
    rows = compare.run_comparison(config, ["jordan_exact_scaled"], [0, 1], workdir)
    assert {(r["method"], r["seed"]) for r in rows} == {
        ("jordan_exact_scaled", 0),
        ("jordan_exact_scaled", 1),
    }
    table = open(os.path.join(workdir, "comparison.md"), encoding="utf-8").read()
    assert "| jordan_exact_scaled | 2 |" in table and "±" in table
    assert os.path.exists(os.path.join(workdir, "comparison.png"))
    # The console ends with the tables and where the files went.
    console = capsys.readouterr().out
    assert table.rstrip() in console
    for name in ("comparison.csv", "comparison.md", "comparison.png"):
        assert os.path.join(workdir, name) in console.split("Comparison files:")[-1]

    # A second call finds every run finished: nothing is retrained, the numbers are the same.
    finished = evaluation.results_dir(os.path.join(workdir, "jordan_exact_scaled", "seed0"), 2)
    stamp = os.path.getmtime(finished / "eval.csv")
    again = compare.run_comparison(config, ["jordan_exact_scaled"], [0, 1], workdir)
    assert os.path.getmtime(finished / "eval.csv") == stamp
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in rows]


def test_summary_is_mean_and_sample_spread():
    rows = [
        dict(
            method="m",
            seed=s,
            length=8,
            distance=None,
            num_sequences=4,
            accuracy=a,
            loss=0.0,
            bits_per_byte=float("nan"),
        )
        for s, a in enumerate([0.5, 0.7, 0.9])
    ]
    mean, std, seeds = compare.summarize(rows, "accuracy")["m"][8]
    assert (round(mean, 6), round(std, 6), seeds) == (0.7, 0.2, 3)


def test_the_comparison_is_shown_with_its_files(tmp_path, capsys):
    rows = [
        dict(
            method=method,
            seed=seed,
            step=10,
            length=length,
            distance=None,
            num_sequences=4,
            accuracy=accuracy + 0.1 * seed,
            loss=1.0,
            bits_per_byte=float("nan"),
            r2=float("nan"),
            r2_pooled=float("nan"),
        )
        for method, accuracy in (("rope", 0.5), ("jordan_rope", 0.7))
        for seed in (0, 1)
        for length in (8, 16)
    ]
    compare.show_comparison(compare.write_comparison(rows, str(tmp_path)))
    console = capsys.readouterr().out
    # accuracy, the classification task's headline: methods x lengths, mean ± sd over 2 seeds
    assert "| rope | 2 | 0.550 ± 0.071 | 0.550 ± 0.071 |" in console
    assert "| jordan_rope | 2 | 0.750 ± 0.071 | 0.750 ± 0.071 |" in console
    assert console.index("accuracy: mean ± std") < console.index("Comparison files:")
    # Each run's own row behind the means, and the command and commit the table came from.
    assert "| jordan_rope | 1 | 0.800 | 0.800 |" in console
    assert console.index("accuracy: mean ± std") < console.index("accuracy of each run")
    made_by = [line for line in console.splitlines() if line.startswith("Made by `python -m")]
    assert len(made_by) == 1 and " at jrope " in made_by[0]
    for name in ("comparison.csv", "comparison.md", "comparison.png"):
        assert (tmp_path / name).exists() and str(tmp_path / name) in console


def _rerun(config, workdir, **overrides):
    changed = copy.deepcopy(config)
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        setattr(changed[section] if section else changed, name, value)
    return compare.run_comparison(changed, ["rope"], [0], workdir)


def test_a_finished_run_is_reused_only_with_its_settings_and_evaluated_at_new_lengths(tmp_path):
    config = tiny_config_dict(**{"mesh.data": -1})  # the batch of 8 over the 8 test devices
    workdir = str(tmp_path)
    compare.run_comparison(config, ["rope"], [0], workdir)
    table = (tmp_path / "comparison.md").read_text()
    with pytest.raises(UsageError, match=r"opt\.learning_rate is 0\.\d+ there, 0\.01 now"):
        _rerun(config, workdir, **{"opt.learning_rate": 1e-2})
    with pytest.raises(UsageError, match=r"opt\.learning_rate"):  # nothing left to accept it
        _rerun(
            config, workdir, **{"opt.learning_rate": 1e-2}, **{"checkpoint.accept_changes": "opt"}
        )
    assert (tmp_path / "comparison.md").read_text() == table  # not relabelled
    rows = _rerun(config, workdir, **{"eval.lengths": (16, 32)})  # evaluates 32, trains nothing
    assert sorted(row["length"] for row in rows) == [16, 32]
    assert "| method | seeds | 16 | 32 |" in (tmp_path / "comparison.md").read_text()
    rows = _rerun(config, workdir, **{"eval.lengths": (32,)})  # the table names only its lengths
    assert [row["length"] for row in rows] == [32]
    assert "| method | seeds | 32 |" in (tmp_path / "comparison.md").read_text()


def test_the_kept_headline_runs_are_read_by_the_documented_command(tmp_path, monkeypatch):
    """docs/results.md: `cp -r docs/runs/synthetic runs/synthetic`, then the command, trains
    nothing; another learning rate is refused by name."""
    shutil.copytree(os.path.join(REPO_ROOT, "docs/runs/synthetic"), tmp_path / "synthetic")
    monkeypatch.setattr(compare, "train_and_evaluate", None)  # any training fails
    config = synthetic.get_config()
    config.eval.num_sequences = 256
    config.mesh.data = -1
    methods, workdir = ["jordan_rope", "rope", "direct_sum"], str(tmp_path / "synthetic")
    rows = compare.run_comparison(config, methods, [0, 1, 2], workdir)
    assert len(rows) == 9 * len(config.eval.lengths)
    config.opt.learning_rate = 1e-2
    with pytest.raises(UsageError, match="opt.learning_rate"):
        compare.run_comparison(config, methods, [0], workdir)
