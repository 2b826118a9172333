"""The library refuses what it would compute wrongly, naming the argument, and follows a damping
its kernels can carry: integer q and k, a damping past max_damping, positions and batches of the
wrong shape."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrope
from jrope.attention import causal_attention
from jrope.layers import PositionalEncoding, causal_self_attention, dot_product_attention

B, T, N, H = 2, 16, 2, 16


def _encoding(name: str, **changes) -> jrope.Encoding:
    cfg = dataclasses.replace(jrope.pe_config_from_name(name, train_context=T), **changes)
    return jrope.make_encoding(cfg, num_heads=N, head_dim=H)


def _normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape).astype(dtype)


@pytest.mark.parametrize("name", ["rope", "nope", "jordan_exact_scaled", "jordan_rope"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_integer_q_or_k_is_refused_naming_the_argument_and_the_cast(name, dtype):
    enc = _encoding(name)
    params = enc.init_params()
    positions = jnp.arange(T)
    whole = jnp.ones((B, T, N, H), dtype)
    real = _normal((B, T, N, H))
    for q, k, named in ((whole, real, "q"), (real, whole, "k")):
        with pytest.raises(ValueError, match=rf"^{named} must be floating point .*astype"):
            enc.transform_qk(params, q, k, positions, positions)
        with pytest.raises(ValueError, match=rf"^{named} must be floating point"):
            jrope.attention_logits(enc, params, q, k, positions, positions)
    with pytest.raises(ValueError, match="^q must be floating point"):
        enc.map_queries(params, whole, positions)
    with pytest.raises(ValueError, match="^k must be floating point"):
        enc.map_keys(params, whole, positions)


def test_integer_values_are_refused_by_the_helpers():
    pe = PositionalEncoding(_encoding("rope"))
    q = k = _normal((B, T, N, H))
    v = jnp.ones((B, T, N, H), jnp.int32)
    positions = jnp.arange(T)
    with pytest.raises(ValueError, match="^v must be floating point"):
        dot_product_attention(pe, q, k, v, positions, positions)
    with pytest.raises(ValueError, match="float32 or bfloat16, got int32"):
        causal_self_attention(pe, q, k, v, positions)
    with pytest.raises(ValueError, match="^q must be floating point"):
        causal_self_attention(pe, v.astype(jnp.int32), k, k, positions)


@pytest.mark.slow
def test_floating_inputs_keep_their_maps():
    """The check passes every floating dtype the library takes (the maps' dtype rules hold)."""
    enc = _encoding("rope")
    params, positions = enc.init_params(), jnp.arange(T)
    for dtype in (jnp.float32, jnp.bfloat16):
        q = _normal((B, T, N, H), dtype=dtype)
        q2, k2 = enc.transform_qk(params, q, q, positions, positions)
        assert q2.dtype == k2.dtype == dtype


# One map origin carries a damping of 0.5 over at most 160 positions (gamma * positions <= 80,
# the kernels' margin below float32's e^88.7): LENGTH is beyond it, below blockwise_min_length.
LENGTH = 192


def _damped_layer() -> PositionalEncoding:
    return PositionalEncoding(_encoding("damped_rope", init_gamma=0.5))


def _causal_reference(pe, q, k, v, positions):
    """Causal softmax over attention_logits measured from one origin per query block of 32, the
    relative form exact for damped RoPE: float64 [B, T, N, H]."""
    logits = np.asarray(
        pe.encoding.relative_logits(pe.param_values(), q, k, positions, positions), np.float64
    )
    length = q.shape[1]
    logits = np.where(np.tril(np.ones((length, length), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, np.asarray(v, np.float64))


@pytest.mark.slow
@pytest.mark.parametrize(
    "max_damping, block_size",
    [(0.02, 512), (0.5, 512)],  # the default bound; a bound whose blocks would overflow
)
def test_causal_self_attention_follows_a_damping_past_its_bound(max_damping, block_size):
    pe = _damped_layer()
    assert pe.encoding.largest_damping(pe.param_values()) == pytest.approx(0.5, rel=1e-5)
    q, k, v = (_normal((1, LENGTH, N, H), seed) for seed in range(3))
    positions = jnp.arange(LENGTH)
    out = causal_self_attention(
        pe, q, k, v, positions, max_damping=max_damping, block_size=block_size
    )
    assert bool(jnp.isfinite(out).all())
    expected = _causal_reference(pe, q, k, v, positions)
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, atol=2e-5)


@pytest.mark.slow
def test_dot_product_attention_refuses_a_damping_one_origin_cannot_carry():
    pe = _damped_layer()
    q = k = v = _normal((1, LENGTH, N, H))
    positions = jnp.arange(LENGTH)
    with pytest.raises(ValueError, match=r"gamma = 0\.5 overflows .*causal_self_attention.*159"):
        dot_product_attention(pe, q, k, v, positions, positions, is_causal=True)
    # Within what one origin carries it runs, finite.
    short = jnp.arange(128)
    out = dot_product_attention(pe, q[:, :128], k[:, :128], v[:, :128], short, short)
    assert bool(jnp.isfinite(out).all())


def test_positions_of_the_wrong_length_or_batch_are_named_with_the_shapes():
    enc = _encoding("jordan_exact_scaled")
    params = enc.init_params()
    q, k = _normal((B, T, N, H)), _normal((B, T, N, H), 1)
    positions = jnp.arange(T)
    with pytest.raises(ValueError, match=r"^q_positions has shape \(15,\) .*\[2, 16, \.\.\.\]"):
        enc.transform_qk(params, q, k, jnp.arange(T - 1), positions)
    with pytest.raises(ValueError, match=r"^k_positions has shape \(3, 16\)"):
        enc.transform_qk(params, q, k, positions, jnp.zeros((3, T), jnp.int32))
    with pytest.raises(ValueError, match=r"^q_positions has shape \(15,\)"):
        jrope.attention_logits(enc, params, q, k, jnp.arange(T - 1), positions)
    with pytest.raises(ValueError, match=r"^q_positions must be \[T\] or \[B, T\]"):
        enc.map_queries(params, q, jnp.zeros((1, 1, T), jnp.int32))
    with pytest.raises(ValueError, match=r"^q and k must have the same batch size"):
        enc.transform_qk(params, q, k[:1], positions, positions)


def test_the_helpers_name_the_argument_whose_shape_does_not_fit():
    pe = PositionalEncoding(_encoding("rope"))
    q, k, v = (_normal((B, T, N, H), seed) for seed in range(3))
    positions = jnp.arange(T)
    with pytest.raises(ValueError, match=r"^positions has shape \(12,\)"):
        causal_self_attention(pe, q, k, v, jnp.arange(12))
    with pytest.raises(ValueError, match=r"^positions has shape \(3, 16\)"):
        causal_self_attention(pe, q, k, v, jnp.zeros((3, T), jnp.int32))
    with pytest.raises(ValueError, match=r"\(one B, one S\).*v \(1, 16, 2, 16\)"):
        causal_self_attention(pe, q, k, v[:1], positions)
    with pytest.raises(ValueError, match=r"T = 16 > S = 8"):
        causal_self_attention(pe, q, k[:, :8], v[:, :8], positions[:8])
    with pytest.raises(ValueError, match=r"^k_positions has shape \(12,\)"):
        dot_product_attention(pe, q, k, v, positions, jnp.arange(12))
    with pytest.raises(ValueError, match=r"^q must be \[B, T, N, H\].*v \(16, 2, 16\)"):
        dot_product_attention(pe, q, k, v[0], positions, positions)


@pytest.mark.parametrize("kernel", ["xla", "einsum", "blockwise", "shear", "shear_flash"])
def test_every_kernel_refuses_keys_and_values_of_another_batch(kernel):
    enc = _encoding("jordan_rope")
    q, k = _normal((B, T, N, H)), _normal((1, T, N, H), 1)
    with pytest.raises(ValueError, match=r"batch"):  # not broadcast over q's batch
        causal_attention(
            q, k, k, enc=enc, params=enc.init_params(), positions=jnp.arange(T), kernel=kernel
        )
