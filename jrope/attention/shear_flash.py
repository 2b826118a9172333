"""The shear-weight attention (jrope.attention.shear) as a Pallas flash kernel: memory linear in T.

One program per (batch row, head, query block) runs an online softmax over
the key blocks up to its causal end (running maximum, running sum, rescaled
accumulator), so no T x S array exists. Inside, per key block:

    k'_r  = e^{gamma d} R(-omega d) k_r          d = o_k - o: the key block's
                                                 origin moved to the query block's
    logit = sum_r (time_i - time_j)^r (q_r . k'_r) / sqrt(H)

The damped-rotated terms (Encoding.shear_terms) are mapped once outside the
kernel, the queries from their block's first position o and the keys from
theirs o_k (on the row coordinates for packed rows, jrope.attention.packing),
as the blockwise kernel maps them: every factor stays within e^{gamma * block}.
The move is one damped rotation per (re, im) pair (Encoding.term_rates); the
time-lag weight is formed per pair from the integer positions
(pe_math.ShearTime.lag). The term dots take the inputs' dtype at the default
precision. Each term's dims come as separate re and im arrays, so the kernel
neither slices nor shuffles lanes; packed rows pass segment ids.

Gradients: a custom VJP, flash style. The forward kernel also returns each
query's logsumexp; with delta = rowsum(dO * O) two more kernels recompute
p = exp(logit - logsumexp) block by block:

  dK/dV, one program per (batch row, head, key block), over the query blocks
    from the first whose causal end reaches it: dV += p^T dO,
    ds = p (dO V^T - delta), dk'_r += (time_i - time_j)^r ds^T q_r / sqrt(H),
    taken back through the block's move (k' = M k, dk = M^T dk');
  dQ, one program per query block, over its key blocks:
    dq_r += (time_i - time_j)^r ds k'_r / sqrt(H).

The move's rate gamma gets sum_keys o_k <dk, k> - sum_queries o <dq, q> per
pair (d logit / d gamma is (o_k - o) times the pair's share of the dot), and
the term cotangents flow to q, k and the parameters through the VJP of the
outside-kernel map. No T x S array exists in either direction; padded and
invisible pairs get p = 0, as in the forward.

Under a mesh of more than one device the kernels run per device on its
batch rows (jrope.attention.mesh_split).

Shape legend: B batch, T query length, S key length, N heads, H head dim,
d the width of one term's re (or im) half, bq / bk block lengths.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jrope import encodings
from jrope.attention import packing, shear
from jrope.attention.dense import MASK_VALUE
from jrope.attention.mesh_split import split_over_batch

# Query and key block length: TPU lanes want multiples of 128.
BLOCK = 128


# The encoding features this kernel computes: the shear terms' (no logit bias).
FEATURES = encodings.TERM_FEATURES


def shear_flash_attention(
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
    block_size: int = BLOCK,
    interpret: bool | None = None,
) -> jax.Array:
    """Causal attention with the shear as an exact per-pair weight, by blocks in one Pallas kernel.

    Args:
      q: [B, T, N, H], the last T of the S positions; k, v: [B, S, N, H],
        raw (not position-encoded), float32 or bfloat16.
      enc: an Encoding whose features this kernel takes (FEATURES).
      q_positions: int32 [T] or [B, T]; k_positions: int32 [S] or [B, S].
      q_segments, k_segments: optional int32 [B, T] / [B, S] segment ids.
      block_size: query and key block length (T and S are padded to it).
      interpret: Pallas interpret mode (default: off TPU and GPU).
    Returns:
      [B, T, N, H] in v's dtype. Differentiable (reverse mode) in q, k, v, params.
    """
    encodings.check_supported(enc, FEATURES, "the shear_flash kernel")
    shear.check_shapes(q, k, v)
    if interpret is None:
        interpret = jax.default_backend() not in ("tpu", "gpu")
    batch = q.shape[0]
    q_pos = jnp.broadcast_to(shear.batched_positions(q_positions), (batch, q.shape[1]))
    k_pos = jnp.broadcast_to(shear.batched_positions(k_positions), (batch, k.shape[1]))
    if q_segments is None:
        q_seg = jnp.zeros(q_pos.shape, jnp.int32)
        k_seg = jnp.zeros(k_pos.shape, jnp.int32)
    else:
        q_seg = jnp.broadcast_to(shear.batched_positions(q_segments), q_pos.shape)
        k_seg = jnp.broadcast_to(shear.batched_positions(k_segments), k_pos.shape)
    settings = (enc, block_size, bool(interpret))
    attend = split_over_batch(
        functools.partial(_attend, settings), batch, batched=(False, *[True] * 7)
    )
    return attend(params, q, k, v, q_pos, k_pos, q_seg, k_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg):
    return _attend_forward(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg)[0]


def _attend_forward(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg):
    layout = _Layout.of(settings, q, k)
    rows = layout.rows(q_pos, k_pos, q_seg, k_seg)
    terms, gammas = _kernel_terms(layout, rows, params, q, k)
    inputs = layout.inputs(terms, gammas, _omegas(layout, params), v)
    outputs = [(layout.head_dim, v.dtype), (1, jnp.float32)]  # out, each query's logsumexp
    out, lse = _call(_forward_kernel, layout, rows, inputs, outputs)
    result = jnp.transpose(out, (0, 2, 1, 3))[:, : layout.length]
    return result, (params, q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse)


def _attend_backward(settings, residuals, d_out):
    """The flash backward: recomputed probabilities, a dK/dV and a dQ kernel, then the maps' VJP."""
    params, q, k, v, q_pos, k_pos, q_seg, k_seg, out, lse = residuals
    layout = _Layout.of(settings, q, k)
    rows = layout.rows(q_pos, k_pos, q_seg, k_seg)
    (terms, gammas), pullback = jax.vjp(
        lambda params, q, k: _kernel_terms(layout, rows, params, q, k), params, q, k
    )
    inputs = layout.inputs(terms, gammas, _omegas(layout, params), v)
    d_out = jnp.transpose(_pad_rows(d_out.astype(v.dtype), layout.q_len, 0), (0, 2, 1, 3))
    # delta_i = sum_j p_ij dp_ij = dO_i . O_i: the softmax's backward without the T x S array.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), -1, keepdims=True)
    # Per term, the cotangents of the key halves (re, im), then dv; of the query halves.
    halves = [(x.shape[-1], jnp.float32) for x in inputs.terms[::4] for _ in "ri"]
    cotangents = (d_out, lse, delta)
    outputs = [*halves, (layout.head_dim, jnp.float32)]
    *d_keys, d_v = _call(
        _key_gradients_kernel, layout, rows, inputs, outputs, *cotangents, per_key=True
    )
    d_queries = _call(_query_gradients_kernel, layout, rows, inputs, halves, *cotangents)
    d_terms = []
    for r in range(layout.num_terms):
        d_terms += [*d_queries[2 * r : 2 * r + 2], *d_keys[2 * r : 2 * r + 2]]
    d_gammas = _gamma_gradients(layout, rows, inputs.terms, d_terms)
    d_params, d_q, d_k = pullback((d_terms, d_gammas))
    d_v = jnp.transpose(d_v, (0, 2, 1, 3))[:, : layout.key_length]
    d_params = jax.tree.map(lambda g, p: g.astype(p.dtype), d_params, params)
    return (d_params, d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), *[None] * 4)


