"""The task families of the data-source contract: the signal model, the regression metrics, the
rows and tables of distance evaluations, resume checks, and tiny end-to-end runs of the new tasks."""

import csv
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.task_configs import tiny_retrieval_config, tiny_signal_config
from helpers.tiny_config import tiny_config

from jrope import losses
from jrope.experiments import compare
from jrope.model import Transformer
from jrope.train.checkpoints import config_differences
from jrope.train.setup import run_encoding
from jrope.train.trainer import train_and_evaluate


def _signal_model(input_channels=2, output_channels=3):
    cfg = tiny_config(**{"model.readout": "all"})
    return Transformer(
        cfg.model,
        run_encoding(cfg),
        None,
        rngs=nnx.Rngs(params=0),
        input_channels=input_channels,
        output_channels=output_channels,
    )


@pytest.mark.slow
def test_signal_model_projects_inputs_in_and_regresses_causally():
    model = _signal_model()
    assert not hasattr(model, "embedding")
    assert model.input_projection.shape == (2, 32) and model.regression_head.shape == (32, 3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 12, 2)), jnp.float32)
    apply = nnx.jit(lambda model, x: model(x, jnp.arange(x.shape[1], dtype=jnp.int32)))
    y = apply(model, x)
    assert y.shape == (2, 12, 3) and y.dtype == jnp.float32
    # changing the future leaves the past untouched; changing the present changes it
    changed = apply(model, x.at[:, 7:].add(1.0))
    np.testing.assert_array_equal(np.asarray(changed[:, :7]), np.asarray(y[:, :7]))
    assert not np.allclose(np.asarray(changed[:, 7]), np.asarray(y[:, 7]))


@pytest.mark.parametrize(
    "vocab_size, channels", [(None, (None, None)), (5, (1, 1)), (None, (1, None)), (None, (0, 1))]
)
def test_model_needs_either_a_vocabulary_or_signal_channels(vocab_size, channels):
    cfg = tiny_config()
    with pytest.raises(ValueError, match="either vocab_size"):
        Transformer(
            cfg.model,
            run_encoding(cfg),
            vocab_size,
            rngs=nnx.Rngs(params=0),
            input_channels=channels[0],
            output_channels=channels[1],
        )


def test_regression_metrics_are_mse_and_r2():
    rng = np.random.default_rng(1)
    targets = rng.standard_normal((3, 6, 2)).astype(np.float32) + 0.5
    predictions = (targets[:, 2:] + 0.1 * rng.standard_normal((3, 4, 2))).astype(np.float32)
    weights = rng.uniform(0, 1, (3, 6)).astype(np.float32)
    sums = losses.task_sums(
        jnp.asarray(predictions),
        {"targets": jnp.asarray(targets), "weights": jnp.asarray(weights)},
        "regression",
        None,
    )
    metrics = losses.metrics_from_sums(sums, "regression")
    # Independently: the last 4 positions (the predictions cover those), weights per position.
    y, w = targets[:, 2:].astype(np.float64), np.repeat(weights[:, 2:, None], 2, axis=2)
    mse = np.sum(w * (predictions - y) ** 2) / np.sum(w)
    mean = np.sum(w * y) / np.sum(w)
    pooled_r2 = 1 - mse / (np.sum(w * (y - mean) ** 2) / np.sum(w))
    # Each sequence's own R^2 (its weighted error and variance about its own mean), averaged.
    own = [
        1
        - np.sum(w[b] * (predictions[b] - y[b]) ** 2)
        / np.sum(w[b] * (y[b] - np.sum(w[b] * y[b]) / np.sum(w[b])) ** 2)
        for b in range(3)
    ]
    assert float(metrics["loss"]) == pytest.approx(mse, rel=1e-5)
    assert float(metrics["r2_pooled"]) == pytest.approx(pooled_r2, rel=1e-4)
    assert float(metrics["r2"]) == pytest.approx(np.mean(own), rel=1e-4)
    assert set(metrics) == {"loss", "r2", "r2_pooled"}


