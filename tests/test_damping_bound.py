"""The damping bound in the harness: model.max_damping held against the parameters being run.

A damping past the bound starts a run (refused with the fix) or is learned
(evaluations and the train step follow the measured damping to a kernel that
survives it), and a non-finite result names it before the learning rate.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrope.errors import ConfigError, NonFiniteError, UsageError
from jrope.experiments.text_generation import TextRun
from jrope.model import damping
from jrope.model.generation import GenerationSettings
from jrope.train import evaluation, setup, trainer
from jrope.train.config import TrainConfig
from jrope.train.setup import model_from_params, run_encoding, set_up_run
from tests.helpers.tiny_config import tiny_config, tiny_config_dict, tiny_text_config_dict

# A head that learned a decay length of two tokens: one origin over 512 positions
# reaches e^256, far past float32, while the blockwise kernel stays exact.
LEARNED_GAMMA = 0.5
DAMPED_LAYER, DAMPED_HEAD = 1, 1


def _with_gamma(cfg: TrainConfig, params, gamma: float, layer: int, head: int):
    """params with one head's damping gamma set (its raw parameter through the softplus)."""
    raw = math.log(math.expm1(gamma - cfg.pe.gamma_min))

    def set_head(path, leaf):
        keys = [getattr(key, "key", getattr(key, "idx", None)) for key in path]
        if keys[:3] == ["blocks", layer, "attn"] and "gamma_raw" in keys:
            return leaf.at[head].set(raw)
        return leaf

    return jax.tree_util.tree_map_with_path(set_head, params)


def test_a_bound_the_blockwise_blocks_cannot_carry_is_refused_with_the_fix(tmp_path):
    config = tiny_config_dict(**{"model.max_damping": 0.5, "mesh.data": -1})
    with pytest.raises(ConfigError) as refused:
        setup.check_run(TrainConfig.from_config_dict(config), str(tmp_path / "run"))
    # 0.5 * 511 is past float32 in blocks of 512; 0.5 * 127 is not.
    assert "set --config.model.block_size to at most 128" in str(refused.value)
    fixed = tiny_config_dict(**{"model.max_damping": 0.5, "model.block_size": 128, "mesh.data": -1})
    setup.check_run(TrainConfig.from_config_dict(fixed), str(tmp_path / "fixed"))


@pytest.mark.slow
def test_an_encoding_starting_past_the_bound_is_followed_from_step_1(tmp_path, capsys):
    """The issue's command at the tiny scale: pe.init_gamma=0.5, lengths 256 and 512."""
    cfg = tiny_config(
        **{
            "pe.init_gamma": 0.5,
            "eval.lengths": (256, 512),
            "eval.num_sequences": 8,
            "eval.batch_size": 8,
            "mesh.data": -1,
        }
    )
    result = trainer.train_and_evaluate(cfg, str(tmp_path))
    said = capsys.readouterr().out
    # 0.5 * 16 < 80: the train step keeps its kernel; 512 is evaluated blockwise.
    assert (
        "layer 0, head 0 has damping gamma = 0.5, above model.max_damping = 0.02: kernel "
        "'einsum' at length 16, blockwise blocks of 128." in said
    )
    assert "planning again" not in said  # planned once: the learned damping stays carried
    assert [row["length"] for row in result["eval"]] == [256, 512]
    assert all(math.isfinite(row["loss"]) for row in result["eval"])


def test_measure_names_the_layer_and_head_of_the_largest_damping():
    cfg = tiny_config()
    run = set_up_run(cfg, devices=jax.devices()[:1])
    params = run.init_state()["params"]
    within = damping.measure(cfg.model, run_encoding(cfg), params)
    assert not within.passed and within.largest == pytest.approx(cfg.pe.init_gamma, rel=1e-3)
    measured = damping.measure(
        cfg.model,
        run_encoding(cfg),
        _with_gamma(cfg, params, LEARNED_GAMMA, DAMPED_LAYER, DAMPED_HEAD),
    )
    assert measured.passed
    assert (measured.layer, measured.head) == (DAMPED_LAYER, DAMPED_HEAD)
    assert measured.largest == pytest.approx(LEARNED_GAMMA, rel=1e-4)
    assert measured.per_layer[0] == pytest.approx(cfg.pe.init_gamma, rel=1e-3)


