"""The shear-weight attention (jrope.attention.shear) as a Pallas flash kernel: memory linear in T.

One program per (batch row, head, query block) runs an online softmax over
the key blocks up to its causal end (running maximum, running sum, rescaled
accumulator), so no T x S array exists. Inside, per key block:

    k'_r  = e^{gamma d} R(-omega d) k_r          d = o_k - o: the key block's
                                                 origin moved to the query block's
    logit = sum_r (time_i - time_j)^r (q_r . k'_r) / sqrt(H)

The damped-rotated terms (jrope.attention.shear.shear_terms) are mapped once
outside the kernel, the queries from their block's first position o and the
keys from theirs o_k, as the blockwise kernel maps them: every factor stays
within e^{gamma * block} at any absolute position. Packed rows take o and
o_k on the row coordinates (jrope.attention.packing), translated into each
token's own sequence, so a block that straddles a restart stays bounded too. The move is one damped
rotation per (re, im) pair of the key block, with the pair's rates
(`term_rates`); the time-lag weight is formed per pair from the integer
positions (`pair_time_lag`'s forms). The term dots take the inputs' dtype
(bfloat16 in, float32 accumulation) at the default precision.

Each term's dims come as separate re and im arrays, so the kernel neither
slices nor shuffles lanes. Keys after a query's index in the row are never
visible to it (positions nondecreasing within a segment); packed rows pass
segment ids and a query sees its own segment only.

Gradients: a custom VJP whose backward pass recomputes attention one query
block at a time with the XLA kernel (jrope.attention.shear) and its autodiff,
summing the keys', values' and parameters' cotangents over the blocks:
memory O(block * S) instead of O(T * S); the backward pass is not a Pallas
kernel.

Shape legend: B batch, T query length, S key length, N heads, H head dim,
d the width of one term's re (or im) half, bq / bk block lengths.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jrope.attention import packing, shear
from jrope.attention.dense import MASK_VALUE

# Query and key block length: TPU lanes want multiples of 128.
BLOCK = 128


def shear_flash_problem(encoding: Any) -> str | None:
    """Why the flash kernel cannot run `encoding` (None: it can)."""
    problem = shear.shear_weight_problem(encoding)
    if problem:
        return problem
    if encoding.has_bias:
        return "the flash kernel adds no logit bias (ALiBi); the 'shear' kernel does"
    return None


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
      enc: an Encoding that shear_flash_problem accepts.
      q_positions: int32 [T] or [B, T]; k_positions: int32 [S] or [B, S].
      q_segments, k_segments: optional int32 [B, T] / [B, S] segment ids.
      block_size: query and key block length (T and S are padded to it).
      interpret: Pallas interpret mode (default: off TPU and GPU).
    Returns:
      [B, T, N, H] in v's dtype. Differentiable (reverse mode) in q, k, v, params.
    """
    problem = shear_flash_problem(enc)
    if problem:
        raise ValueError(f"shear_flash_attention: {problem}.")
    if interpret is None:
        interpret = jax.default_backend() not in ("tpu", "gpu")
    batch = q.shape[0]
    q_pos = jnp.broadcast_to(shear._batched(q_positions), (batch, q.shape[1]))
    k_pos = jnp.broadcast_to(shear._batched(k_positions), (batch, k.shape[1]))
    if q_segments is None:
        q_seg = jnp.zeros(q_pos.shape, jnp.int32)
        k_seg = jnp.zeros(k_pos.shape, jnp.int32)
    else:
        q_seg = jnp.broadcast_to(shear._batched(q_segments), q_pos.shape)
        k_seg = jnp.broadcast_to(shear._batched(k_segments), k_pos.shape)
    settings = (enc, block_size, bool(interpret))
    return _attend(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg):
    return _forward(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg)


def _attend_forward(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg):
    out = _forward(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg)
    return out, (params, q, k, v, q_pos, k_pos, q_seg, k_seg)


