"""Memory-efficient attention by blocks, with the positional encoding applied per block.

The logits are never materialised as a T x S matrix: queries are taken one
block at a time, and for each query block the key blocks are folded in with
an online softmax (running row maximum, running row sum, rescaled output
accumulator, as in flash attention). The positional encoding runs inside the
loops, per block, with the origin o = the query block's first position:

    q2 = enc.map_queries(params, q_blk, qpos_blk, origin=o)        once per query block
    k2 = enc.move_keys(params, premapped_k_blk, o - o_k)           per (query, key) block pair
    logits = q2 . k2 / sqrt(H) + enc.logit_bias(params, qpos_blk, kpos_blk)

The keys are mapped once, each block from its own first position o_k
(enc.map_keys), and moved per pair to o by the group law,
A(-(j - o)) = A(o - o_k) A(-(j - o_k)): one map per block, so no
per-position cos, sin or exp is evaluated in the loop. With o inside the
block, the damping factors stay within e^{gamma (block - 1)} at any absolute
position (docs/numerics.md, section 2); ALiBi's bias is computed per block.

Causality is decided by positions (key j is visible to query i iff
k_positions[j] <= q_positions[i]), and each query block visits only the key
blocks up to the last one it can see (a dynamic trip count). Packed rows
(segment ids) add the segment to the mask and take block origins and the key
blocks a query block needs on the rows' coordinates (jrope.attention.packing),
which never go down. Lengths that are not multiples of the block size are
padded (positions by repeating the last one) and the padded keys masked. A
query that sees no key gets a zero output.

Memory is linear in T and S: a custom VJP saves only q, k, v, the output and
the float32 log-sum-exp, and the backward pass recomputes each pair's logits,
pulling their cotangent back through the encoding with jax.vjp (autodiff of
the loop would keep a b x b probability block per pair, and cannot
differentiate a dynamic trip count). No forward-mode differentiation.
Statistics, softmax and accumulators are float32; the q.k and p.v dots run at
the precision passed in (jrope.attention.precision).

Shape legend: B batch, T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jrope.attention import blocks, packing, shear
from jrope.attention.dense import MASK_VALUE


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    enc: Any,
    params: dict[str, jax.Array],
    q_positions: jax.Array,
    k_positions: jax.Array,
    block_size: int,
    causal: bool = True,
    precision: jax.lax.Precision | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """softmax(logits + mask) @ v, by blocks, with the encoding applied per block.

    Args:
      q: [B, T, N, H]; k, v: [B, S, N, H]; raw (not yet position-encoded).
      enc: a jrope Encoding; params: its parameters (may be empty).
      q_positions: int [T] or [B, T]; k_positions: int [S] or [B, S].
      block_size: rows per query block and keys per key block, clamped to T and S.
      causal: mask keys whose position exceeds the query's position.
      precision: of the q.k and p.v dots (jrope.attention.precision).
      segment_ids: optional int32 [B, S] of packed rows (jrope.attention.packing):
        the queries are then the last T keys.

    Returns:
      [B, T, N, H] in v's dtype. Differentiable (reverse mode) in q, k, v and params.
    """
    q_positions, k_positions = jnp.asarray(q_positions), jnp.asarray(k_positions)
    _check_inputs(q, k, v, q_positions, k_positions, block_size)
    q_len, k_len = q.shape[1], k.shape[1]
    q_block, k_block = min(block_size, q_len), min(block_size, k_len)
    layout = blocks.Layout(q_block, k_block, q_len, k_len, bool(causal), precision)
    q_padded, k_padded = layout.num_q_blocks * layout.q_block, layout.num_k_blocks * layout.k_block
    rows = None
    if segment_ids is not None:
        packing.check_segments(k_positions, segment_ids, k.shape[0], k_len)
        k_positions = jnp.broadcast_to(k_positions, segment_ids.shape)
        q_positions = jnp.broadcast_to(q_positions, (q.shape[0], q_len))
        k_coords = packing.row_coordinates(k_positions, segment_ids)
        queries = slice(k_len - q_len, k_len)
        rows = blocks.Packing(
            blocks.pad_positions(k_coords[:, queries], q_padded),
            blocks.pad_positions(k_coords, k_padded),
            blocks.pad_positions(segment_ids[:, queries], q_padded),
            blocks.pad_positions(segment_ids, k_padded),
        )
    q, q_positions = blocks.pad_to_blocks(q, q_positions, q_padded)
    k, k_positions = blocks.pad_to_blocks(k, k_positions, k_padded)
    v, _ = blocks.pad_to_blocks(v, None, k_padded)
    out = _attend(enc, layout, params, q, k, v, q_positions, k_positions, rows)
    return out[:, :q_len]


def _check_inputs(q, k, v, q_positions, k_positions, block_size) -> None:
    shear.check_shapes(q, k, v)
    if block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}.")
    for name, positions, length in (
        ("q_positions", q_positions, q.shape[1]),
        ("k_positions", k_positions, k.shape[1]),
    ):
        if positions.shape not in ((length,), (q.shape[0], length)):
            raise ValueError(
                f"{name} must have shape [{length}] or [{q.shape[0]}, {length}] "
                f"(sequence length, optionally batch first); got {positions.shape}."
            )
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(
                f"{name} must be integer positions; got dtype {positions.dtype}. "
                f"Pass e.g. jnp.arange(T, dtype=jnp.int32)."
            )


def _key_block_ends(layout: blocks.Layout, q_positions, k_positions, rows):
    if rows is None:
        return blocks.key_block_ends(layout, q_positions, k_positions)
    return blocks.key_block_ends(layout, rows.q_coords, rows.k_coords)


def _query_rows(rows, q_start, bq):
    """The query block's (coordinates, segment ids), or (None, None) for rows of one sequence."""
    if rows is None:
        return None, None
    coords = blocks.slice_seq(rows.q_coords, q_start, bq)
    return coords, blocks.slice_seq(rows.q_segments, q_start, bq)


