"""Blockwise attention equals the plain path, in values and gradients, for every encoding.

The plain path is softmax(jrope.attention_logits + causal mask) @ v with the
whole T x S logit matrix. Shape legend: B batch, T query length, S key
length, N heads, H head dim.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.matrix import cases

import jrope
from jrope.attention import blocks
from jrope.attention.blockwise import blockwise_attention

BLOCK = 16
HEADS = 2
HEAD_DIM = 24  # divisible by 2, 4, 6 and 8: every layout and chain order fits
TRAIN_CONTEXT = 64
ENCODINGS = tuple(jrope.PAPER_METHODS) + (
    "jordan_exact_m3",
    "jordan_m3",
    "jordan_jetmix_m4_c150_g050_g030_g020",
    "jordan_exact_c150_eta010_alibi",
)


def _encoding(name):
    cfg = jrope.pe_config_from_name(name, train_context=TRAIN_CONTEXT)
    return jrope.make_encoding(cfg, num_heads=HEADS, head_dim=HEAD_DIM)


def _trained_params(enc, seed=0, gamma_raw=-3.0):
    """Parameters away from their initial values, so that every gradient path carries signal.

    The initial values are degenerate for this purpose (eta = 0, gamma = 1e-4);
    gamma_raw -3 gives gamma near softplus(-3) = 0.05.
    """
    params = enc.init_params()
    keys = jax.random.split(jax.random.key(seed), max(len(params), 1))
    out = {}
    for key, (name, value) in zip(keys, sorted(params.items()), strict=False):
        noise = 0.5 * jax.random.normal(key, value.shape, jnp.float32)
        out[name] = (gamma_raw + noise) if name == "gamma_raw" else (value + noise)
    return out


def _qkv(seed, batch, q_len, k_len, dtype=jnp.float32):
    kq, kk, kv, kw = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, q_len, HEADS, HEAD_DIM), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (batch, k_len, HEADS, HEAD_DIM), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (batch, k_len, HEADS, HEAD_DIM), jnp.float32).astype(dtype)
    # A fixed random cotangent: the loss sum(out * w) has informative gradients.
    w = jax.random.normal(kw, (batch, q_len, HEADS, HEAD_DIM), jnp.float32)
    return q, k, v, w


def _causal_mask(q_positions, k_positions):
    """bool [B|1, 1, T, S]: key visible iff its position is not after the query's."""
    q_pos = q_positions if q_positions.ndim == 2 else q_positions[None]
    k_pos = k_positions if k_positions.ndim == 2 else k_positions[None]
    return k_pos[:, None, None, :] <= q_pos[:, None, :, None]


def _plain_attention(logits, v, mask):
    logits = jnp.where(mask, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v.astype(jnp.float32)).astype(v.dtype)


def _attend_blockwise(enc, params, q, k, v, q_positions, k_positions, causal=True):
    return blockwise_attention(
        q,
        k,
        v,
        enc=enc,
        params=params,
        q_positions=q_positions,
        k_positions=k_positions,
        block_size=BLOCK,
        causal=causal,
    )


def _attend_plain(enc, params, q, k, v, q_positions, k_positions, causal=True):
    logits = jrope.attention_logits(enc, params, q, k, q_positions, k_positions)
    mask = _causal_mask(q_positions, k_positions) if causal else jnp.ones((1, 1, 1, 1), bool)
    return _plain_attention(logits, v, mask)


def _output_and_grads_fn(attend, enc, causal=True):
    """jitted (params, q, k, v, w, q_positions, k_positions) -> (out, grads).

    grads: of sum(out * w) w.r.t. (params, q, k, v). Positions are arguments, so
    one compilation serves every offset.
    """

    def loss(params, q, k, v, w, q_positions, k_positions):
        out = attend(enc, params, q, k, v, q_positions, k_positions, causal)
        return jnp.sum(out.astype(jnp.float32) * w), out

    grad_fn = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    return jax.jit(lambda *args: grad_fn(*args)[::-1])


def _assert_close(actual, expected, what, rtol=2e-4, param_floor=0.1):
    """(out, (dparams, dq, dk, dv)) within rtol of each tensor's largest magnitude.

    The parameter gradients share one scale, the largest of them but at least
    param_floor: some are tiny differences of large float32 terms in both
    paths (the shear rate of a stabilized variant at position 65536, where
    tau(p) is saturated and eta barely acts: about 1e-5 with 1e-5 of float32
    noise in either path), and only an error relative to a gradient that
    trains the encoding means anything. Near position 0 the same gradients are
    far above the floor and are tested tightly.
    """
    _, (dparams, _, _, _) = expected
    param_scale = max([np.max(np.abs(g)) for g in jax.tree.leaves(dparams)] + [param_floor])
    scales = (None, (jax.tree.map(lambda _: param_scale, dparams), None, None, None))
    for (path, e), a, scale in zip(
        jax.tree_util.tree_flatten_with_path(expected)[0],
        jax.tree.leaves(actual),
        jax.tree.leaves(scales, is_leaf=lambda x: x is None),
        strict=False,
    ):
        a = np.asarray(a, np.float64)
        e = np.asarray(e, np.float64)
        where = f"{what} {jax.tree_util.keystr(path)}"
        assert np.all(np.isfinite(a)), f"{where}: non-finite values"
        scale = max(np.max(np.abs(e)), 1e-6) if scale is None else scale
        err = np.max(np.abs(a - e))
        assert err <= rtol * scale, f"{where}: max error {err:.3g} vs scale {scale:.3g}"


