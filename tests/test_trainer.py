"""jrope.train.trainer: the train step, the loop, resumption equal to an uninterrupted run, the non-finite policy."""

import functools
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.matrix import cases
from helpers.tiny_config import tiny_config

import jrope
from jrope import flops
from jrope.data.synthetic import SyntheticSource
from jrope.errors import NonFiniteError, TrainingPreempted, UsageError
from jrope.losses import weighted_sums
from jrope.train import evaluation, setup
from jrope.train.checkpoints import Checkpointer
from jrope.train.outputs import first_nonfinite
from jrope.train.setup import model_from_params, readout_problem, set_up_run
from jrope.train.trainer import (
    evaluate_checkpoint,
    make_train_step,
    stop_if_nonfinite,
    train_and_evaluate,
)

# Beyond the paper's synthetic methods: higher order, recency bias, jet gates.
EXTRA_METHODS = (
    "jordan_m3",
    "jordan_exact_c150_eta010_alibi",
    "jordan_jetmix_m4_c150_g050_g030_g020",
)


def _run_steps(cfg, devices, num_steps):
    """Initialise and take `num_steps` steps on `devices`; returns (host state, host metrics per step)."""
    run = set_up_run(cfg, devices=devices)
    source, mesh = run.source, run.mesh
    state = run.init_state()
    train_step = make_train_step(run)
    history = []
    with jax.set_mesh(mesh):
        for step in range(num_steps):
            state, metrics = train_step(
                state, setup.global_batch(source.train_batch(step), cfg.mesh.rules, mesh)
            )
            history.append(jax.device_get(metrics))
    return jax.device_get(state), history


def _one_device():
    return jax.devices()[:1]


# Obtained once by running `_run_steps(tiny_config(), _one_device(), 2)`
# under tests/conftest.py (seed 0, tiny jordan_rope config, float32, one CPU
# device, jax 0.10.2) and printing both losses.
GOLDEN_LOSS_STEP_1 = 1.2759193181991577
GOLDEN_LOSS_STEP_2 = 0.9392579793930054


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        {},  # readout 'last', einsum attention: the synthetic config's own path
        {"model.readout": "all"},  # the full forward gives the same numbers
        # so does jax.nn.dot_product_attention with an explicit mask
        {"model.attention_impl": "xla"},
    ],
)
def test_golden_one_step_loss(overrides):
    # Step 1's loss checks the initialisation and forward pass; step 2's also
    # checks the gradient and the AdamW update.
    _, history = _run_steps(tiny_config(**overrides), _one_device(), 2)
    np.testing.assert_allclose(history[0]["loss"], GOLDEN_LOSS_STEP_1, rtol=1e-5)
    np.testing.assert_allclose(history[1]["loss"], GOLDEN_LOSS_STEP_2, rtol=1e-5)


@functools.lru_cache(maxsize=1)
def _four_head_one_device_run():
    return _run_steps(tiny_config(**{"model.num_heads": 4}), _one_device(), 2)


@pytest.mark.slow
@pytest.mark.parametrize("data, fsdp, tensor", [(2, 4, 1), (2, 1, 4)])
def test_sharded_step_equals_one_device_step(data, fsdp, tensor):
    # 4 heads of 8 so that the tensor axis really splits heads and MLP.
    cfg = tiny_config(
        **{"model.num_heads": 4, "mesh.data": data, "mesh.fsdp": fsdp, "mesh.tensor": tensor}
    )
    assert setup.make_mesh(cfg.mesh).devices.shape == (data, fsdp, tensor)
    sharded_state, sharded_history = _run_steps(cfg, None, 2)
    single_state, single_history = _four_head_one_device_run()
    for got, want in zip(sharded_history, single_history, strict=False):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], rtol=1e-5)
    for got, want in zip(
        jax.tree.leaves(sharded_state["params"]),
        jax.tree.leaves(single_state["params"]),
        strict=False,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_parameters_are_really_sharded():
    cfg = tiny_config(**{"model.num_heads": 4, "mesh.data": 2, "mesh.fsdp": 1, "mesh.tensor": 4})
    state = set_up_run(cfg).init_state()
    qkv = state["params"]["blocks"][0]["attn"]["qkv"][...]  # [D, 3, N, H], heads over 'tensor'
    assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)
    assert qkv.addressable_shards[0].data.shape == (32, 3, 1, 8)
    embedding = state["params"]["embedding"][...]  # vocabulary 3 does not split: replicated
    assert embedding.sharding.spec == jax.sharding.PartitionSpec(None, None)


