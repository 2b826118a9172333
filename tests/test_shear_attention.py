"""The shear as an exact per-pair weight: equal to the maps' logits, and bfloat16-safe."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.matrix import cases

import jrope
from jrope import attention, oracle
from jrope.attention import shear
from tests.helpers.shear_oracle import HEAD_DIM, TRAIN_CONTEXT, reference_logits
from tests.helpers.shear_oracle import setup_encoding as _setup

COVERED = (
    "nope",
    "rope",
    "alibi",
    "rope_alibi",
    "damped_rope",
    "jordan_rope",
    "jordan_no_gamma",
    "jordan_raw_tau",
    "jordan_eta050",
    "jordan_m3",
    "jordan_exact_scaled",
    "jordan_exact_eta1",
    "jordan_exact_m3_c010_eta100_eta1",
    "jordan_exact_c150_eta010_alibi",
    "real_jordan",
    "direct_sum",
)
SHEARED = ("jordan_rope", "jordan_raw_tau", "jordan_exact_scaled", "jordan_m3", "direct_sum")


def _compiled(function, **static):
    """`function` with the `static` keywords fixed, under jax.jit: one program per shape, where
    calling it eagerly compiles one per operation (most of such a test's time on CPU)."""
    return jax.jit(functools.partial(function, **static))


def _relative_error(value, reference, mask):
    return float(
        np.abs(np.asarray(value) - reference)[..., mask].max() / np.abs(reference[..., mask]).max()
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    cases(
        COVERED,
        ("nope", "rope_alibi", "jordan_rope", "jordan_m3", "jordan_exact_c150_eta010_alibi"),
    ),
)
def test_shear_weight_logits_equal_the_maps_logits_and_the_float64_formula(name):
    enc, params, q, k, _ = _setup(name, 40)
    positions = jnp.arange(40) + 9
    reference = reference_logits(enc, params, q, k, positions, positions)
    highest = jax.lax.Precision.HIGHEST
    new = _compiled(shear.shear_logits, encoding=enc, precision=highest)(
        params=params, q=q, k=k, q_positions=positions, k_positions=positions
    )
    today = jrope.attention_logits(enc, params, q, k, positions, positions, precision=highest)
    everything = np.ones((40, 40), bool)
    assert _relative_error(today, reference, everything) < 2e-6
    assert _relative_error(new, reference, everything) < 2e-6


def test_the_gated_jets_are_refused_with_the_reason():
    cfg = jrope.pe_config_from_name("jordan_jetmix_m3_c150_g050_g030", train_context=32)
    enc = jrope.make_encoding(cfg, 2, 48)
    assert "gated shear" in jrope.attention.feature_refusal("shear", enc)
    with pytest.raises(ValueError, match="gated shear"):
        shear.shear_logits(
            enc,
            enc.init_params(),
            jnp.ones((1, 4, 2, 48)),
            jnp.ones((1, 4, 2, 48)),
            jnp.arange(4),
            jnp.arange(4),
        )


def test_the_stabilized_time_lag_is_exact_at_any_offset():
    cfg = jrope.pe_config_from_name("jordan_rope", train_context=TRAIN_CONTEXT)
    enc = jrope.make_encoding(cfg, 2, HEAD_DIM)
    from tests.helpers.shear_oracle import time_lags

    for offset in (-70, 0, 65536, 2**30):
        positions = jnp.arange(-3, 5) + offset
        lag = shear.pair_time_lag(enc, positions[None], positions[None])[0]
        exact = time_lags(cfg, np.asarray(positions), np.asarray(positions))
        np.testing.assert_allclose(np.asarray(lag), exact, rtol=1e-6, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("offset", [0, 65536, 2**30])
def test_bfloat16_logits_keep_ropes_own_bfloat16_error(offset):
    """bfloat16 q, k and default-precision dots: every sheared variant within 1.5x RoPE's error.

    The error is the largest deviation from the float64 formula over the causal
    pairs, relative to the largest logit; RoPE's is measured the same way, on its
    own mapped q, k rounded to bfloat16 (its usual path).
    """
    length = 4 * TRAIN_CONTEXT
    causal = np.tril(np.ones((length, length), bool))
    positions = jnp.arange(length) + offset
    errors = {}
    for name in ("rope", *SHEARED):
        enc, params, q, k, _ = _setup(name, length, jnp.bfloat16)
        reference = reference_logits(enc, params, q, k, positions, positions)
        if name == "rope":
            logits = jrope.attention_logits(enc, params, q, k, positions, positions)
        else:
            logits = _compiled(shear.shear_logits, encoding=enc)(
                params=params, q=q, k=k, q_positions=positions, k_positions=positions
            )
        errors[name] = _relative_error(logits, reference, causal)
    for name in SHEARED:
        assert errors[name] <= 1.5 * errors["rope"], errors


def _attention_outputs_and_grads(enc, params, q, k, v, positions, kernel):
    cotangent = jax.random.normal(jax.random.PRNGKey(11), q.shape, jnp.float32)

    def loss(q, k, v):
        if kernel == "shear":
            out = shear.shear_attention(
                q, k, v, enc=enc, params=params, q_positions=positions, k_positions=positions
            )
        else:
            out = jrope.attention.causal_attention(
                q,
                k,
                v,
                enc=enc,
                params=params,
                positions=positions,
                kernel="einsum",
                precision=jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None,
            )
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float64) for x in (out, *grads)]