def _compare_with_plain(name, *, batch, q_len, offsets, seed=0, k_len=None):
    """Blockwise vs plain for queries at the end of k_len keys, at each start offset."""
    enc = _encoding(name)
    params = _trained_params(enc, seed)
    k_len = q_len if k_len is None else k_len
    q, k, v, w = _qkv(seed, batch, q_len, k_len)
    blockwise = _output_and_grads_fn(_attend_blockwise, enc)
    plain = _output_and_grads_fn(_attend_plain, enc)
    for offset in offsets:
        k_positions = offset + jnp.arange(k_len, dtype=jnp.int32)
        q_positions = k_positions[k_len - q_len :]
        args = (params, q, k, v, w, q_positions, k_positions)
        got = blockwise(*args)
        assert set(got[1][0]) == set(params)
        _assert_close(got, plain(*args), f"{name} at offset {offset}")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    cases(ENCODINGS, ("rope_alibi", "damped_rope", "jordan_rope", "jordan_exact_m3", "direct_sum")),
)
def test_matches_plain_path_at_ragged_length_from_zero_to_65536(name):
    # 37 = 2 full blocks + 5: padding and masking of the last key block. Near 0
    # the stabilized shear time tau(p) is far from saturation, so its parameters'
    # gradients are large there and tested tightly; near 65536 the exact
    # variants must not overflow.
    _compare_with_plain(name, batch=2, q_len=37, offsets=(0, 65536 - 37))


@pytest.mark.slow
def test_matches_plain_path_at_a_block_multiple():
    # No padding at all; the encoding matters little here, so a cheap one to compile.
    _compare_with_plain("rope_alibi", batch=1, q_len=3 * BLOCK, offsets=(0, 65536 - 3 * BLOCK))


@pytest.mark.slow
@pytest.mark.parametrize("q_len", [21, 1])
def test_matches_plain_path_when_queries_are_the_last_keys(q_len):
    # A key/value cache, or a read-out of the last position: T new queries
    # attend to S = 70 keys (5 blocks, ragged). T = 1 makes one-row query blocks.
    # Damping and ALiBi both read the query/key position offset.
    _compare_with_plain(
        "damped_rope_alibi", batch=1, q_len=q_len, k_len=70, offsets=(4000,), seed=2
    )


@pytest.mark.slow
def test_batched_positions_use_a_per_row_origin():
    name = "damped_rope_alibi"  # per-row damping origin and per-row [B, N, T, S] bias
    enc = _encoding(name)
    params = _trained_params(enc, 3)
    q, k, v, w = _qkv(3, 2, 40, 40)
    # Row 0 starts at 0, row 1 at 65000: one origin per row must keep both finite.
    positions = jnp.array([0, 65000], jnp.int32)[:, None] + jnp.arange(40, dtype=jnp.int32)[None]
    args = (params, q, k, v, w, positions, positions)
    _assert_close(
        _output_and_grads_fn(_attend_blockwise, enc)(*args),
        _output_and_grads_fn(_attend_plain, enc)(*args),
        name,
    )


@pytest.mark.slow
def test_non_causal_matches_full_softmax():
    enc = _encoding("rope_alibi")
    params = _trained_params(enc, 4)
    q, k, v, w = _qkv(4, 1, 19, 45)
    args = (params, q, k, v, w, jnp.arange(19, dtype=jnp.int32), jnp.arange(45, dtype=jnp.int32))
    _assert_close(
        _output_and_grads_fn(_attend_blockwise, enc, causal=False)(*args),
        _output_and_grads_fn(_attend_plain, enc, causal=False)(*args),
        "non-causal",
    )


@pytest.mark.slow
def test_stays_exact_where_one_global_origin_overflows():
    # gamma near softplus(1.5) = 1.7: the plain factorized path measures positions
    # from one midpoint origin, so its key factors reach e^{gamma * 65} > e^{88}
    # over T = 130 and overflow; per-block origins keep every factor within
    # e^{+-gamma * 15}. The O(T^2) relative form is the oracle.
    enc = _encoding("jordan_exact_scaled")
    params = _trained_params(enc, 5, gamma_raw=1.5)
    q, k, v, _ = _qkv(5, 1, 130, 130)
    positions = 65536 + jnp.arange(130, dtype=jnp.int32)

    @jax.jit
    def factorized_oracle_blockwise(params, q, k, v, positions):
        factorized = jrope.attention_logits(enc, params, q, k, positions, positions)
        relative = enc.relative_logits(params, q, k, positions, positions)
        oracle = _plain_attention(relative, v, _causal_mask(positions, positions))
        return factorized, oracle, _attend_blockwise(enc, params, q, k, v, positions, positions)

    factorized, oracle, got = factorized_oracle_blockwise(params, q, k, v, positions)
    assert not np.all(np.isfinite(np.asarray(factorized))), "the hazard this test guards is absent"
    np.testing.assert_allclose(got, oracle, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_bfloat16_inputs_track_the_float32_plain_path():
    enc = _encoding("jordan_exact_scaled")
    params = _trained_params(enc, 6)
    q, k, v, _ = _qkv(6, 1, 37, 37, jnp.bfloat16)
    positions = 20000 + jnp.arange(37, dtype=jnp.int32)

    @jax.jit
    def blockwise_and_float32_plain(params, q, k, v, positions):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        return (
            _attend_blockwise(enc, params, q, k, v, positions, positions),
            _attend_plain(enc, params, *f32, positions, positions),
        )

    got, want = blockwise_and_float32_plain(params, q, k, v, positions)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2)