def _attend_backward(settings, residuals, d_out):
    """Cotangents by the XLA kernel's autodiff, one query block at a time."""
    enc, block_size, _ = settings
    params, q, k, v, q_pos, k_pos, q_seg, k_seg = residuals
    length = q.shape[1]
    block = min(block_size, length)
    blocks = -(-length // block)
    padded = blocks * block
    pad = ((0, 0), (0, padded - length))
    q_p = jnp.pad(q, pad + ((0, 0), (0, 0)))
    d_p = jnp.pad(d_out, pad + ((0, 0), (0, 0)))  # padded rows carry no cotangent
    pos_p = jnp.pad(q_pos, pad, mode="edge")
    seg_p = jnp.pad(q_seg, pad, mode="edge")

    def one_block(carry, index):
        start = index * block
        rows = [jax.lax.dynamic_slice_in_dim(x, start, block, 1) for x in (q_p, d_p, pos_p, seg_p)]
        q_blk, d_blk, pos_blk, seg_blk = rows

        def attend(params, q_blk, k, v):
            return shear.shear_attention(
                q_blk,
                k,
                v,
                enc=enc,
                params=params,
                q_positions=pos_blk,
                k_positions=k_pos,
                q_segments=seg_blk,
                k_segments=k_seg,
            )

        _, pullback = jax.vjp(attend, params, q_blk, k, v)
        d_params, d_q, d_k, d_v = pullback(d_blk.astype(v.dtype))
        total = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), carry, (d_params, d_k, d_v))
        return total, d_q

    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (params, k, v))
    (d_params, d_k, d_v), d_q = jax.lax.scan(one_block, zeros, jnp.arange(blocks))
    d_q = jnp.moveaxis(d_q, 0, 1).reshape((q.shape[0], padded) + q.shape[2:])[:, :length]
    d_params = jax.tree.map(lambda g, p: g.astype(p.dtype), d_params, params)
    return (
        d_params,
        d_q.astype(q.dtype),
        d_k.astype(k.dtype),
        d_v.astype(v.dtype),
        None,
        None,
        None,
        None,
    )


_attend.defvjp(_attend_forward, _attend_backward)


def _pad_rows(x, padded, value=None):
    """Pads axis 1 of x to `padded` (edge values, or `value`)."""
    extra = padded - x.shape[1]
    if not extra:
        return x
    widths = [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2)
    if value is None:
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _block_origins(positions, coords, block):
    """Each index's origin, int32 [B, L] (L a multiple of block): its block's first coordinate
    translated into its own segment's positions (jrope.attention.blocks.block_origin)."""
    firsts = jnp.repeat(coords[:, ::block], block, axis=1)
    return firsts - (coords - positions)


def _halves(x):
    """[B, L, N, 2d] interleaved (re, im) -> re, im each [B, N, L, d]."""
    x = x.reshape(x.shape[:-1] + (-1, 2))
    return [jnp.transpose(x[..., part], (0, 2, 1, 3)) for part in (0, 1)]