def _pair_rows(rows, qcoord_blk, qseg_blk, k_start, bk):
    """(coords, segments) of a block pair for pair_logits and pair_mask, or (None, None)."""
    if rows is None:
        return None, None
    return (
        (qcoord_blk, blocks.slice_seq(rows.k_coords, k_start, bk)),
        (qseg_blk, blocks.slice_seq(rows.k_segments, k_start, bk)),
    )


def _premapped_keys(enc, params, k, k_positions, layout, rows):
    k_coords = None if rows is None else rows.k_coords
    return blocks.premap_keys(enc, params, k, k_positions, layout, k_coords)


def _forward(enc, layout: blocks.Layout, params, q, k, v, q_positions, k_positions, rows):
    """Returns the output [B, T, N, H] (v's dtype) and the log-sum-exp float32 [B, N, T] (padded T).

    rows: blocks.Packing of packed rows, or None.
    """
    bq, bk = layout.q_block, layout.k_block
    batch, _, heads, head_dim = q.shape
    ends = _key_block_ends(layout, q_positions, k_positions, rows)
    keys = _premapped_keys(enc, params, k, k_positions, layout, rows) if enc.has_maps else k

    def query_block(qb):
        q_start = qb * bq
        qpos_blk = blocks.slice_seq(q_positions, q_start, bq)
        qcoord_blk, qseg_blk = _query_rows(rows, q_start, bq)
        q2 = blocks.transform_queries(
            enc, params, blocks.slice_seq(q, q_start, bq), qpos_blk, qcoord_blk
        )

        def key_block(kb, carry):
            acc, row_max, row_sum = carry  # [B, N, bq, H], [B, N, bq], [B, N, bq]
            k_start = kb * bk
            kpos_blk = blocks.slice_seq(k_positions, k_start, bk)
            keys_blk = blocks.slice_seq(keys, k_start, bk)
            coords, segments = _pair_rows(rows, qcoord_blk, qseg_blk, k_start, bk)
            logits = blocks.pair_logits(
                enc, params, q2, keys_blk, qpos_blk, kpos_blk, k.dtype, layout.precision, coords
            )
            mask = blocks.pair_mask(layout, k_start, qpos_blk, kpos_blk, segments)
            logits = jnp.where(mask, logits, MASK_VALUE)
            new_max = jnp.maximum(row_max, logits.max(-1))
            correction = jnp.exp(row_max - new_max)
            probs = jnp.where(mask, jnp.exp(logits - new_max[..., None]), 0.0)
            v_blk = blocks.slice_seq(v, k_start, bk)
            acc = acc * correction[..., None] + jnp.einsum(
                "bnts,bsnh->bnth",
                probs.astype(v.dtype),
                v_blk,
                preferred_element_type=jnp.float32,
                precision=layout.precision,
            )
            return acc, new_max, row_sum * correction + probs.sum(-1)

        init = (
            jnp.zeros((batch, heads, bq, head_dim), jnp.float32),
            jnp.full((batch, heads, bq), MASK_VALUE, jnp.float32),
            jnp.zeros((batch, heads, bq), jnp.float32),
        )
        acc, row_max, row_sum = jax.lax.fori_loop(0, ends[qb], key_block, init)
        # A row with no visible key has row_sum 0 and acc 0: output 0, finite lse.
        row_sum = jnp.maximum(row_sum, jnp.finfo(jnp.float32).tiny)
        out_blk = (acc / row_sum[..., None]).astype(v.dtype).transpose(0, 2, 1, 3)
        return out_blk, row_max + jnp.log(row_sum)

    out, lse = jax.lax.map(query_block, jnp.arange(layout.num_q_blocks))
    # out [nq, B, bq, N, H] -> [B, T, N, H]; lse [nq, B, N, bq] -> [B, N, T] (T padded).
    out = jnp.moveaxis(out, 0, 1).reshape((batch, -1) + v.shape[2:])
    lse = jnp.moveaxis(lse, 0, 2).reshape(batch, heads, -1)
    return out, lse


