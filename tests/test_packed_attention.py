"""Packed rows (segment ids, positions restarting per segment) equal each sequence in a row alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.matrix import cases

import jrope
from jrope.attention import PACKING_KERNELS, causal_attention

HEADS, HEAD_DIM = 2, 16
# Two rows of packed sequences: (first position, length) of each segment. Some
# segments start above where the one before ended (no restart). Two lengths
# only: the separate runs stack equal lengths as rows, one compilation each.
ROWS = (((2, 6), (0, 6), (40, 8)), ((0, 6), (30, 6), (0, 8)))
LENGTH = 20
BIAS_FREE = ("rope", "jordan_rope")
ENCODINGS = ("rope", "alibi", "rope_alibi", "damped_rope", "jordan_rope")


def _packed_inputs():
    positions, segments = [], []
    for row in ROWS:
        positions.append(np.concatenate([start + np.arange(n) for start, n in row]))
        segments.append(np.concatenate([np.full(n, 3 * i + 1) for i, (_, n) in enumerate(row)]))
    return jnp.asarray(np.stack(positions), jnp.int32), jnp.asarray(np.stack(segments), jnp.int32)


def _spans():
    """(row, slice) of every segment."""
    for row, parts in enumerate(ROWS):
        start = 0
        for _, n in parts:
            yield row, slice(start, start + n)
            start += n


def _setup(name):
    """An encoding with perturbed parameters (damping well above its init), q, k, v, a cotangent."""
    cfg = jrope.pe_config_from_name(name, train_context=32)
    enc = jrope.make_encoding(cfg, HEADS, HEAD_DIM)
    params = {
        key: value + 0.3 * jax.random.normal(jax.random.PRNGKey(i), value.shape)
        for i, (key, value) in enumerate(enc.init_params().items())
    }
    keys = jax.random.split(jax.random.PRNGKey(7), 4)
    shape = (len(ROWS), LENGTH, HEADS, HEAD_DIM)
    q, k, v, weight = (jax.random.normal(key, shape) for key in keys)
    return enc, params, (q, k, v), weight


def _value_and_grads(
    enc, kernel, weight, operands, params, positions, segment_ids=None, block_size=4
):
    """The output and the gradients of sum(output * weight) in (q, k, v) and params, jitted."""

    def loss(operands, params, positions, segment_ids):
        q, k, v = operands
        out = causal_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            positions=positions,
            kernel=kernel,
            block_size=block_size,
            segment_ids=segment_ids,
        )
        return jnp.sum(out * weight), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, out), grads = grad(operands, params, positions, segment_ids)
    return out, grads


KERNEL_CASES = [
    (kernel, name)
    for kernel in ("einsum", "xla", "blockwise")
    for name in (ENCODINGS if kernel != "xla" else BIAS_FREE)
]


@pytest.mark.parametrize(
    "kernel,name",
    cases(
        KERNEL_CASES,
        (("einsum", "alibi"), ("xla", "jordan_rope"), ("blockwise", "damped_rope")),
        quick=(("einsum", "alibi"),),  # each case compiles for 5 to 10 s
    ),
)
def test_packed_rows_equal_each_segment_alone_with_gradients(kernel, name):
    """Outputs and the gradients of q, k, v and the encoding's parameters, in float32.

    The packed and the separate runs add the same terms (masked keys
    contribute exact zeros) but map q and k from other origins, so they
    agree to a few float32 roundings of the encoding's factors: rtol 1e-5.
    """
    enc, params, operands, weight = _setup(name)
    positions, segments = _packed_inputs()
    out, ((dq, dk, dv), dparams) = _value_and_grads(
        enc, kernel, weight, operands, params, positions, segments
    )
    dparams_alone = jax.tree.map(jnp.zeros_like, params)
    for length in {part.stop - part.start for _, part in _spans()}:
        spans = [(row, part) for row, part in _spans() if part.stop - part.start == length]
        alone_rows = lambda x: jnp.stack([x[row, part] for row, part in spans])  # noqa: E731,B023
        alone, (grads_alone, dparams1) = _value_and_grads(
            enc,
            kernel,
            alone_rows(weight),
            [alone_rows(x) for x in operands],
            params,
            alone_rows(positions),
        )
        for index, (row, part) in enumerate(spans):
            np.testing.assert_allclose(out[row, part], alone[index], rtol=1e-5, atol=1e-5)
            for got, want in zip((dq, dk, dv), grads_alone, strict=True):
                np.testing.assert_allclose(got[row, part], want[index], rtol=1e-5, atol=1e-5)
        dparams_alone = jax.tree.map(jnp.add, dparams_alone, dparams1)
    for key in params:
        np.testing.assert_allclose(dparams[key], dparams_alone[key], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "segment_ids,positions,message",
    [
        (np.zeros((1, 8)), np.arange(8), "integers"),
        (np.zeros((2, 8)), np.arange(8), r"\[B, S\] = \[1, 8\]"),
        (np.array([[1, 1, 2, 2, 1, 1, 3, 3]]), np.arange(8) % 2, "contiguous run"),
        (
            np.array([[1, 1, 1, 1, 2, 2, 2, 2]]),
            np.array([0, 1, 2, 0, 0, 1, 2, 3]),
            "must increase within segment",
        ),
    ],
)
def test_bad_segment_ids_are_refused_with_the_rule_they_break(segment_ids, positions, message):
    enc, params, (q, k, v), _ = _setup("rope")
    with pytest.raises(ValueError, match=message):
        causal_attention(
            q[:1, :8],
            k[:1, :8],
            v[:1, :8],
            enc=enc,
            params=params,
            positions=jnp.asarray(positions, jnp.int32),
            kernel="einsum",
            segment_ids=jnp.asarray(segment_ids),
        )


@pytest.mark.parametrize("kernel", sorted(set(jrope.attention.KERNELS) - set(PACKING_KERNELS)))
def test_kernels_without_segment_ids_refuse_packed_rows(kernel):
    enc, params, (q, k, v), _ = _setup("rope")
    with pytest.raises(ValueError, match=f"The '{kernel}' kernel does not take segment ids"):
        causal_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            positions=jnp.arange(LENGTH),
            kernel=kernel,
            segment_ids=jnp.zeros((len(ROWS), LENGTH), jnp.int32),
        )


@pytest.mark.parametrize(
    "kernel",
    # blockwise over 5 s, shear_flash (Pallas interpret mode) over 10 s on 2 CPU cores.
    [
        "einsum",
        "xla",
        "shear",
        *(pytest.param(kernel, marks=pytest.mark.slow) for kernel in ("blockwise", "shear_flash")),
    ],
)
def test_strong_damping_stays_finite_across_a_restart(kernel):
    """gamma 0.5, positions 1000..1009 then 0..9, blocks of 8 (one holds 1008, 1009, 0..5).

    One origin for the row (its positions' midpoint) or for a block (its
    first position) would give some factor e^{0.5 * 500} or more, far past
    float32. The kernels that map a row at once (xla, einsum, shear) map each
    sequence from its own midpoint, the blocked ones (blockwise, shear_flash)
    measure block origins on the row coordinates: every factor stays bounded
    and the row equals its sequences alone.
    """
    enc, _, (q, k, v), weight = _setup("damped_rope")
    params = {"gamma_raw": jnp.full((HEADS, HEAD_DIM // 4), np.log(np.expm1(0.5)), jnp.float32)}
    assert enc.largest_damping(params) == pytest.approx(0.5, rel=1e-3)
    positions = jnp.concatenate([jnp.arange(10) + 1000, jnp.arange(10)])[None]
    segments = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 10)[None]
    operands = [x[:1] for x in (q, k, v)]
    packed, (grads, _) = _value_and_grads(
        enc, kernel, weight[:1], operands, params, positions, segments, block_size=8
    )
    assert all(np.isfinite(np.asarray(x)).all() for x in (packed, *grads))
    halves = lambda x: jnp.concatenate([x[:, :10], x[:, 10:]])  # noqa: E731
    alone, (grads_alone, _) = _value_and_grads(
        enc,
        kernel,
        halves(weight[:1]),
        [halves(x) for x in operands],
        params,
        halves(positions),
        block_size=8,
    )
    np.testing.assert_allclose(halves(packed), alone, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_alone, strict=True):
        np.testing.assert_allclose(halves(got), want, rtol=1e-5, atol=1e-5)
