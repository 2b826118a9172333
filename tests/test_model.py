"""The Transformer: causality, kernel agreement, numerics, any-length evaluation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.matrix import cases
from helpers.tiny_config import tiny_config

import jrope
from jrope.model import Transformer
from jrope.model.axes import LOGICAL_AXES_KEY
from jrope.model.config import ModelConfig
from jrope.train.setup import run_encoding

VOCAB = 3
LENGTH = 16


def _model(**overrides) -> Transformer:
    cfg = tiny_config(**{"model.readout": "all", **overrides})
    return Transformer(cfg.model, run_encoding(cfg), VOCAB, rngs=nnx.Rngs(params=0))


def _tokens(batch=2, length=LENGTH, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, length)), jnp.int32)


def _positions(length=LENGTH):
    return jnp.arange(length, dtype=jnp.int32)


@nnx.jit
def _apply(model, tokens):
    return model(tokens, jnp.arange(tokens.shape[1], dtype=jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize(
    "pe_name, impl",
    [
        ("jordan_rope", "xla"),
        ("jordan_rope", "einsum"),
        ("jordan_rope", "blockwise"),
        ("rope_alibi", "einsum"),
    ],
)
def test_causality_through_gradients(pe_name, impl):
    model = _model(**{"pe.name": pe_name, "model.attention_impl": impl, "model.block_size": 4})
    x = model.embed(_tokens())
    query = 9

    def logits_at_query(inputs):
        return jnp.sum(model.decode(inputs, _positions())[:, query])

    grad = jax.jit(jax.grad(logits_at_query))(x)  # [B, T, D]
    per_position = np.asarray(jnp.sum(jnp.abs(grad), axis=(0, 2)))
    # the future has no influence at all
    np.testing.assert_array_equal(per_position[query + 1 :], 0.0)
    assert np.all(per_position[: query + 1] > 1e-6)  # every visible position does


@pytest.mark.slow
def test_attention_kernels_agree():
    tokens = _tokens()
    outputs = {
        impl: _apply(_model(**{"model.attention_impl": impl, "model.block_size": 4}), tokens)
        for impl in ("xla", "einsum", "blockwise")
    }
    np.testing.assert_allclose(outputs["einsum"], outputs["xla"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outputs["blockwise"], outputs["xla"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_evaluates_beyond_the_training_length():
    # Nothing in the model is sized by the training length L = 16.
    logits = _apply(_model(), _tokens(length=40))
    assert logits.shape == (2, 40, VOCAB)
    assert np.all(np.isfinite(logits))


@pytest.mark.slow
def test_bfloat16_compute_keeps_float32_params_and_logits():
    model = _model(**{"model.compute_dtype": "bfloat16"})
    logits = _apply(model, _tokens())
    assert logits.dtype == jnp.float32
    params = nnx.state(model, nnx.Param)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    reference = _apply(_model(), _tokens())
    # bf16 activations: about 3 significant digits on logits of order 10.
    np.testing.assert_allclose(logits, reference, atol=0.15 * float(jnp.max(jnp.abs(reference))))


@pytest.mark.slow
def test_remat_changes_nothing_but_memory():
    tokens = _tokens()

    def loss_and_grads(model):
        params = nnx.state(model, nnx.Param)
        graphdef = nnx.graphdef(model)

        def loss(p):
            return jnp.mean(nnx.merge(graphdef, p)(tokens, _positions()) ** 2)

        return jax.jit(jax.value_and_grad(loss))(params)

    plain_loss, plain_grads = loss_and_grads(_model())
    remat_loss, remat_grads = loss_and_grads(_model(**{"model.remat": "full"}))
    np.testing.assert_allclose(remat_loss, plain_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(remat_grads), jax.tree.leaves(plain_grads), strict=False):
        # recomputation reorders float sums
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_every_parameter_has_logical_axes_known_to_the_rules():
    cfg = tiny_config(**{"pe.name": "jordan_jetmix_m4_c150_g050_g030_g020"})
    model = Transformer(cfg.model, run_encoding(cfg), VOCAB, rngs=nnx.Rngs(params=0))
    rule_names = {name for name, _ in cfg.mesh.rules}
    variables = jax.tree.leaves(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    assert any(
        "jet_gates_raw" in str(path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))
    )
    for variable in variables:
        axes = variable.get_metadata()[LOGICAL_AXES_KEY]
        assert len(axes) == variable.ndim
        assert set(axes) - {None} <= rule_names


@pytest.mark.slow
def test_last_position_readout_equals_the_full_forward():
    tokens = _tokens(length=13)
    full = _apply(_model(**{"pe.name": "rope_alibi"}), tokens)
    last = _apply(_model(**{"pe.name": "rope_alibi", "model.readout": "last"}), tokens)
    assert last.shape == (2, 1, VOCAB)
    np.testing.assert_allclose(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)


def test_per_layer_encoding_parameters_are_distinct_params():
    model = _model(**{"pe.name": "jordan_rope"})
    gammas = [block.attn.pe_params["gamma_raw"] for block in model.blocks]
    assert len(gammas) == 2 and gammas[0] is not gammas[1]
    assert all(isinstance(g, nnx.Param) and g.shape[0] == 2 for g in gammas)  # [N, nb]


def _damped_model(attention_impl: str, init_gamma: float, length: int) -> Transformer:
    cfg = ModelConfig(
        d_model=16,
        num_heads=2,
        num_layers=2,
        mlp_ratio=2,
        compute_dtype="float32",
        attention_impl=attention_impl,
        blockwise_min_length=1 << 20,
        block_size=32,
        remat="none",
    )
    pe = jrope.pe_config_from_name("jordan_rope", train_context=length, init_gamma=init_gamma)
    encoding = jrope.make_encoding(pe, num_heads=2, head_dim=8)
    return Transformer(cfg, encoding, VOCAB, rngs=nnx.Rngs(params=0))


@pytest.mark.slow
@pytest.mark.parametrize("length", cases([256, 512], (256,)))
def test_a_damping_past_max_damping_evaluates_like_the_blockwise_kernel(length):
    """gamma 0.5 x 512 keys is far past float32's e^88 from one origin; 'auto' follows it."""
    tokens, positions = _tokens(length=length), _positions(length)
    auto, blockwise = _damped_model("auto", 0.5, length), _damped_model("blockwise", 0.5, length)
    assert auto.cfg.max_damping * length <= 80 < 0.5 * length
    want = blockwise(tokens, positions)
    # Eager: the model measures its parameters itself.
    np.testing.assert_allclose(auto(tokens, positions), want, rtol=1e-4, atol=1e-4)
    # Jitted: the damping is read on the host before compiling.
    assert auto.follow_damping() == pytest.approx(0.5, rel=1e-3)
    got = _apply(auto, tokens)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_far_apart_positions_choose_a_kernel_for_their_span():
    """64 positions spanning 5031, damping 0.02 (the default bound): finite and equal to blockwise.

    The jump falls between two blocks of the blockwise kernel (block_size 32),
    which measures positions from each block's first.
    """
    positions = jnp.concatenate([jnp.arange(32), 5000 + jnp.arange(32)]).astype(jnp.int32)
    tokens = _tokens(length=64)
    auto, blockwise = _damped_model("auto", 0.02, 64), _damped_model("blockwise", 0.02, 64)
    got = auto(tokens, positions)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, blockwise(tokens, positions), rtol=1e-4, atol=1e-4)


def test_positions_that_go_back_down_within_a_row_are_refused():
    model = _damped_model("einsum", 0.02, 64)
    packed = jnp.concatenate([5000 + jnp.arange(40), jnp.arange(24)]).astype(jnp.int32)
    with pytest.raises(ValueError, match="must increase along a row.*pass segment_ids"):
        model(_tokens(length=64), packed)