def _backward(enc, layout: blocks.Layout, residuals, d_out):
    """Cotangents of (params, q, k, v, q_positions, k_positions, rows), recomputing each pair's logits."""
    params, q, k, v, q_positions, k_positions, rows, out, lse = residuals
    bq, bk = layout.q_block, layout.k_block
    ends = _key_block_ends(layout, q_positions, k_positions, rows)
    d_out = d_out.astype(jnp.float32)
    # delta_i = sum_j P_ij dP_ij = dO_i . O_i: the softmax backward's row term.
    delta = jnp.einsum("btnh,btnh->bnt", d_out, out.astype(jnp.float32), precision=layout.precision)
    if enc.has_maps:
        # dk collects the premapped keys' cotangent, pulled back through the premap once.
        keys, keys_pullback = jax.vjp(
            lambda p, kk: _premapped_keys(enc, p, kk, k_positions, layout, rows), params, k
        )
    else:
        keys, keys_pullback = k, None

    def query_block(qb, carry):
        dq, dk, dv, dparams = carry
        q_start = qb * bq
        qpos_blk = blocks.slice_seq(q_positions, q_start, bq)
        qcoord_blk, qseg_blk = _query_rows(rows, q_start, bq)
        # The query map is shared by all of this block's pairs: its cotangent is
        # summed over the key loop and pulled back (to q and params) once.
        q2, q_pullback = jax.vjp(
            lambda p, qq: blocks.transform_queries(enc, p, qq, qpos_blk, qcoord_blk),
            params,
            blocks.slice_seq(q, q_start, bq),
        )
        d_out_blk = blocks.slice_seq(d_out, q_start, bq)
        lse_blk = jax.lax.dynamic_slice_in_dim(lse, q_start, bq, axis=2)
        delta_blk = jax.lax.dynamic_slice_in_dim(delta, q_start, bq, axis=2)

        def key_block(kb, inner):
            dq2, dk, dv, dparams = inner
            k_start = kb * bk
            kpos_blk = blocks.slice_seq(k_positions, k_start, bk)
            coords, segments = _pair_rows(rows, qcoord_blk, qseg_blk, k_start, bk)
            pair = (qpos_blk, kpos_blk, k.dtype, layout.precision, coords)
            logits_of = lambda p, qq, kk: blocks.pair_logits(enc, p, qq, kk, *pair)  # noqa: E731
            keys_blk = blocks.slice_seq(keys, k_start, bk)
            logits, pullback = jax.vjp(logits_of, params, q2, keys_blk)
            mask = blocks.pair_mask(layout, k_start, qpos_blk, kpos_blk, segments)
            probs = jnp.where(mask, jnp.exp(logits - lse_blk[..., None]), 0.0)
            v_blk = blocks.slice_seq(v, k_start, bk).astype(jnp.float32)
            d_probs = jnp.einsum("btnh,bsnh->bnts", d_out_blk, v_blk, precision=layout.precision)
            d_logits = probs * (d_probs - delta_blk[..., None])
            d_params_pair, dq2_pair, dk_pair = pullback(d_logits)
            dv_pair = jnp.einsum("bnts,btnh->bsnh", probs, d_out_blk, precision=layout.precision)
            dk = blocks.add_to_slice(dk, dk_pair, k_start)
            dv = blocks.add_to_slice(dv, dv_pair, k_start)
            dparams = jax.tree.map(
                lambda acc, g: acc + g.astype(jnp.float32), dparams, d_params_pair
            )
            return dq2 + dq2_pair.astype(jnp.float32), dk, dv, dparams

        dq2 = jnp.zeros(q2.shape, jnp.float32)
        dq2, dk, dv, dparams = jax.lax.fori_loop(0, ends[qb], key_block, (dq2, dk, dv, dparams))
        d_params_q, dq_blk = q_pullback(dq2.astype(q2.dtype))
        dparams = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), dparams, d_params_q)
        dq = jax.lax.dynamic_update_slice_in_dim(dq, dq_blk.astype(jnp.float32), q_start, axis=1)
        return dq, dk, dv, dparams

    init = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.zeros(k.shape, jnp.float32),
        jnp.zeros(v.shape, jnp.float32),
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
    )
    dq, dk, dv, dparams = jax.lax.fori_loop(0, layout.num_q_blocks, query_block, init)
    if keys_pullback is not None:
        d_params_keys, dk = keys_pullback(dk.astype(keys.dtype))
        dparams = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), dparams, d_params_keys)
    dparams = jax.tree.map(lambda g, p: g.astype(p.dtype), dparams, params)
    return dparams, dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(enc, layout: blocks.Layout, params, q, k, v, q_positions, k_positions, rows):
    """[B, T_padded, N, H] with a memory-linear VJP; rows: blocks.Packing of packed rows, or None."""
    return _forward(enc, layout, params, q, k, v, q_positions, k_positions, rows)[0]


def _attend_forward(enc, layout, params, q, k, v, q_positions, k_positions, rows):
    out, lse = _forward(enc, layout, params, q, k, v, q_positions, k_positions, rows)
    return out, (params, q, k, v, q_positions, k_positions, rows, out, lse)


_attend.defvjp(_attend_forward, _backward)