def test_parameter_shaping_keys_of_the_new_tasks_refuse_a_resume():
    signal = tiny_signal_config().to_json_dict()
    wider = tiny_signal_config(**{"data.input_channels": 2}).to_json_dict()
    incompatible, _ = config_differences(signal, wider)
    assert incompatible == ["data.input_channels is 1 there, 2 now"]
    retrieval = tiny_retrieval_config().to_json_dict()
    for key, value in (("num_keys", 6), ("num_values", 5)):
        changed = tiny_retrieval_config(**{f"data.{key}": 9}).to_json_dict()
        assert config_differences(retrieval, changed)[0] == [f"data.{key} is {value} there, 9 now"]
    farther = tiny_retrieval_config(**{"data.eval_distances": (4, 8)}).to_json_dict()
    assert config_differences(retrieval, farther)[0] == []  # evaluation only
    incompatible, _ = config_differences(tiny_config().to_json_dict(), signal)
    assert any(line.startswith("data.source") for line in incompatible)


def _row(method, seed, length, distance, accuracy):
    nan = float("nan")
    return dict(
        method=method,
        seed=seed,
        length=length,
        distance=distance,
        num_sequences=4,
        loss=1.0,
        accuracy=accuracy,
        bits_per_byte=nan,
        r2=nan,
    )


def test_comparison_tabulates_each_distance():
    rows = [
        _row(m, s, length, d, acc)
        for m, base in (("rope", 0.5), ("jordan_rope", 0.7))
        for s in (0, 1)
        for length, d, acc in (
            (16, None, base),
            (16, 4, base + 0.1 * s),
            (32, None, base),
            (32, 4, base),
            (32, 24, base - 0.2),
        )
    ]
    assert compare.task_of(rows) == "classification"
    assert compare.summarize(rows, "accuracy")["rope"] == {16: (0.5, 0.0, 2), 32: (0.5, 0.0, 2)}
    tables = compare.distance_tables(rows, "accuracy")
    assert "accuracy at length 16 by key-to-query distance" in tables
    assert "| method | d=4 | d=24 |" in tables
    assert "| jordan_rope | 0.700 ± 0.000 | 0.500 ± 0.000 |" in tables
    assert "| rope | 0.550 ± 0.071 |" in tables


@pytest.mark.slow
def test_signal_regression_trains_evaluates_and_resumes(tmp_path):
    settings = {"eval.lengths": (16, 32), "eval.num_sequences": 2, "eval.batch_size": 2}
    straight = train_and_evaluate(
        tiny_signal_config(num_steps=4, **settings), str(tmp_path / "straight")
    )
    train_and_evaluate(tiny_signal_config(**settings), str(tmp_path / "resumed"))
    resumed = train_and_evaluate(
        tiny_signal_config(num_steps=4, **settings), str(tmp_path / "resumed")
    )
    for got, want in zip(
        jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"]), strict=False
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    rows = resumed["eval"]
    assert [row["length"] for row in rows] == [16, 32]
    for row in rows:
        assert row["loss"] > 0 and math.isfinite(row["r2"]) and math.isnan(row["accuracy"])
    for got, want in zip(rows, straight["eval"], strict=False):
        assert (got["loss"], got["r2"]) == (want["loss"], want["r2"])
    with open(tmp_path / "resumed" / "eval_step4" / "eval.csv", encoding="utf-8") as f:
        written = list(csv.DictReader(f))
    assert float(written[1]["r2"]) == pytest.approx(rows[1]["r2"], rel=1e-6)
    assert (
        "| length | loss | r2 | r2_pooled |"
        in (tmp_path / "resumed" / "eval_step4" / "eval.md").read_text()
    )


@pytest.mark.slow
def test_retrieval_trains_and_evaluates_each_distance(tmp_path):
    result = train_and_evaluate(tiny_retrieval_config(), str(tmp_path))
    keys = [(row["length"], row["distance"]) for row in result["eval"]]
    assert keys == [(16, None), (16, 4), (16, 12), (32, None), (32, 4), (32, 12), (32, 24)]
    for row in result["eval"]:
        assert 0.0 <= row["accuracy"] <= 1.0 and math.isfinite(row["loss"])
    table = (tmp_path / "eval_step2" / "eval.md").read_text()
    assert "| length | distance | accuracy | loss |" in table and "| 32 | 24 |" in table
