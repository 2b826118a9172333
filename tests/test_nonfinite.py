"""NaN/Inf steps: 'stop' names the step, the metric and the last good checkpoint; 'skip' drops the update."""

import json

import jax
import numpy as np
import pytest
from helpers.tiny_config import tiny_config

from jrope.data.synthetic import SyntheticSource
from jrope.errors import NonFiniteLossError
from jrope.train import setup
from jrope.train.nonfinite import first_nonfinite
from jrope.train.outputs import MetricsLogger
from jrope.train.setup import set_up_run
from jrope.train.trainer import make_train_step, train_and_evaluate

BAD_STEP_INDEX = 2  # the third step (step number 3) gets a NaN loss


@pytest.fixture
def nan_batch_at_third_step(monkeypatch):
    """Bad input: the loss weights of the third training batch are NaN (so are its loss and gradients)."""
    clean_batch = SyntheticSource.train_batch

    def train_batch(self, step):
        batch = clean_batch(self, step)
        if step == BAD_STEP_INDEX:
            batch["weights"] = np.full_like(batch["weights"], np.nan)
        return batch

    monkeypatch.setattr(SyntheticSource, "train_batch", train_batch)


@pytest.mark.slow
def test_stop_names_step_metric_and_last_good_checkpoint(tmp_path, nan_batch_at_third_step):
    cfg = tiny_config(num_steps=4, **{"mesh.data": -1, "checkpoint.every_steps": 2})
    with pytest.raises(NonFiniteLossError) as caught:
        train_and_evaluate(cfg, str(tmp_path))
    checkpoints = tmp_path / "checkpoints"
    assert str(caught.value).startswith(
        f"loss is nan at step 3; last good checkpoint: step 2 at {checkpoints / '2'}."
    )
    # Step 4 ran (the host reads one step late) but was never saved: 2 only.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2"]


def test_stop_on_gradient_norm_alone(tmp_path):
    logger = MetricsLogger(
        str(tmp_path),
        every_steps=10,
        num_steps=100,
        tensorboard=False,
        last_checkpoint=lambda: "step 40 at /c/40",
    )
    logger.push(41, {"loss": np.float32(0.5), "grad_norm": np.float32(np.inf)})
    with pytest.raises(
        NonFiniteLossError,
        match=r"^grad_norm is inf at step 41; last good checkpoint: step 40 at /c/40",
    ):
        logger.flush()
    assert first_nonfinite({"loss": np.nan, "grad_norm": np.inf}) == (
        "loss",
        pytest.approx(np.nan, nan_ok=True),
    )
    assert first_nonfinite({"loss": 1.0, "grad_norm": 2.0}) is None


@pytest.mark.slow
def test_skip_keeps_previous_state_and_advances_the_step(nan_batch_at_third_step):
    cfg = tiny_config(**{"opt.nonfinite": "skip"})
    run = set_up_run(cfg, devices=jax.devices()[:1])
    source, mesh = run.source, run.mesh
    state = run.init_state()
    train_step = make_train_step(run)
    history = []
    with jax.set_mesh(mesh):
        for step in range(4):
            before = jax.device_get(state)  # the step donates `state`
            state, metrics = train_step(
                state, setup.global_batch(source.train_batch(step), cfg.mesh.rules, mesh)
            )
            history.append((before, jax.device_get(state), jax.device_get(metrics)))
    assert [float(metrics["skipped"]) for _, _, metrics in history] == [0.0, 0.0, 1.0, 0.0]
    before, after, metrics = history[BAD_STEP_INDEX]
    assert np.isnan(metrics["loss"]) and int(after["step"]) == int(before["step"]) + 1
    for got, want in zip(
        jax.tree.leaves((after["params"], after["opt_state"])),
        jax.tree.leaves((before["params"], before["opt_state"])),
        strict=False,
    ):
        np.testing.assert_array_equal(got, want)
    # The clean steps around it do update the parameters.
    for index in (1, 3):
        before, after, _ = history[index]
        changed = [
            not np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(after["params"]), jax.tree.leaves(before["params"]), strict=False
            )
        ]
        assert any(changed)


def test_skipped_steps_are_counted_in_the_logs(tmp_path):
    logger = MetricsLogger(
        str(tmp_path), every_steps=1, num_steps=4, tensorboard=False, last_checkpoint=str
    )
    for step, loss in enumerate([0.7, 0.6, np.nan, 0.5], start=1):
        skipped = np.float32(not np.isfinite(loss))
        logger.push(
            step, {"loss": np.float32(loss), "grad_norm": np.float32(loss), "skipped": skipped}
        )
    logger.close()  # a skipped step is logged, not raised
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [record["train/skipped_steps"] for record in records] == [0, 0, 1, 1]
    # NaN is written as a string: metrics.jsonl stays valid JSON.
    assert records[2]["train/loss"] == "nan" and "train/skipped" not in records[2]
