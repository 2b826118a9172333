"""The method comparison: trains each (method, seed) once, then tabulates mean and spread."""

import os

import pytest
from helpers.tiny_config import tiny_config_dict

from jrope.experiments import compare
from jrope.train import evaluation


@pytest.mark.slow
def test_comparison_trains_each_run_once_and_tabulates(tmp_path):
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

    # A second call finds every run finished: nothing is retrained, the numbers are the same.
    finished = evaluation.finished_results(os.path.join(workdir, "jordan_exact_scaled", "seed0"), 2)
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
