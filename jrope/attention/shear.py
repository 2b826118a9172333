"""The shear as an exact per-pair weight: Jordan-RoPE as a few dots of RoPE's kind.

For every variant whose chain coefficients are the exponential series of one
shear time (docs/numerics.md, section 3a, derives it):

    q'_i . k'_j = sum_{r < m} (time_i - time_j)^r  B_r(i, j),

each B_r a damped-rotary dot of RoPE's kind, which bfloat16 inputs with
float32 accumulation resolve; the cancellation of the factorized maps
happens instead in the scalar weight, formed from the integer positions
(pe_math.ShearTime.lag).

The kernel takes the features its hooks carry (FEATURES) and refuses any
other by name: the gated jet mixes' (jordan_jetmix*), whose chain is not the
exponential of one time, among them.

Shape legend: B batch, T query length, S key length, N heads, H head dim,
nb blocks per segment, m chain order, d_r the width of term r.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jrope import encodings
from jrope.attention import packing
from jrope.attention.dense import MASK_VALUE
from jrope.encodings import add_bias

# The encoding features this kernel computes: the shear terms', the bias and the logits transform.
FEATURES = encodings.TERM_FEATURES | {encodings.BIAS, encodings.LOGITS}


class ShearTerms(NamedTuple):
    """The dots of one call: score = sum_r weight^r queries[r] . keys[r] (before 1/sqrt(H)).

    queries[r]: [B, T, N, d_r]; keys[r]: [B, S, N, d_r], float32; term 0 is the
    damped-rotary dot of the whole head, term r >= 1 the shifted chain
    (Encoding.shear_terms).
    """

    queries: tuple[jax.Array, ...]
    keys: tuple[jax.Array, ...]


def term_dot(dot, q_r, k_r, dtype, *, shifted: bool) -> jax.Array:
    """dot(q_r, k_r) of float32 terms in `dtype`, float32; a shifted term (r >= 1) of a 16-bit
    dtype to about float32 accuracy.

    The shifted terms' dots are weighted by (time_i - time_j)^r, which makes their logits
    many times RoPE's: rounded to bfloat16, their error alone would exceed RoPE's whole
    bfloat16 error. Each side is taken as a high part and the rounding left over, in three
    dots of `dtype` (the terms beyond them below float32's precision).
    """
    if not shifted or jnp.finfo(dtype).bits > 16:
        return dot(q_r.astype(dtype), k_r.astype(dtype))
    q_hi, k_hi = q_r.astype(dtype), k_r.astype(dtype)
    q_lo = (q_r - q_hi.astype(q_r.dtype)).astype(dtype)
    k_lo = (k_r - k_hi.astype(k_r.dtype)).astype(dtype)
    return dot(q_hi, k_hi) + (dot(q_hi, k_lo) + dot(q_lo, k_hi))


def pair_time_lag(encoding: Any, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """time(i) - time(j) of the shear, formed from the integer positions, float32 [B|1, T, S].

    q_positions: int32 [B|1, T]; k_positions: int32 [B|1, S] (pe_math.ShearTime.lag).
    """
    i = q_positions.astype(jnp.int32)[:, :, None]
    j = k_positions.astype(jnp.int32)[:, None, :]
    return encoding.shear_time.lag(i, j)


def shear_terms(
    encoding: Any, params, q, k, q_positions, k_positions, origin, k_origin=None
) -> ShearTerms:
    """The damped-rotated queries and keys of every term, float32.

    q: [B, T, N, H]; k: [B, S, N, H]; positions int32 [B|1, T] / [B|1, S];
    origin: int32 [B|1, 1] (or one per query, [B|1, T]), where the damped
    rotation is measured from (any origin gives the same dots; one inside the
    window keeps them bounded); k_origin: the keys' (default: origin), e.g.
    one per key block, [B|1, S], for a kernel that moves them per pair.
    """
    k_origin = origin if k_origin is None else k_origin
    return ShearTerms(
        encoding.shear_terms(params, q, q_positions, origin, queries=True),
        encoding.shear_terms(params, k, k_positions, k_origin, queries=False),
    )


def batched_positions(positions) -> jax.Array:
    positions = jnp.asarray(positions).astype(jnp.int32)
    return positions[None] if positions.ndim == 1 else positions


def combine_terms(dots: list[jax.Array], time_lag: jax.Array | None) -> jax.Array:
    """sum_r time_lag^r dots[r] (Horner); dots[r] [..., T, S] float32, time_lag broadcastable."""
    total = dots[-1]
    for dot in reversed(dots[:-1]):
        total = total * time_lag + dot
    return total


def shear_logits(
    encoding: Any,
    params,
    q: jax.Array,
    k: jax.Array,
    q_positions,
    k_positions,
    *,
    precision: jax.lax.Precision | None = None,
    origins: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """The encoded logits as weighted dots, float32 [B, N, T, S]: scaled by 1/sqrt(H), bias added,
    then the encoding's transform_logits.

    Equal to jrope.attention_logits for every covered encoding; the dots take
    q's dtype (bfloat16 inputs give bfloat16 dots with float32 accumulation)
    at `precision` (None: the backend's default).
    q: [B, T, N, H]; k: [B, S, N, H]; positions int32 [T] / [S] or [B, T] / [B, S];
    origins: optional per-token origins (int32 [B, T], [B, S]) of packed rows
    (packed_origins), else the window's midpoint.
    """
    encodings.check_supported(encoding, FEATURES, "the shear kernel")
    q_pos, k_pos = batched_positions(q_positions), batched_positions(k_positions)
    q_origin, k_origin = (
        (encodings.default_origin(q_pos, k_pos), None) if origins is None else origins
    )
    terms = shear_terms(encoding, params, q, k, q_pos, k_pos, q_origin, k_origin)

    def dot(a, b):
        return jnp.einsum(
            "btnh,bsnh->bnts", a, b, preferred_element_type=jnp.float32, precision=precision
        )

    dots = [
        term_dot(dot, q_r, k_r, q.dtype, shifted=r > 0)
        for r, (q_r, k_r) in enumerate(zip(terms.queries, terms.keys, strict=True))
    ]
    time_lag = pair_time_lag(encoding, q_pos, k_pos)[:, None] if len(dots) > 1 else None
    logits = combine_terms(dots, time_lag) / math.sqrt(encoding.head_dim)
    logits = add_bias(logits, encoding.logit_bias(params, q_positions, k_positions))
    return encoding.transform_logits(params, logits)


def packed_origins(q_positions, k_positions, q_segments, k_segments):
    """Per-token origins of packed rows: each sequence's midpoint, int32 ([B, T], [B, S]).

    The keys' from their segment (jrope.attention.packing.segment_midpoints);
    a query takes its segment's (from the keys), or its own position when no
    key shares its segment (it then sees none). Positions, segments [B|1, T] / [B|1, S].
    """
    k_origin = packing.segment_midpoints(k_positions, k_segments)
    same = k_segments[:, None, :] == q_segments[:, :, None]  # [B, T, S]
    q_origin = jnp.max(jnp.where(same, k_origin[:, None, :], jnp.iinfo(jnp.int32).min), -1)
    return jnp.where(same.any(-1), q_origin, q_positions), k_origin


def visibility(
    q_positions, k_positions, q_segments=None, k_segments=None, *, causal: bool = True
) -> jax.Array:
    """bool [B|1, 1, T, S]: key j visible to query i (if causal, j's position <= i's; one segment)."""
    visible = jnp.ones((1, q_positions.shape[-1], k_positions.shape[-1]), bool)
    if causal:
        visible = visible & (k_positions[:, None, :] <= q_positions[:, :, None])
    if q_segments is not None:
        visible = visible & (k_segments[:, None, :] == q_segments[:, :, None])
    return visible[:, None]


def shear_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    enc: Any,
    params,
    q_positions: jax.Array,
    k_positions: jax.Array,
    q_segments: jax.Array | None = None,
    k_segments: jax.Array | None = None,
    causal: bool = True,
    mask: jax.Array | None = None,
    precision: jax.lax.Precision | None = None,
) -> jax.Array:
    """Attention with the shear as an exact per-pair weight, whole logits in XLA.

    The oracle of the flash kernel (jrope.attention.shear_flash). Differentiable
    by autodiff in q, k, v and params.

    Args:
      q: [B, T, N, H]; k, v: [B, S, N, H] raw (not position-encoded), float32
        or bfloat16: the term dots run in q's dtype with float32 accumulation.
      enc: an Encoding whose features this kernel takes (FEATURES).
      q_positions: int32 [T] or [B, T]; k_positions: int32 [S] or [B, S].
      q_segments, k_segments: optional int32 [B, T] / [B, S] segment ids of
        packed rows: a query sees only keys of its own segment (positions
        restart per segment).
      mask: optional bool [B|1, N|1, T, S], True where a query may see a key.
      precision: of the term and p.v dots (None: the backend's default).
    Returns:
      [B, T, N, H] in v's dtype; a query that sees no key gets zeros.
    """
    check_shapes(q, k, v)
    q_pos, k_pos = batched_positions(q_positions), batched_positions(k_positions)
    origins = None
    if q_segments is not None:
        q_segments, k_segments = batched_positions(q_segments), batched_positions(k_segments)
        # Each packed sequence mapped from its own midpoint, as it would be alone.
        q_pos = jnp.broadcast_to(q_pos, q_segments.shape)
        k_pos = jnp.broadcast_to(k_pos, k_segments.shape)
        origins = packed_origins(q_pos, k_pos, q_segments, k_segments)
    logits = shear_logits(enc, params, q, k, q_pos, k_pos, precision=precision, origins=origins)
    visible = visibility(q_pos, k_pos, q_segments, k_segments, causal=causal)
    if mask is not None:
        visible = visible & mask
    return masked_softmax_values(logits, visible, v, precision)


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """ValueError unless q [B, T, N, H] and k, v [B, S, N, H] agree: none is broadcast."""
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"q {q.shape}, k {k.shape} and v {v.shape} must agree in batch, heads and head dim "
            "(k and v in every axis)."
        )


def masked_softmax_values(logits, visible, v, precision):
    """softmax over visible keys of logits [B, N, T, S], times v [B, S, N, H] -> [B, T, N, H]."""
    masked = jnp.where(visible, logits, MASK_VALUE)
    # The shift cancels in the softmax: no gradient flows through it.
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True))
    unnormalised = jnp.where(visible, jnp.exp(masked - row_max), 0.0)
    row_sum = jnp.maximum(jnp.sum(unnormalised, axis=-1), jnp.finfo(jnp.float32).tiny)
    dots = dict(preferred_element_type=jnp.float32, precision=precision)
    out = jnp.einsum("bnts,bsnh->btnh", unnormalised.astype(v.dtype), v, **dots)
    return (out / jnp.transpose(row_sum, (0, 2, 1))[..., None]).astype(v.dtype)
