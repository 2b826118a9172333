"""A Transformer on packed rows (segment ids) gives each sequence what it gives alone."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.matrix import cases
from helpers.tiny_config import tiny_config

from jrope import attention
from jrope.model import Transformer
from jrope.train.setup import run_encoding

VOCAB = 11
# Two packed rows, each of two sequences of these lengths (positions restart at the second).
ROWS = ((6, 10), (10, 6))
LENGTH = 16


def _model(name, impl="auto"):
    cfg = tiny_config(
        **{
            "pe.name": name,
            "model.readout": "all",
            "model.attention_impl": impl,
            "model.block_size": 4,
            "model.num_layers": 1,
        }
    )
    return Transformer(cfg.model, run_encoding(cfg), VOCAB, rngs=nnx.Rngs(params=0))


def _packed_rows():
    """tokens, positions, segment ids, each int32 [len(ROWS), LENGTH]."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, (len(ROWS), LENGTH))
    positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in ROWS])
    segments = np.stack([np.repeat(np.arange(len(row)) + 5, row) for row in ROWS])
    return tuple(jnp.asarray(x, jnp.int32) for x in (tokens, positions, segments))


def _sequences(length):
    """(row, slice) of every packed sequence of `length` tokens."""
    for row, lengths in enumerate(ROWS):
        ends = np.cumsum(lengths)
        for n, end in zip(lengths, ends, strict=True):
            if n == length:
                yield row, slice(end - n, end)


def _gather(x, length):
    """The sequences of `length` tokens of x [B, LENGTH, ...] as rows [b, length, ...]."""
    return jnp.stack([x[row, piece] for row, piece in _sequences(length)])


def _logits_and_grads(model, tokens, positions, segment_ids, weight):
    """The logits and the gradient of sum(logits * weight) in the parameters, jitted."""
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(params, tokens, positions, segment_ids):
        logits = nnx.merge(graphdef, params)(tokens, positions, segment_ids=segment_ids)
        return jnp.sum(logits * weight), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        params, tokens, positions, segment_ids
    )
    return logits, grads


# On CPU 'auto' runs einsum here; blockwise (blocks of 4, one of them across the restart at 6)
# maps queries and keys per block instead of per sequence.
@pytest.mark.parametrize(
    "name,impl",
    cases(
        [
            ("rope", "auto"),
            ("jordan_rope", "auto"),
            ("alibi", "auto"),
            ("jordan_rope", "blockwise"),
        ],
        (("jordan_rope", "auto"), ("alibi", "auto")),
    ),
)
@pytest.mark.slow  # a model compiled several times: 10 to 25 s each
def test_packed_rows_equal_each_sequence_alone(name, impl):
    """Logits (eager, concrete positions; and jitted) and parameter gradients, float32.

    The packed and separate runs add the same terms (keys of the other
    sequence get exact zeros after the softmax) with each sequence mapped
    from the same origin (its own midpoint, or per block for blockwise), but
    matmuls of other shapes may sum in another order: agreement to a few
    float32 roundings, rtol 1e-5. A packed gradient is the sum of its
    sequences' gradients, summed in another order again: rtol 1e-4.
    """
    model = _model(name, impl)
    tokens, positions, segments = _packed_rows()
    weight = jax.random.normal(jax.random.PRNGKey(1), (len(ROWS), LENGTH, VOCAB))
    eager = model(tokens, positions, segment_ids=segments)
    packed, packed_grads = _logits_and_grads(model, tokens, positions, segments, weight)
    np.testing.assert_allclose(eager, packed, rtol=1e-5, atol=1e-5)
    grads_alone = jax.tree.map(jnp.zeros_like, packed_grads)
    for length in sorted({n for row in ROWS for n in row}):
        alone, grads = _logits_and_grads(
            model, *(_gather(x, length) for x in (tokens, positions)), None, _gather(weight, length)
        )
        np.testing.assert_allclose(_gather(packed, length), alone, rtol=1e-5, atol=1e-5)
        grads_alone = jax.tree.map(jnp.add, grads_alone, grads)
    jax.tree.map(
        lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5),
        packed_grads,
        grads_alone,
    )


def test_segment_ids_keep_a_sequence_from_seeing_the_one_before():
    """RoPE depends on position differences only, so the second sequence alone is the same at
    positions 6..15 as at 0..9: what changes its logits in one unpacked row 0..15 is attending
    to the first sequence, which its packed logits do not."""
    model = _model("rope")
    tokens, positions, segments = _packed_rows()
    packed = model(tokens, positions, segment_ids=segments)
    one_sequence = model(tokens, jnp.arange(LENGTH, dtype=jnp.int32))
    second = slice(ROWS[0][0], LENGTH)
    assert np.max(np.abs(packed[0, second] - one_sequence[0, second])) > 1e-3


@pytest.mark.parametrize("impl", ["splash", "cudnn"])
def test_fused_kernels_refuse_packed_rows_naming_the_fix(impl):
    model = _model("rope", impl)
    tokens, positions, segments = _packed_rows()
    with pytest.raises(
        ValueError, match=rf"attention_impl='{impl}' does not take segment ids.*'auto'"
    ):
        model(tokens, positions, segment_ids=segments)


@pytest.mark.parametrize("backend", ["cpu", "gpu", "tpu"])
@pytest.mark.parametrize("name", ["rope", "alibi", "jordan_rope"])
def test_auto_picks_a_packing_kernel(backend, name):
    """Where 'auto' would pick splash or cuDNN for whole rows, packed rows get another kernel."""
    cfg = tiny_config(**{"pe.name": name, "model.compute_dtype": "bfloat16"})
    for length in (256, 8192):
        kernel = attention.choose_kernel(
            cfg.model.attention, run_encoding(cfg), length=length, backend=backend, packed=True
        )
        assert kernel in attention.PACKING_KERNELS


@pytest.mark.slow
def test_the_kernel_follows_the_longest_sequence_not_the_row():
    """Positions 1000..1007 then 0..7, damping 0.5: the row's positions span 1000, each
    sequence's 8. Mapping 1000 positions from one origin would overflow (0.5 * 1000 > 80), so
    the einsum kernel would be refused; each sequence is mapped from its own origin, so it runs,
    finite."""
    model = _model("damped_rope", "einsum")
    for block in model.blocks:
        gamma_raw = block.attn.pe_params["gamma_raw"]
        gamma_raw[...] = jnp.full_like(gamma_raw[...], np.log(np.expm1(0.5)))
    tokens = jnp.zeros((1, LENGTH), jnp.int32)
    positions = jnp.concatenate([jnp.arange(8) + 1000, jnp.arange(8)])[None]
    segments = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 8)[None]
    logits = model(tokens, positions, segment_ids=segments)
    assert np.isfinite(np.asarray(logits)).all()
    with pytest.raises(ValueError, match="overflows float32"):
        model(tokens, jnp.concatenate([jnp.arange(8), jnp.arange(8) + 1000])[None])


def test_a_decode_step_refuses_segment_ids():
    """A decode step continues one sequence per row (a packed prompt goes through
    jrope.model.kv_cache.prefill); the refusal comes before the cache is touched, so a
    stand-in shows it."""
    model = _model("rope")
    tokens, positions, segments = _packed_rows()
    decoding = [types.SimpleNamespace(decoding=True)] * len(model.blocks)
    with pytest.raises(ValueError, match="decode step .* takes no segment ids"):
        model(tokens, positions, cache=decoding, segment_ids=segments)