@pytest.mark.slow
@pytest.mark.parametrize(
    "pe_name",
    cases(
        jrope.PAPER_METHODS + EXTRA_METHODS,
        ("rope_alibi", "jordan_rope", "jordan_exact_scaled", "jordan_m3", "direct_sum"),
    ),
)
def test_each_encoding_trains_one_step(pe_name):
    # Order-3 blocks span 6 dims: heads of 12 for jordan_m3, of 16 otherwise.
    d_model = 24 if pe_name == "jordan_m3" else 32
    cfg = tiny_config(**{"pe.name": pe_name, "model.num_layers": 1, "model.d_model": d_model})
    _, history = _run_steps(cfg, _one_device(), 1)
    assert np.isfinite(history[0]["loss"]) and history[0]["loss"] > 0
    assert np.isfinite(history[0]["grad_norm"]) and history[0]["grad_norm"] > 0


def test_last_position_readout_rejects_weights_elsewhere():
    lm_batch = {"weights": np.ones((2, 5), np.float32)}
    assert "set 'all'" in readout_problem(lm_batch, "last")
    assert readout_problem(lm_batch, "all") is None
    last_only = {"weights": np.eye(5, dtype=np.float32)[[4, 4]]}
    assert readout_problem(last_only, "last") is None


@pytest.mark.slow
def test_bfloat16_compute_loss_close_to_float32():
    _, bf16 = _run_steps(tiny_config(**{"model.compute_dtype": "bfloat16"}), _one_device(), 2)
    # float32 gives the golden losses; bf16 activations agree to about 2 significant digits.
    for got, want in zip(bf16, (GOLDEN_LOSS_STEP_1, GOLDEN_LOSS_STEP_2), strict=False):
        np.testing.assert_allclose(got["loss"], want, rtol=2e-2)
        assert got["loss"] != want  # the bf16 path really ran