@pytest.mark.slow
def test_bfloat16_attention_outputs_and_gradients_keep_ropes_own_error():
    """Output, dq, dk, dv from bfloat16 q, k, v within 1.5x RoPE's error (relative RMS).

    The reference is today's float32 path at HIGHEST (equal to the float64
    formula, tests above). How much a logit error moves the softmax grows with
    the logits' spread, so RoPE runs with its queries scaled to the variant's
    logit RMS over the causal pairs, and is measured the same way.
    """
    length = 4 * TRAIN_CONTEXT
    positions = jnp.arange(length) + 65536
    causal = np.tril(np.ones((length, length), bool))

    def logit_rms(enc, params, q, k):
        logits = np.asarray(jrope.attention_logits(enc, params, q, k, positions, positions))
        return np.sqrt(np.mean(logits[..., causal] ** 2))

    def errors(enc, params, q, k, v, kernel):
        reference = _attention_outputs_and_grads(enc, params, q, k, v, positions, "einsum")
        low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        result = _attention_outputs_and_grads(enc, params, *low, positions, kernel)
        return [
            np.linalg.norm(a - b) / np.linalg.norm(b)
            for a, b in zip(result, reference, strict=True)
        ]

    rope = _setup("rope", length)
    rope_rms = logit_rms(*rope[:4])
    for name in SHEARED:
        enc, params, q, k, v = _setup(name, length)
        scale = logit_rms(enc, params, q, k) / rope_rms
        rope_errors = errors(rope[0], rope[1], rope[2] * scale, *rope[3:], "einsum")
        got = errors(enc, params, q, k, v, "shear")
        assert all(e <= 1.5 * r for e, r in zip(got, rope_errors, strict=True)), (
            name,
            got,
            rope_errors,
        )


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["shear", "shear_flash"])
def test_bfloat16_outputs_stay_within_ropes_own_error_over_the_trained_range(kernel):
    """Output RMS error from bfloat16 q, k, v at most RoPE's own (einsum, the same q, k, v),
    against the float64 oracle: eta up to its bound, gamma from its floor to max_damping,
    offsets 0 to 2^30, at the training length (docs/numerics.md, section 3a).

    1.15x: at large offsets the stabilized shear vanishes and the error is RoPE's, within the
    few per cent by which two encodings' errors differ on the same inputs.
    """
    length = 128
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    q, k, v = (
        jax.random.normal(key, (1, length, 2, HEAD_DIM)).astype(jnp.bfloat16) for key in keys
    )

    def error(enc, params, positions, kernel):
        with oracle.float64():
            want = np.asarray(
                _oracle_attention(enc, *oracle.as_float64((params, q, k, v)), positions)
            )
        got = attention.causal_attention(
            q, k, v, enc=enc, params=params, positions=positions, kernel=kernel, block_size=64
        )
        return np.sqrt(np.mean((oracle.as_float64(got) - want) ** 2) / np.mean(want**2))

    rope = jrope.make_encoding(jrope.pe_config_from_name("rope", train_context=length), 2, HEAD_DIM)
    for offset in (0, 2**30):
        positions = jnp.arange(length, dtype=jnp.int32) + offset
        rope_error = error(rope, {}, positions, "einsum")
        for name in ("jordan_rope", "jordan_raw_tau", "jordan_m3", "direct_sum"):
            cfg = jrope.pe_config_from_name(name, train_context=length)
            enc = jrope.make_encoding(cfg, 2, HEAD_DIM)
            for eta_fraction, gamma in ((0.5, 1e-4), (0.9, 1e-4), (0.9, 0.02)):
                params = dict(enc.init_params())
                params["eta_raw"] = jnp.full_like(params["eta_raw"], np.arctanh(eta_fraction))
                excess = gamma - cfg.gamma_min if gamma > cfg.gamma_min else 1e-8
                raw = excess + np.log(-np.expm1(-excess))  # softplus^-1
                params["gamma_raw"] = jnp.full_like(params["gamma_raw"], raw)
                got = error(enc, params, positions, kernel)
                assert got <= 1.15 * rope_error, (
                    name,
                    offset,
                    eta_fraction,
                    gamma,
                    got,
                    rope_error,
                )