def _forward(settings, params, q, k, v, q_pos, k_pos, q_seg, k_seg):
    enc, block_size, interpret = settings
    batch, length, heads, head_dim = q.shape
    key_length = k.shape[1]
    bq, bk = min(block_size, length), min(block_size, key_length)
    q_len, k_len = -(-length // bq) * bq, -(-key_length // bk) * bk
    # Padded queries and keys: positions repeat the last, and segments that
    # match nothing (-2 for queries, -1 for keys) keep padded keys invisible.
    q_pos_p, k_pos_p = _pad_rows(q_pos, q_len), _pad_rows(k_pos, k_len)
    q_seg_p, k_seg_p = _pad_rows(q_seg, q_len, -2), _pad_rows(k_seg, k_len, -1)
    # Origins on the row coordinates, which never go down even where packed
    # positions restart (the positions themselves in a row of one sequence).
    k_coord = packing.row_coordinates(k_pos, k_seg)
    q_coord_p = _pad_rows(k_coord[:, key_length - length :], q_len)
    k_coord_p = _pad_rows(k_coord, k_len)
    q_p, k_p, v_p = _pad_rows(q, q_len, 0), _pad_rows(k, k_len, 0), _pad_rows(v, k_len, 0)
    terms = shear.shear_terms(
        enc,
        params,
        q_p,
        k_p,
        q_pos_p,
        k_pos_p,
        _block_origins(q_pos_p, q_coord_p, bq),
        _block_origins(k_pos_p, k_coord_p, bk),
    )
    dtype = q.dtype
    term_arrays, rate_arrays = [], []
    for q_r, k_r, (gamma, omega) in zip(
        terms.queries, terms.keys, shear.term_rates(enc, params), strict=True
    ):
        term_arrays += [x.astype(dtype) for x in (*_halves(q_r), *_halves(k_r))]
        rate_arrays += [gamma[:, None, :], jnp.broadcast_to(omega, (heads, 1, omega.shape[-1]))]
    cfg = enc.cfg
    time = ("raw", float(cfg.shear_scale), 0.0)
    if cfg.shear_time == "bounded":
        time = ("bounded", float(cfg.shear_scale), float(cfg.train_context))
    kernel = functools.partial(
        _kernel,
        num_terms=len(terms.queries),
        time=time,
        bk=bk,
        key_offset=key_length - length,
        scale=1.0 / math.sqrt(head_dim),
    )
    column = lambda b, n, i: (b, i, 0)  # noqa: E731
    whole_row = lambda b, n, i: (b, 0, 0)  # noqa: E731
    in_specs = [
        pl.BlockSpec((1, bq, 1), column),  # query positions [B, T, 1]
        pl.BlockSpec((1, 1, k_len), whole_row),  # key positions [B, 1, S]
        pl.BlockSpec((1, bq, 1), column),
        pl.BlockSpec((1, 1, k_len), whole_row),
        pl.BlockSpec((1, bq, 1), column),  # query coordinates
        pl.BlockSpec((1, 1, k_len), whole_row),  # key coordinates
    ]
    for index, array in enumerate(term_arrays):
        if index % 4 < 2:  # a query half: this block
            in_specs.append(pl.BlockSpec((1, 1, bq, array.shape[-1]), lambda b, n, i: (b, n, i, 0)))
        else:  # a key half: every key
            in_specs.append(
                pl.BlockSpec((1, 1, k_len, array.shape[-1]), lambda b, n, i: (b, n, 0, 0))
            )
    for array in rate_arrays:
        in_specs.append(pl.BlockSpec((1, 1, array.shape[-1]), lambda b, n, i: (n, 0, 0)))
    in_specs.append(pl.BlockSpec((1, 1, k_len, head_dim), lambda b, n, i: (b, n, 0, 0)))
    out = pl.pallas_call(
        kernel,
        grid=(batch, heads, q_len // bq),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, 1, bq, head_dim), lambda b, n, i: (b, n, i, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, heads, q_len, head_dim), v.dtype),
        interpret=interpret,
        # On GPUs, Triton (Pallas' default there is Mosaic GPU, which wants other block shapes).
        compiler_params=pltriton.CompilerParams() if jax.default_backend() == "gpu" else None,
    )(
        q_pos_p[:, :, None],
        k_pos_p[:, None, :],
        q_seg_p[:, :, None],
        k_seg_p[:, None, :],
        q_coord_p[:, :, None],
        k_coord_p[:, None, :],
        *term_arrays,
        *rate_arrays,
        jnp.transpose(v_p, (0, 2, 1, 3)),
    )
    return jnp.transpose(out, (0, 2, 1, 3))[:, :length]


def _time_lag(time, i, j):
    """time(i) - time(j) float32 for int32 positions i [bq, 1], j [1, bk] (shear.pair_time_lag)."""
    kind, shear_scale, context = time
    lag = (i - j).astype(jnp.float32)
    if kind == "raw":
        return shear_scale * lag
    fi, fj = i.astype(jnp.float32), j.astype(jnp.float32)
    # i |j| - j |i| is 0 for same signs: selected, not left to cancel (jrope.attention.shear).
    cross = jnp.where((i < 0) == (j < 0), 0.0, fi * jnp.abs(fj) - fj * jnp.abs(fi))
    numerator = context * (context * lag + cross)
    return shear_scale * numerator / ((context + jnp.abs(fi)) * (context + jnp.abs(fj)))


def _kernel(
    q_pos_ref,
    k_pos_ref,
    q_seg_ref,
    k_seg_ref,
    q_coord_ref,
    k_coord_ref,
    *refs,
    num_terms,
    time,
    bk,
    key_offset,
    scale,
):
    """One (batch row, head, query block): online softmax over its key blocks."""
    term_refs = refs[: 4 * num_terms]
    rate_refs = refs[4 * num_terms : 6 * num_terms]
    v_ref, out_ref = refs[6 * num_terms], refs[6 * num_terms + 1]
    bq = out_ref.shape[2]
    q_pos = q_pos_ref[0]  # [bq, 1]
    q_seg = q_seg_ref[0]
    origin = q_coord_ref[0, pl.ds(0, 1), :]  # [1, 1]: loaded, as Triton slices no values
    queries = [term_refs[4 * r + part][0, 0] for r in range(num_terms) for part in (0, 1)]
    block = pl.program_id(2)
    # Key blocks holding a key at or before this block's last query index.
    # (lax.div: a nonnegative quotient, with no sign op for Mosaic to lower.)
    end = jnp.minimum(
        jax.lax.div(key_offset + (block + 1) * bq + bk - 1, bk), k_pos_ref.shape[-1] // bk
    )

    def key_block(kb, carry):
        acc, row_max, row_sum = carry
        start = pl.multiple_of(kb * bk, bk)
        k_pos = k_pos_ref[0, :, pl.ds(start, bk)]  # [1, bk]
        k_seg = k_seg_ref[0, :, pl.ds(start, bk)]
        moved_by = (k_coord_ref[0, :, pl.ds(start, 1)] - origin).astype(jnp.float32)  # o_k - o
        time_lag = _time_lag(time, q_pos, k_pos)  # [bq, bk]
        logits = None
        for r in reversed(range(num_terms)):
            gamma, omega = rate_refs[2 * r][0], rate_refs[2 * r + 1][0]  # [1, d]
            decay = jnp.exp(gamma * moved_by)
            cos, sin = decay * jnp.cos(omega * moved_by), decay * jnp.sin(omega * moved_by)
            re = term_refs[4 * r + 2][0, 0, pl.ds(start, bk), :].astype(jnp.float32)
            im = term_refs[4 * r + 3][0, 0, pl.ds(start, bk), :].astype(jnp.float32)
            dtype = queries[2 * r].dtype
            key_re = (cos * re + sin * im).astype(dtype)
            key_im = (cos * im - sin * re).astype(dtype)
            dot = _dot_t(queries[2 * r], key_re) + _dot_t(queries[2 * r + 1], key_im)
            logits = dot if logits is None else logits * time_lag + dot
        logits = logits * scale
        visible = (k_pos <= q_pos) & (k_seg == q_seg)
        logits = jnp.where(visible, logits, MASK_VALUE)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1, keepdims=True))
        correction = jnp.exp(row_max - new_max)
        probs = jnp.where(visible, jnp.exp(logits - new_max), 0.0)
        values = v_ref[0, 0, pl.ds(start, bk), :]
        update = jax.lax.dot_general(
            probs.astype(values.dtype),
            values,
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        acc = acc * correction + update
        return acc, new_max, row_sum * correction + jnp.sum(probs, axis=1, keepdims=True)

    head_dim = out_ref.shape[3]
    init = (
        jnp.zeros((bq, head_dim), jnp.float32),
        jnp.full((bq, 1), MASK_VALUE, jnp.float32),
        jnp.zeros((bq, 1), jnp.float32),
    )
    acc, _, row_sum = jax.lax.fori_loop(0, end, key_block, init)
    row_sum = jnp.maximum(row_sum, jnp.finfo(jnp.float32).tiny)
    out_ref[0, 0] = (acc / row_sum).astype(out_ref.dtype)


def _dot_t(a, b):
    """a [bq, d] . b [bk, d]^T -> float32 [bq, bk]."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