@pytest.mark.slow
def test_train_then_resume_equals_uninterrupted_run(tmp_path):
    # Dropout on: the resumed steps must draw the masks of the steps they are.
    overrides = {"mesh.data": -1, "checkpoint.every_steps": 2, "model.dropout_rate": 0.2}
    straight = train_and_evaluate(tiny_config(num_steps=4, **overrides), str(tmp_path / "straight"))
    train_and_evaluate(tiny_config(num_steps=2, **overrides), str(tmp_path / "resumed"))
    resumed = train_and_evaluate(tiny_config(num_steps=4, **overrides), str(tmp_path / "resumed"))
    assert int(resumed["state"]["step"]) == 4
    for got, want in zip(
        jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"]), strict=False
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for got, want in zip(resumed["eval"], straight["eval"], strict=False):
        assert (got["loss"], got["accuracy"]) == (want["loss"], want["accuracy"])
    # The resumed run logged only its own steps 3 and 4 after the first run's 1 and 2.
    with open(tmp_path / "resumed" / "metrics.jsonl") as f:
        train_steps = [record["step"] for record in map(json.loads, f) if "train/loss" in record]
    assert train_steps == [1, 2, 3, 4]
    assert sorted(os.listdir(tmp_path / "resumed" / "checkpoints")) == ["2", "4"]
    final_eval = tmp_path / "resumed" / "eval_step4" / "eval.csv"
    training_row = evaluation.read_results(final_eval.parent)[0]
    # Evaluating the finished run again (at other lengths) keeps training's results.
    again = evaluate_checkpoint(
        tiny_config(num_steps=4, **overrides, **{"eval.lengths": (8, 16)}),
        str(tmp_path / "resumed"),
    )
    assert [row["length"] for row in again] == [8, 16]
    # Its rows join training's in one folder: length 8 added, 16 kept from training.
    merged = evaluation.read_results(final_eval.parent)
    assert [row["length"] for row in merged] == [8, 16]
    assert merged[1]["loss"] == again[1]["loss"] == training_row["loss"]
    assert not (tmp_path / "resumed" / "eval_step4.2").exists()


def test_loss_uses_only_the_class_logits():
    logits = jnp.array([[[0.0, 1.0, 50.0], [2.0, 0.0, 50.0]]])  # [B=1, T=2, V=3]
    targets = jnp.array([[1, 0]])
    weights = jnp.array([[0.0, 1.0]])  # only the last position counts
    sums = weighted_sums(logits, targets, weights, num_classes=2)
    np.testing.assert_allclose(sums["loss_sum"], np.log1p(np.exp(-2.0)), rtol=1e-6)
    assert float(sums["correct_sum"]) == 1.0 and float(sums["weight_sum"]) == 1.0
    full = weighted_sums(logits, targets, weights, num_classes=None)  # the QUERY logit now wins
    assert float(full["correct_sum"]) == 0.0 and float(full["loss_sum"]) > 40.0


@pytest.mark.slow
def test_dropout_is_a_pure_function_of_seed_and_step():
    cfg = tiny_config(**{"model.dropout_rate": 0.3})
    _, first = _run_steps(cfg, _one_device(), 2)
    _, again = _run_steps(cfg, _one_device(), 2)
    # Same seed and steps: the same masks, bit for bit.
    assert [h["loss"] for h in first] == [h["loss"] for h in again]
    # The masks are really drawn: the first loss differs from the dropout-free golden one...
    assert abs(first[0]["loss"] - GOLDEN_LOSS_STEP_1) > 1e-4
    # ...and another seed draws other masks (the data also change with the seed).
    _, other_seed = _run_steps(
        tiny_config(**{"model.dropout_rate": 0.3, "seed": 1}), _one_device(), 1
    )
    assert other_seed[0]["loss"] != first[0]["loss"]


@pytest.mark.slow
def test_dropout_off_without_a_key():
    """Evaluation passes no key: the model is deterministic; a key draws masks, the same for the same key."""
    cfg = tiny_config(**{"model.dropout_rate": 0.5})
    run = set_up_run(cfg, devices=_one_device())
    params = run.init_state()["params"]
    tokens = jnp.asarray(run.source.train_batch(0)["inputs"])
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)

    @jax.jit
    def forward(params, dropout_key):
        net = model_from_params(run.layout.graphdef, params)
        return net(tokens, positions, dropout_key=dropout_key)

    plain = forward(params, None)
    np.testing.assert_array_equal(plain, forward(params, None))
    dropped = forward(params, jax.random.key(0))
    assert not np.allclose(dropped, plain)
    np.testing.assert_array_equal(dropped, forward(params, jax.random.key(0)))


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
def test_a_train_step_larger_than_memory_is_refused_before_its_first_step(tmp_path, monkeypatch):
    cfg = tiny_config(num_steps=2, **{"mesh.data": -1, "checkpoint.every_steps": 2})
    train_and_evaluate(cfg, str(tmp_path))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    # XLA's peak of this step is some kilobytes per device; a device of 1 KiB cannot hold it.
    monkeypatch.setattr(flops, "device_memory", lambda: (1024, "device memory"))
    monkeypatch.setattr(evaluation, "compile_lengths", lambda *_: None)  # the train step's alone
    monkeypatch.setattr(setup, "_memory_problems", lambda *_, **__: [])  # XLA's count alone
    with pytest.raises(UsageError, match=r"^batch_size = 8: the train step needs [\d.]+ GiB of "):
        train_and_evaluate(tiny_config(num_steps=4, **{"mesh.data": -1}), str(tmp_path))
    # Refused on resume, at step 2, with every file of the run as it was.
    assert sorted(str(p) for p in tmp_path.rglob("*") if p.name != "starts.jsonl") == [
        p for p in before if not p.endswith("starts.jsonl")
    ]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


@pytest.mark.slow
def test_an_evaluation_larger_than_memory_is_refused_before_the_work(tmp_path):
    train_and_evaluate(tiny_config(**{"mesh.data": -1}), str(tmp_path))

    def written():  # every file and its time, but the lock's
        return {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.name != "run.lock"}

    before = written()
    # Every query sees every key at 2**20 positions: terabytes by XLA's own count of the forward.
    huge = {"mesh.data": -1, "eval.lengths": (16, 2**20)}
    refusal = r"^eval.lengths: 1048576 needs [\d.]+ GiB of host memory"
    with pytest.raises(UsageError, match=refusal):
        evaluate_checkpoint(tiny_config(**huge), str(tmp_path))
    with pytest.raises(UsageError, match=refusal):  # on resume, before step 3
        train_and_evaluate(tiny_config(num_steps=4, **huge), str(tmp_path))
    assert written() == before