@pytest.mark.slow
def test_learned_damping_past_the_bound_evaluates_as_the_blockwise_kernel():
    lengths = {"eval.lengths": (256, 512), "eval.num_sequences": 4}
    cfg = tiny_config(**lengths)
    run = set_up_run(cfg, devices=jax.devices()[:1])
    params = _with_gamma(cfg, run.init_state()["params"], LEARNED_GAMMA, DAMPED_LAYER, DAMPED_HEAD)
    step = evaluation.EvalStep(run, run.plan_kernels(params))
    rows = evaluation.evaluate_lengths(step, params, run, step=0)
    assert step.plan.measured.passed and step.plan.measured.block_size == 128
    # 0.5 * 127 < 80: the blocks that carry the damping (the harness's choice).
    blockwise_cfg = tiny_config(
        **lengths, **{"model.attention_impl": "blockwise", "model.block_size": 128}
    )
    blockwise_run = set_up_run(blockwise_cfg, devices=jax.devices()[:1])
    expected = evaluation.evaluate_lengths(
        evaluation.EvalStep(blockwise_run), params, blockwise_run, step=0
    )
    for row, want in zip(rows, expected, strict=True):
        assert math.isfinite(row["loss"]), row
        np.testing.assert_allclose(row["loss"], want["loss"], rtol=1e-5)
        assert row["accuracy"] == want["accuracy"]
    # The kernel 'auto' planned for model.max_damping alone overflows at 512: the
    # check above could fail.
    batch = next(iter(run.source.eval_batches(512, 4, 4, seed=cfg.eval.seed)))
    planned = jax.jit(
        lambda p, b: model_from_params(run.layout.graphdef, p)(b["inputs"], jnp.arange(512))
    )
    with jax.set_mesh(run.mesh):
        assert not np.all(np.isfinite(np.asarray(planned(params, batch))))


@pytest.mark.slow
def test_the_kernel_plan_follows_the_starting_damping_and_knows_what_it_carries(capsys):
    cfg = tiny_config()
    run = set_up_run(cfg, devices=jax.devices()[:1])
    state = run.init_state()
    within = run.plan_kernels(state["params"])
    assert within.graphdef is run.layout.graphdef and within.carries(within.measured)
    # gamma * 16 = 96 > 80: one origin over the training window would overflow.
    params = _with_gamma(cfg, state["params"], 6.0, DAMPED_LAYER, DAMPED_HEAD)
    assert not within.carries(within.measure(params))
    plan = run.plan_kernels(params)
    said = capsys.readouterr().out
    assert "layer 1, head 1 has damping gamma = 6, above model.max_damping = 0.02" in said
    assert "kernel 'blockwise' at length 16, blockwise blocks of 8." in said
    kept_params = jax.tree.map(jnp.copy, params)  # the steps donate their state
    # A larger damping that blocks of 8 still carry needs no other plan.
    assert plan.carries(plan.measure(_with_gamma(cfg, kept_params, 9.0, DAMPED_LAYER, 0)))
    batch = {name: jnp.asarray(value) for name, value in run.source.train_batch(0).items()}
    with jax.set_mesh(run.mesh):
        _, metrics = trainer.make_train_step(run, plan=plan)({**state, "params": params}, batch)
    blockwise_run = set_up_run(
        tiny_config(**{"model.attention_impl": "blockwise", "model.block_size": 8}),
        devices=jax.devices()[:1],
    )
    blockwise_state = blockwise_run.init_state()
    with jax.set_mesh(blockwise_run.mesh):
        _, expected = trainer.make_train_step(blockwise_run)(
            {**blockwise_state, "params": kept_params}, batch
        )
    assert math.isfinite(float(metrics["loss"]))
    np.testing.assert_allclose(float(metrics["loss"]), float(expected["loss"]), rtol=1e-5)


@pytest.mark.slow
def test_a_damping_the_plan_does_not_carry_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    """The loop compiles nothing after step 1: at the checkpoint where the damping needs other
    kernels it stops, and the run resumes from there with kernels planned for it, computing
    what an uninterrupted run computes."""
    cfg = tiny_config(**{"num_steps": 4, "checkpoint.every_steps": 2, "mesh.data": -1})
    expected = trainer.train_and_evaluate(cfg, str(tmp_path / "uninterrupted"))
    carries, asked = damping.KernelPlan.carries, []

    def outgrown_at_step_2(plan, measured):
        asked.append(measured)
        return len(asked) != 1 and carries(plan, measured)

    monkeypatch.setattr(damping.KernelPlan, "carries", outgrown_at_step_2)
    result = trainer.train_and_evaluate(cfg, str(tmp_path / "replanned"))
    assert len(asked) == 2  # at step 2 (not carried), then at step 4 after the resume
    starts = (tmp_path / "replanned" / "starts.jsonl").read_text().splitlines()
    assert [json.loads(line)["start_step"] for line in starts] == [0, 2]
    leaves = zip(*map(jax.tree.leaves, (result["state"], expected["state"])), strict=True)
    for got, want in leaves:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert result["eval"] == expected["eval"]