_attend.defvjp(_attend_forward, _attend_backward)


class _Rows(NamedTuple):
    """Padded positions, segments and row coordinates (jrope.attention.packing): int32
    q_pos, q_seg, q_coord [B, Tp, 1]; k_pos, k_seg, k_coord [B, 1, Sp]."""

    q_pos: jax.Array
    k_pos: jax.Array
    q_seg: jax.Array
    k_seg: jax.Array
    q_coord: jax.Array
    k_coord: jax.Array


class _Inputs(NamedTuple):
    """The kernels' operands: per term (q re, q im, k re, k im) [B, N, Tp|Sp, d] in the inputs'
    dtype, per term (gamma [N, 1, d], omega [N, 1, d]), and v [B, N, Sp, H]."""

    terms: list
    rates: list
    v: jax.Array


class _Layout(NamedTuple):
    """The static shape of one call: lengths, their padded blocks, the term count, the time."""

    enc: Any
    interpret: bool
    batch: int
    length: int
    heads: int
    head_dim: int
    key_length: int
    bq: int
    bk: int
    q_len: int
    k_len: int
    dtype: Any

    @classmethod
    def of(cls, settings, q, k):
        enc, block_size, interpret = settings
        length, key_length = q.shape[1], k.shape[1]
        bq, bk = min(block_size, length), min(block_size, key_length)
        padded = -(-length // bq) * bq, -(-key_length // bk) * bk
        return cls(enc, interpret, *q.shape, key_length, bq, bk, *padded, q.dtype)

    def rows(self, q_pos, k_pos, q_seg, k_seg) -> _Rows:
        # Padded queries and keys: positions repeat the last, and segments that
        # match nothing (-2 for queries, -1 for keys) keep padded keys invisible.
        k_coord = packing.row_coordinates(k_pos, k_seg)
        return _Rows(
            _pad_rows(q_pos, self.q_len)[:, :, None],
            _pad_rows(k_pos, self.k_len)[:, None, :],
            _pad_rows(q_seg, self.q_len, -2)[:, :, None],
            _pad_rows(k_seg, self.k_len, -1)[:, None, :],
            _pad_rows(k_coord[:, self.key_offset :], self.q_len)[:, :, None],
            _pad_rows(k_coord, self.k_len)[:, None, :],
        )

    def inputs(self, terms, gammas, omegas, v) -> _Inputs:
        rates = [
            pair for gamma, omega in zip(gammas, omegas, strict=True) for pair in (gamma, omega)
        ]
        v = jnp.transpose(_pad_rows(v, self.k_len, 0), (0, 2, 1, 3))
        # The shifted terms (r >= 1) stay float32: the kernels split them (shear.term_dot).
        return _Inputs(
            [x.astype(self.dtype if i < 4 else x.dtype) for i, x in enumerate(terms)], rates, v
        )

    @property
    def key_offset(self) -> int:
        return self.key_length - self.length

    @property
    def compiler_params(self):
        # On GPUs, Triton (Pallas' default there is Mosaic GPU, which wants other block shapes).
        return pltriton.CompilerParams() if jax.default_backend() == "gpu" else None

    @property
    def num_terms(self) -> int:
        return self.enc.shear_order


def _kernel_terms(layout, rows, params, q, k):
    """The term halves (float32 [B, N, Tp|Sp, d], q re, q im, k re, k im per term) and each term's
    gamma [N, 1, d]: the differentiable map from (params, q, k) to the kernels' operands."""
    q_pos, k_pos = rows.q_pos[:, :, 0], rows.k_pos[:, 0, :]
    q_coord, k_coord = rows.q_coord[:, :, 0], rows.k_coord[:, 0, :]
    padded = _pad_rows(q, layout.q_len, 0), _pad_rows(k, layout.k_len, 0)
    origins = _block_origins(q_pos, q_coord, layout.bq), _block_origins(k_pos, k_coord, layout.bk)
    terms = shear.shear_terms(layout.enc, params, *padded, q_pos, k_pos, *origins)
    halves = []
    for q_r, k_r in zip(terms.queries, terms.keys, strict=True):
        halves += [*_halves(q_r), *_halves(k_r)]
    gammas = [gamma[:, None, :] for gamma, _ in layout.enc.term_rates(params)]
    return halves, gammas


def _omegas(layout, params):
    return [
        jnp.broadcast_to(omega, (layout.heads, 1, omega.shape[-1]))
        for _, omega in layout.enc.term_rates(params)
    ]


def _gamma_gradients(layout, rows, terms, d_terms):
    """Each term's gamma cotangent [N, 1, d] from the key blocks' move inside the kernels
    (the module docstring's formula, with the dq, dk the kernels return).

    The coordinates are taken relative to the query row's first so the two sums
    stay small at any offset.
    """
    first = rows.q_coord[:, :1, :1]
    q_origin = _block_firsts(rows.q_coord[:, :, 0], layout.bq)[:, :, None] - first
    k_origin = _block_firsts(rows.k_coord[:, 0, :], layout.bk)[:, :, None] - first
    q_origin, k_origin = q_origin[:, None], k_origin[:, None]  # [B, 1, Tp|Sp, 1]
    gradients = []
    for r in range(layout.num_terms):
        total = 0.0
        for index in range(4):
            origin = q_origin if index < 2 else k_origin
            sign = -1.0 if index < 2 else 1.0
            products = terms[4 * r + index].astype(jnp.float32) * d_terms[4 * r + index]
            total = total + sign * jnp.sum(origin.astype(jnp.float32) * products, (0, 2))
        gradients.append(total[:, None, :])
    return gradients


def _pad_rows(x, padded, value=None):
    """Pads axis 1 of x to `padded` (edge values, or `value`)."""
    extra = padded - x.shape[1]
    if not extra:
        return x
    widths = [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)
    if value is None:
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _block_firsts(coords, block):
    """Each index's block's first coordinate, int32 [B, L] (L a multiple of block)."""
    return jnp.repeat(coords[:, ::block], block, axis=1)


def _block_origins(positions, coords, block):
    """Each index's origin, int32 [B, L] (L a multiple of block): its block's first coordinate
    translated into its own segment's positions (jrope.attention.blocks.block_origin)."""
    return _block_firsts(coords, block) - (coords - positions)


def _halves(x):
    """[B, L, N, 2d] interleaved (re, im) -> re, im each [B, N, L, d]."""
    x = x.reshape(x.shape[:-1] + (-1, 2))
    return [jnp.transpose(x[..., part], (0, 2, 1, 3)) for part in (0, 1)]


def _time_lag(time, i, j):
    """s(i) - s(j) over eta, float32 [bq, bk], for int32 positions i [bq, 1], j [1, bk]; None
    without a shear (one term: no weight)."""
    return None if time is None else time.lag(i, j)


def _kernel_args(layout):
    common = dict(num_terms=layout.num_terms, time=layout.enc.shear_time, dtype=layout.dtype)
    scale = 1.0 / math.sqrt(layout.head_dim)
    return dict(common, block=(layout.bq, layout.bk), key_offset=layout.key_offset, scale=scale)


def _call(kernel, layout, rows, inputs, outputs, *cotangents, per_key=False):
    """Runs `kernel` per (batch row, head, block): a query block, or a key block (per_key); that
    side's operands come a block at a time, the other side's whole. outputs: (width, dtype) of
    each [B, N, Tp|Sp, width] output; cotangents: dO, logsumexp and delta, if the kernel takes them.
    """
    q_size, k_size = (layout.q_len, layout.bk) if per_key else (layout.bq, layout.k_len)
    q_at = (lambda i: 0) if per_key else (lambda i: i)  # noqa: E731
    k_at = (lambda i: i) if per_key else (lambda i: 0)  # noqa: E731

    def q_side(width):
        return pl.BlockSpec((1, 1, q_size, width), lambda b, n, i: (b, n, q_at(i), 0))

    def k_side(width):
        return pl.BlockSpec((1, 1, k_size, width), lambda b, n, i: (b, n, k_at(i), 0))

    row_specs = [
        pl.BlockSpec((1, q_size, 1), lambda b, n, i: (b, q_at(i), 0)),
        pl.BlockSpec((1, 1, k_size), lambda b, n, i: (b, 0, k_at(i))),
    ]
    in_specs = 3 * row_specs
    in_specs += [
        (q_side if index % 4 < 2 else k_side)(x.shape[-1]) for index, x in enumerate(inputs.terms)
    ]
    in_specs += [pl.BlockSpec((1, 1, x.shape[-1]), lambda b, n, i: (n, 0, 0)) for x in inputs.rates]
    in_specs.append(k_side(layout.head_dim))
    if cotangents:  # dO, logsumexp, delta
        in_specs += [q_side(layout.head_dim), q_side(1), q_side(1)]
    size, length = (layout.bk, layout.k_len) if per_key else (layout.bq, layout.q_len)
    this_block = lambda b, n, i: (b, n, i, 0)  # noqa: E731
    shape = (layout.batch, layout.heads, length)
    return pl.pallas_call(
        functools.partial(kernel, **_kernel_args(layout)),
        grid=(layout.batch, layout.heads, length // size),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((1, 1, size, width), this_block) for width, _ in outputs],
        out_shape=[jax.ShapeDtypeStruct(shape + (width,), dtype) for width, dtype in outputs],
        interpret=layout.interpret,
        compiler_params=layout.compiler_params,
    )(*rows, *inputs.terms, *inputs.rates, inputs.v, *cotangents)


def _rotations(rate_refs, moved_by, num_terms):
    """Per term, the move of a key block's pairs by moved_by = o_k - o: (cos, sin) float32 [1, d]."""
    rotations = []
    for r in range(num_terms):
        gamma, omega = rate_refs[2 * r][0], rate_refs[2 * r + 1][0]  # [1, d]
        decay = jnp.exp(gamma * moved_by)
        rotations.append((decay * jnp.cos(omega * moved_by), decay * jnp.sin(omega * moved_by)))
    return rotations


def _move(keys, rotations):
    """k' = e^{gamma d} R(-omega d) k per pair: keys [(re, im) float32 [bk, d]] -> the same, moved."""
    return [
        (cos * re + sin * im, cos * im - sin * re)
        for (re, im), (cos, sin) in zip(keys, rotations, strict=True)
    ]


def _logits(queries, moved, time_lag, scale, dtype):
    """sum_r time_lag^r (q_r . k'_r) * scale, float32 [bq, bk], by Horner in the lag; the dots
    in `dtype`, the shifted terms' split (shear.term_dot)."""
    logits = None
    for r in reversed(range(len(queries))):
        (q_re, q_im), (k_re, k_im) = queries[r], moved[r]
        dot = shear.term_dot(_dot_t, q_re, k_re, dtype, shifted=r > 0)
        dot = dot + shear.term_dot(_dot_t, q_im, k_im, dtype, shifted=r > 0)
        logits = dot if logits is None else logits * time_lag + dot
    return logits * scale


def _visible(q_pos, k_pos, q_seg, k_seg):
    """Key j visible to query i: not after it, in its segment; [bq, 1] x [1, bk] -> bool [bq, bk]."""
    return (k_pos <= q_pos) & (k_seg == q_seg)


def _score_cotangents(queries, moved, time_lag, visible, lse, delta, d_out, values, scale, dtype):
    """p [bq, bk] and, per term r, time_lag^r scale p (dO v^T - delta): the term dots' cotangents."""
    logits = jnp.where(visible, _logits(queries, moved, time_lag, scale, dtype), MASK_VALUE)
    probs = jnp.where(visible, jnp.exp(logits - lse), 0.0)
    d_scores = probs * (_dot_t(d_out, values) - delta) * scale
    per_term = [d_scores]
    for _ in queries[1:]:
        per_term.append(per_term[-1] * time_lag)
    return probs, per_term


def _forward_kernel(*refs, num_terms, time, block, key_offset, scale, dtype):
    """One (batch row, head, query block): online softmax over its key blocks."""
    rows, term_refs, rate_refs, (v_ref, out_ref, lse_ref) = _split_refs(refs, num_terms)
    bq, bk = block
    q_pos, q_seg, origin, queries = _query_block(rows, term_refs, num_terms)
    end = _key_block_end(pl.program_id(2), bq, bk, key_offset, rows.k_pos.shape[-1])

    def key_block(kb, carry):
        acc, row_max, row_sum = carry
        start = pl.multiple_of(kb * bk, bk)
        k_pos, k_seg, moved = _moved_key_block(
            rows, term_refs, rate_refs, num_terms, start, bk, origin
        )
        logits = _logits(queries, moved, _time_lag(time, q_pos, k_pos), scale, dtype)
        visible = _visible(q_pos, k_pos, q_seg, k_seg)
        logits = jnp.where(visible, logits, MASK_VALUE)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1, keepdims=True))
        correction = jnp.exp(row_max - new_max)
        probs = jnp.where(visible, jnp.exp(logits - new_max), 0.0)
        values = v_ref[0, 0, pl.ds(start, bk), :]
        acc = acc * correction + _dot(probs.astype(values.dtype), values)
        return acc, new_max, row_sum * correction + jnp.sum(probs, axis=1, keepdims=True)

    head_dim = out_ref.shape[3]
    init = (
        jnp.zeros((bq, head_dim), jnp.float32),
        jnp.full((bq, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
    )
    acc, row_max, row_sum = jax.lax.fori_loop(0, end, key_block, init)
    row_sum = jnp.maximum(row_sum, jnp.finfo(jnp.float32).tiny)
    out_ref[0, 0] = (acc / row_sum).astype(out_ref.dtype)
    lse_ref[0, 0] = row_max + jnp.log(row_sum)


def _query_gradients_kernel(*refs, num_terms, time, block, key_offset, scale, dtype):
    """One (batch row, head, query block): dq_r = sum_j time_lag^r ds k'_r over its key blocks."""
    rows, term_refs, rate_refs, rest = _split_refs(refs, num_terms)
    (v_ref, d_out_ref, lse_ref, delta_ref), d_query_refs = rest[:4], rest[4:]
    bq, bk = block
    q_pos, q_seg, origin, queries = _query_block(rows, term_refs, num_terms)
    d_out, lse, delta = d_out_ref[0, 0], lse_ref[0, 0], delta_ref[0, 0]
    end = _key_block_end(pl.program_id(2), bq, bk, key_offset, rows.k_pos.shape[-1])

    def key_block(kb, d_queries):
        start = pl.multiple_of(kb * bk, bk)
        k_pos, k_seg, moved = _moved_key_block(
            rows, term_refs, rate_refs, num_terms, start, bk, origin
        )
        lag, visible = _time_lag(time, q_pos, k_pos), _visible(q_pos, k_pos, q_seg, k_seg)
        values = v_ref[0, 0, pl.ds(start, bk), :]
        _, d_scores = _score_cotangents(
            queries, moved, lag, visible, lse, delta, d_out, values, scale, dtype
        )
        updated = []
        for r, (k_re, k_im) in enumerate(moved):
            term_dtype = queries[r][0].dtype  # float32 for the shifted terms (_Layout.inputs)
            d_score = d_scores[r].astype(term_dtype)
            updated.append(d_queries[2 * r] + _dot(d_score, k_re.astype(term_dtype)))
            updated.append(d_queries[2 * r + 1] + _dot(d_score, k_im.astype(term_dtype)))
        return updated

    init = [jnp.zeros(ref.shape[2:], jnp.float32) for ref in d_query_refs]
    d_queries = jax.lax.fori_loop(0, end, key_block, init)
    for ref, value in zip(d_query_refs, d_queries, strict=True):
        ref[0, 0] = value


def _key_gradients_kernel(*refs, num_terms, time, block, key_offset, scale, dtype):
    """One (batch row, head, key block): dk_r, dv over the query blocks that see it."""
    rows, term_refs, rate_refs, rest = _split_refs(refs, num_terms)
    (v_ref, d_out_ref, lse_ref, delta_ref), d_key_refs, d_v_ref = rest[:4], rest[4:-1], rest[-1]
    bq, bk = block
    k_pos, k_seg = rows.k_pos[0], rows.k_seg[0]  # [1, bk]
    k_origin = rows.k_coord[0, :, pl.ds(0, 1)]  # [1, 1]
    keys = _key_block(term_refs, num_terms, slice(None))
    values = v_ref[0, 0]
    # The first query block whose causal end reaches this key block (as _key_block_end).
    first = jax.lax.div(jnp.maximum(pl.program_id(2) * bk - key_offset, 0), bq)

    def query_block(qb, carry):
        d_keys, d_v = carry
        start = pl.multiple_of(qb * bq, bq)
        block_rows = pl.ds(start, bq)
        q_pos = rows.q_pos[0, block_rows, :]  # [bq, 1]
        q_seg = rows.q_seg[0, block_rows, :]
        moved_by = (k_origin - rows.q_coord[0, pl.ds(start, 1), :]).astype(jnp.float32)
        rotations = _rotations(rate_refs, moved_by, num_terms)
        queries = [
            (term_refs[4 * r][0, 0, block_rows, :], term_refs[4 * r + 1][0, 0, block_rows, :])
            for r in range(num_terms)
        ]
        d_out = d_out_ref[0, 0, block_rows, :]
        moved = _move(keys, rotations)
        lag, visible = _time_lag(time, q_pos, k_pos), _visible(q_pos, k_pos, q_seg, k_seg)
        lse, delta = lse_ref[0, 0, block_rows, :], delta_ref[0, 0, block_rows, :]
        probs, d_scores = _score_cotangents(
            queries, moved, lag, visible, lse, delta, d_out, values, scale, dtype
        )
        d_v = d_v + _dot(probs.T.astype(d_out.dtype), d_out)
        updated = []
        for r, (q_re, q_im) in enumerate(queries):
            d_score = d_scores[r].T.astype(q_re.dtype)  # [bk, bq]
            d_re, d_im = _dot(d_score, q_re), _dot(d_score, q_im)  # of the moved key
            cos, sin = rotations[r]
            updated.append(d_keys[2 * r] + cos * d_re - sin * d_im)
            updated.append(d_keys[2 * r + 1] + sin * d_re + cos * d_im)
        return updated, d_v

    init = (
        [jnp.zeros(ref.shape[2:], jnp.float32) for ref in d_key_refs],
        jnp.zeros(d_v_ref.shape[2:], jnp.float32),
    )
    d_keys, d_v = jax.lax.fori_loop(first, rows.q_pos.shape[1] // bq, query_block, init)
    for ref, value in zip(d_key_refs, d_keys, strict=True):
        ref[0, 0] = value
    d_v_ref[0, 0] = d_v


def _split_refs(refs, num_terms):
    """A kernel's refs: the _Rows refs, the term refs (q re, q im, k re, k im per term), the rate
    refs (gamma, omega per term) and the rest (v, then the kernel's own inputs and outputs)."""
    terms_end = 6 + 4 * num_terms
    rates_end = terms_end + 2 * num_terms
    return _Rows(*refs[:6]), refs[6:terms_end], refs[terms_end:rates_end], refs[rates_end:]


def _query_block(rows, term_refs, num_terms):
    """A query block's positions and segments [bq, 1], its origin o [1, 1] (loaded, as Triton
    slices no values) and per term its query halves (re, im) [bq, d]."""
    q_pos, q_seg = rows.q_pos[0], rows.q_seg[0]
    origin = rows.q_coord[0, pl.ds(0, 1), :]
    queries = [(term_refs[4 * r][0, 0], term_refs[4 * r + 1][0, 0]) for r in range(num_terms)]
    return q_pos, q_seg, origin, queries


def _moved_key_block(rows, term_refs, rate_refs, num_terms, start, bk, origin):
    """The key block at `start`: positions and segments [1, bk], and per term its key halves
    moved to the query block's origin (o_k - o)."""
    k_pos = rows.k_pos[0, :, pl.ds(start, bk)]
    k_seg = rows.k_seg[0, :, pl.ds(start, bk)]
    moved_by = (rows.k_coord[0, :, pl.ds(start, 1)] - origin).astype(jnp.float32)
    keys = _key_block(term_refs, num_terms, pl.ds(start, bk))
    return k_pos, k_seg, _move(keys, _rotations(rate_refs, moved_by, num_terms))


def _key_block_end(block, bq, bk, key_offset, k_len):
    """One past the last key block holding a key at or before query block `block`'s last index."""
    # lax.div: a nonnegative quotient, with no sign op for Mosaic to lower.
    return jnp.minimum(jax.lax.div(key_offset + (block + 1) * bq + bk - 1, bk), k_len // bk)


def _key_block(term_refs, num_terms, rows):
    """Per term, the key halves (re, im) of `rows`, float32 [bk, d]."""
    return [
        (
            term_refs[4 * r + 2][0, 0, rows, :].astype(jnp.float32),
            term_refs[4 * r + 3][0, 0, rows, :].astype(jnp.float32),
        )
        for r in range(num_terms)
    ]


def _dot(a, b):
    """a [m, c] . b [c, n] -> float32 [m, n]."""
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dot_t(a, b):
    """a [bq, d] . b [bk, d]^T -> float32 [bq, bk]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