@pytest.mark.slow
def test_stop_names_step_metric_and_last_good_checkpoint(tmp_path, nan_batch_at_third_step):
    cfg = tiny_config(num_steps=4, **{"mesh.data": -1, "checkpoint.every_steps": 2})
    with pytest.raises(NonFiniteError) as caught:
        train_and_evaluate(cfg, str(tmp_path))
    checkpoints = tmp_path / "checkpoints"
    assert str(caught.value).startswith(f"loss is nan at step 3; resume from {checkpoints / '2'} ")
    # Step 4 ran (the host reads one step late) but was never saved: 2 only.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2"]


def test_stop_on_gradient_norm_alone(tmp_path):
    checkpointer = Checkpointer(
        str(tmp_path / "checkpoints"), every_steps=1, max_to_keep=3, config_json={}
    )
    checkpointer.save(40, {"w": jnp.zeros(2)})
    with pytest.raises(
        NonFiniteError,
        match=rf"^grad_norm is inf at step 41; resume from {tmp_path}/checkpoints/40 at a lower",
    ):
        stop_if_nonfinite(41, {"loss": 0.5, "grad_norm": np.inf}, 10, checkpointer)
    stop_if_nonfinite(42, {"loss": 0.5, "grad_norm": 1.0}, 10, checkpointer)
    checkpointer.close()
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
    # optax.apply_if_finite's counters, in the optimizer state: so far, and in a row.
    assert [int(metrics["skipped_steps"]) for _, _, metrics in history] == [0, 0, 1, 1]
    assert [int(metrics["skipped_in_a_row"]) for _, _, metrics in history] == [0, 0, 1, 0]
    before, after, metrics = history[BAD_STEP_INDEX]
    assert np.isnan(metrics["loss"]) and int(after["step"]) == int(before["step"]) + 1
    for got, want in zip(
        jax.tree.leaves((after["params"], after["opt_state"].inner_state)),
        jax.tree.leaves((before["params"], before["opt_state"].inner_state)),
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


def _nan_batches_from_third_step(monkeypatch, sigterm_at_step=None):
    """Bad input from step 3 on; `sigterm_at_step`: SIGTERM arrives while that step is fed."""
    clean_batch = SyntheticSource.train_batch

    def train_batch(self, step):
        batch = clean_batch(self, step)
        if step + 1 == sigterm_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        if step >= BAD_STEP_INDEX:
            batch["weights"] = np.full_like(batch["weights"], np.nan)
        return batch

    monkeypatch.setattr(SyntheticSource, "train_batch", train_batch)


@pytest.mark.slow
def test_a_streak_of_skips_goes_on_counting_across_a_resume(tmp_path, monkeypatch):
    # Steps 3 on are non-finite; 3 in a row stop the run: at step 5, interrupted or not.
    cfg = tiny_config(
        num_steps=8,
        **{"mesh.data": -1, "opt.nonfinite": "skip", "opt.max_consecutive_skips": 3},
    )
    _nan_batches_from_third_step(monkeypatch)
    with pytest.raises(NonFiniteError) as straight:
        train_and_evaluate(cfg, str(tmp_path / "straight"))
    _nan_batches_from_third_step(monkeypatch, sigterm_at_step=4)
    with pytest.raises(TrainingPreempted) as preempted:
        train_and_evaluate(cfg, str(tmp_path / "resumed"))
    assert preempted.value.step == 4  # saved amid the streak: steps 3 and 4 skipped
    _nan_batches_from_third_step(monkeypatch)
    with pytest.raises(NonFiniteError) as resumed:
        train_and_evaluate(cfg, str(tmp_path / "resumed"))
    assert str(straight.value).startswith("Steps 3 to 5 skipped (loss not finite): resume from")
    assert str(resumed.value).replace("resumed", "straight") == str(straight.value)

    def skipped_counts(workdir):
        with open(workdir / "metrics.jsonl") as f:
            records = [json.loads(line) for line in f]
        return [(r["step"], r["train/skipped_steps"]) for r in records if "train/loss" in r]

    assert skipped_counts(tmp_path / "resumed") == skipped_counts(tmp_path / "straight")