@pytest.mark.slow
def test_gradient_memory_is_linear_in_length():
    """The compiled backward pass's scratch memory grows about linearly with T, not as T^2."""
    enc = _encoding("damped_rope")
    params = enc.init_params()

    def loss(params, q, k, v, positions):
        return jnp.sum(_attend_blockwise(enc, params, q, k, v, positions, positions))

    def temp_bytes(length):
        shape = jax.ShapeDtypeStruct((1, length, HEADS, HEAD_DIM), jnp.float32)
        positions = jax.ShapeDtypeStruct((length,), jnp.int32)
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        return grad.lower(params, shape, shape, shape, positions).compile().memory_analysis()

    small = temp_bytes(1024).temp_size_in_bytes
    large = temp_bytes(4096).temp_size_in_bytes  # 256 blocks of 16 rows
    # Quadratic growth would be 16x; one T x T float32 logit matrix per head at 4096 is 128 MiB.
    assert large < 6 * small, (small, large)
    assert large < 4096 * 4096 * 4, large


def test_rejects_bad_input_with_a_clear_message():
    enc = _encoding("rope")
    q, k, v, _ = _qkv(7, 1, 8, 8)
    positions = jnp.arange(8, dtype=jnp.int32)
    kwargs = {"enc": enc, "params": {}, "q_positions": positions, "k_positions": positions}
    with pytest.raises(ValueError, match="block_size"):
        blockwise_attention(q, k, v, block_size=0, **kwargs)
    with pytest.raises(ValueError, match="k and v in every axis"):
        blockwise_attention(q, k, v[:, :4], block_size=4, **kwargs)
    with pytest.raises(ValueError, match="integer positions"):
        blockwise_attention(
            q,
            k,
            v,
            enc=enc,
            params={},
            q_positions=positions.astype(jnp.float32),
            k_positions=positions,
            block_size=4,
        )
    with pytest.raises(ValueError, match="k_positions must have shape"):
        blockwise_attention(
            q,
            k,
            v,
            enc=enc,
            params={},
            q_positions=positions,
            k_positions=positions[:5],
            block_size=4,
        )


def test_scale_is_inverse_sqrt_head_dim():
    # nope, one key visible per query at the first position: the output is v_0 exactly,
    # and with two keys the weights follow exp(q.k / sqrt(H)).
    enc = _encoding("nope")
    q, k, v, _ = _qkv(8, 1, 2, 2)
    positions = jnp.arange(2, dtype=jnp.int32)
    attend = jax.jit(functools.partial(blockwise_attention, enc=enc, params={}, block_size=1))
    out = attend(q, k, v, q_positions=positions, k_positions=positions)
    np.testing.assert_allclose(out[:, 0], v[:, 0], rtol=1e-6)
    logits = jnp.einsum("bnh,bsnh->bns", q[:, 1], k) / math.sqrt(HEAD_DIM)
    want = jnp.einsum("bns,bsnh->bnh", jax.nn.softmax(logits, -1), v)
    np.testing.assert_allclose(out[:, 1], want, rtol=1e-5, atol=1e-6)


def test_causal_loop_stops_at_the_last_key_block_with_a_visible_key():
    # 4 blocks of 16; the padded tail of a 60-token sequence must not count as a visible key.
    layout = blocks.Layout(16, 16, 60, 60, True)
    positions = jnp.pad(jnp.arange(60, dtype=jnp.int32), (0, 4), mode="edge")
    ends = blocks.key_block_ends(layout, positions, positions)
    np.testing.assert_array_equal(ends, [1, 2, 3, 4])
    # Queries that are the last 16 of 64 keys see every key block.
    kv_layout = blocks.Layout(16, 16, 16, 64, True)
    ends = blocks.key_block_ends(
        kv_layout, jnp.arange(48, 64, dtype=jnp.int32), jnp.arange(64, dtype=jnp.int32)
    )
    np.testing.assert_array_equal(ends, [4])
    # Batched positions: the loop covers the row that sees furthest.
    rows = jnp.stack([jnp.arange(64), jnp.arange(64) // 2]).astype(jnp.int32)
    ends = blocks.key_block_ends(blocks.Layout(16, 16, 64, 64, True), rows, rows)
    np.testing.assert_array_equal(ends, [1, 2, 3, 4])