def test_a_non_finite_evaluation_names_a_passed_bound_before_the_learning_rate():
    rows = [{"length": 512, "loss": float("nan")}]
    passed = damping.MeasuredDamping((0.01, 0.5), layer=1, head=1, bound=0.02)
    with pytest.raises(NonFiniteError) as diagnosed:
        evaluation.check_evaluation(rows, "ckpt/20", passed)
    message = str(diagnosed.value)
    assert "layer 1, head 1 has damping gamma = 0.5, above model.max_damping = 0.02" in message
    assert message.index("damping") < message.index("opt.learning_rate")
    within = damping.MeasuredDamping((0.01, 0.015), layer=1, head=0, bound=0.02)
    with pytest.raises(NonFiniteError) as diverged:
        evaluation.check_evaluation(rows, "ckpt/20", within)
    assert str(diverged.value).startswith("Loss of ckpt/20 not finite at length 512")
    assert "damping" not in str(diverged.value)


def test_a_non_finite_loss_names_a_passed_bound():
    measured = damping.MeasuredDamping((0.3,), layer=0, head=1, bound=0.02)
    error = NonFiniteError("loss is nan at step 7; Lower opt.learning_rate ...")
    diagnosed = damping.diagnosed(error, measured)
    assert isinstance(diagnosed, NonFiniteError)
    message = str(diagnosed)
    assert message.startswith("The damping passed its bound: layer 0, head 1")
    assert "loss is nan at step 7" in message


@pytest.mark.parametrize(("backend", "fused"), [("tpu", "splash"), ("gpu", "cudnn")])
def test_fused_kernels_obey_the_measured_damping(backend, fused):
    cfg = tiny_config(**{"model.compute_dtype": "bfloat16"})
    passed = damping.MeasuredDamping((0.01, 0.5), layer=1, head=1, bound=0.02)

    # A kernel that maps each block from its own origin: the shear-weight flash kernel for the
    # raw shear, blockwise for the others.
    def kernel(cfg):
        return damping.KernelPlan(cfg.model, run_encoding(cfg), backend, (512,), None, passed)

    assert kernel(cfg).kernel(512) == "shear_flash"
    rope = tiny_config(**{"model.compute_dtype": "bfloat16", "pe.name": "damped_rope"})
    assert kernel(rope).kernel(512) == "blockwise"
    explicit = tiny_config(**{"model.compute_dtype": "bfloat16", "model.attention_impl": fused})
    with pytest.raises(UsageError) as refused:
        kernel(explicit).kernel(512)
    message = str(refused.value)
    assert "layer 1, head 1 has damping gamma = 0.5, above model.max_damping = 0.02" in message
    assert f"attention_impl={fused!r}" in message


@pytest.mark.slow
def test_decoding_moves_the_cache_origin_often_enough_for_the_damping(tmp_path, caplog):
    cfg = TrainConfig.from_config_dict(tiny_text_config_dict(tmp_path))
    run = set_up_run(cfg, devices=jax.devices()[:1])
    params = _with_gamma(cfg, run.init_state()["params"], LEARNED_GAMMA, 0, DAMPED_HEAD)
    text_run = TextRun(cfg, run.encoding, 0, run.layout.graphdef, params, run.mesh)
    with caplog.at_level("WARNING"):
        generated = text_run.generate(["= Section"], GenerationSettings(num_tokens=4))
    assert len(generated) == 1
    assert "layer 0, head 1 has damping gamma = 0.5" in caplog.text
    assert "rebase_bound 160" in caplog.text


def test_an_encoding_without_parameters_measures_no_damping():
    cfg = tiny_config(**{"pe.name": "rope"})
    run = set_up_run(cfg, devices=jax.devices()[:1])
    graphdef, measured = damping.plan(
        cfg.model, run_encoding(cfg), run.layout.graphdef, run.init_state()["params"]
    )
    assert measured.per_layer == (0.0, 0.0) and not measured.passed
    assert graphdef is run.layout.graphdef  # nothing recompiles