_oracle_attention = jax.jit(oracle.attention, static_argnums=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jordan_rope", "jordan_exact_c150_eta010_alibi", "direct_sum"])
def test_the_shear_weight_kernel_equals_the_einsum_kernel_in_float32(name):
    enc, params, q, k, v = _setup(name, 24, batch=2)
    positions = jnp.arange(24) + 100
    highest = jax.lax.Precision.HIGHEST
    got = _compiled(shear.shear_attention, enc=enc, precision=highest)(
        q, k, v, params=params, q_positions=positions, k_positions=positions
    )
    want = _compiled(jrope.attention.causal_attention, enc=enc, kernel="einsum", precision=highest)(
        q, k, v, params=params, positions=positions
    )
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["shear", "shear_flash"])
def test_packed_rows_equal_each_segment_run_alone(kernel):
    """Two sequences in one row (positions restart, segment ids) give each one's own output."""
    from jrope.attention import shear_flash

    function = {"shear": shear.shear_attention, "shear_flash": shear_flash.shear_flash_attention}
    enc, params, q, k, v = _setup("jordan_rope", 24)
    positions = jnp.concatenate([jnp.arange(10), jnp.arange(14)])[None]
    segments = jnp.concatenate([jnp.zeros(10, jnp.int32), jnp.ones(14, jnp.int32)])[None]
    extra = {"block_size": 8} if kernel == "shear_flash" else {}
    attend = _compiled(function[kernel], enc=enc, **extra)
    packed = attend(
        q,
        k,
        v,
        params=params,
        q_positions=positions,
        k_positions=positions,
        q_segments=segments,
        k_segments=segments,
    )
    for part in (slice(0, 10), slice(10, 24)):
        alone = attend(
            q[:, part],
            k[:, part],
            v[:, part],
            params=params,
            q_positions=positions[:, part],
            k_positions=positions[:, part],
        )
        np.testing.assert_allclose(packed[:, part], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dot_product_attention_runs_the_raw_shear_in_bfloat16_without_highest_dots():
    enc, params, q, k, v = _setup("jordan_rope", 32)
    pe = jrope.PositionalEncoding(enc)
    positions = jnp.arange(32) + 1000
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]

    def attend(q, k, v):
        return jrope.dot_product_attention(pe, q, k, v, positions, positions, is_causal=True)

    program = str(jax.make_jaxpr(attend)(*low))
    assert "HIGHEST" not in program and "bf16" in program
    got = jax.jit(attend)(*low)
    assert got.dtype == jnp.bfloat16
    highest = jax.lax.Precision.HIGHEST
    want = _compiled(jrope.attention.causal_attention, enc=enc, kernel="einsum", precision=highest)(
        q, k, v, params=pe.param_values(), positions=positions
    )
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["shear"])
def test_causal_attention_with_segment_ids_equals_each_segment_alone(kernel):
    enc, params, q, k, v = _setup("jordan_exact_c150_eta010_alibi", 24)
    positions = jnp.concatenate([jnp.arange(10), jnp.arange(14)])[None] + 7
    segments = jnp.concatenate([jnp.zeros(10, jnp.int32), jnp.ones(14, jnp.int32)])[None]
    attend = jrope.attention.causal_attention

    def loss(q, k, v, **where):
        out = attend(q, k, v, enc=enc, params=params, kernel=kernel, **where)
        return jnp.sum(out * v[:, -out.shape[1] :]), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, packed), packed_grads = grad(q, k, v, positions=positions, segment_ids=segments)
    for part in (slice(0, 10), slice(10, 24)):
        (_, alone), alone_grads = grad(
            q[:, part], k[:, part], v[:, part], positions=positions[:, part]
        )
        np.testing.assert_allclose(packed[:, part], alone, rtol=1e-5, atol=1e-6)
        for got, want in zip(packed_grads, alone_grads, strict=True):
            np.testing.assert_allclose(got[:, part], want, rtol=1e-4, atol=1e-5)
