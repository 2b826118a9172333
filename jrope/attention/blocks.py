"""The pieces of blockwise attention that the forward and the backward pass share.

One (query block, key block) pair at a time: the block geometry (Layout),
padding and slicing along the sequence, which key blocks a query block must
visit, the encoding's maps per block (queries from the block's first
position, keys premapped once and moved per pair by the group law), a
pair's logits and mask. jrope.attention.blockwise runs them in its loops.

Packed rows (Packing) measure the origins on the row coordinates of
jrope.attention.packing instead of the positions, which restart at each
segment: a block's origin o is its first row coordinate, and each token is
mapped from o translated into its own segment's positions (a per-token
origin p - (c - o) for the token at position p and coordinate c), so the
factors stay bounded by the block's extent in coordinates as they do by its
extent in positions in a row of one sequence, and a same-segment pair reads
the same p_i - p_j.

Shape legend: B batch, T query length, S key length, N heads, H head dim,
bq / bk query / key block length.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrope.encodings import add_bias


class Packing(NamedTuple):
    """Segment ids and row coordinates of packed rows, int32, padded to whole blocks.

    q_coords, q_segments: [B, T]; k_coords, k_segments: [B, S].
    """

    q_coords: jax.Array
    k_coords: jax.Array
    q_segments: jax.Array
    k_segments: jax.Array


class Layout(NamedTuple):
    """Static settings of one call: block geometry and the dots' precision."""

    q_block: int  # rows per query block
    k_block: int  # keys per key block
    q_len: int  # T before padding
    k_len: int  # S before padding
    causal: bool
    precision: jax.lax.Precision | None = None  # of the q.k and p.v dots (None: backend default)

    @property
    def num_q_blocks(self) -> int:
        return -(-self.q_len // self.q_block)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.k_len // self.k_block)


def pad_to_blocks(x, positions, padded_len):
    """Pads the sequence axis of x [B, L, N, H] and of positions [L]/[B, L] to padded_len.

    Positions repeat the last one: padded keys are masked anyway, and a
    repeated position keeps the encoding's factors as bounded as the real ones.
    """
    extra = padded_len - x.shape[1]
    if extra:
        x = jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0)))
    return x, None if positions is None else pad_positions(positions, padded_len)


def pad_positions(positions, padded_len):
    """int32 positions (or segment ids, coordinates) [L]/[B, L], the last one repeated to padded_len."""
    extra = padded_len - positions.shape[-1]
    if extra:
        positions = jnp.pad(positions, [(0, 0)] * (positions.ndim - 1) + [(0, extra)], mode="edge")
    return positions.astype(jnp.int32)


def slice_seq(x, start, size):
    """x[..., start:start + size, (N, H)] for [B, L, N, H] arrays or [L]/[B, L] positions."""
    axis = 1 if x.ndim == 4 else x.ndim - 1
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def key_block_ends(layout: Layout, q_positions, k_positions) -> jax.Array:
    """int32 [num_q_blocks]: one past the last key block holding a key visible to the query block.

    Packed rows pass their row coordinates: a key of the query's segment at a
    position not after the query's has a coordinate not after it either.

    A key block is needed iff its smallest (real) key position is <= the query
    block's largest position. The suffix minimum of the key blocks' smallest
    positions is non-decreasing, so the count of needed-or-earlier blocks is a
    searchsorted. Exact for any positions; with increasing positions it is the
    diagonal block. Batched positions are resolved per row, and the loop
    (shared by the batch) runs to the furthest row's end.
    """
    if not layout.causal:
        return jnp.full((layout.num_q_blocks,), layout.num_k_blocks, jnp.int32)
    q_rows = q_positions.reshape(-1, layout.num_q_blocks, layout.q_block)  # [B|1, nq, bq]
    k_rows = k_positions.reshape(-1, layout.num_k_blocks * layout.k_block)  # [B|1, S padded]
    real_key = jnp.arange(k_rows.shape[-1])[None] < layout.k_len
    key_min = jnp.where(real_key, k_rows, jnp.iinfo(jnp.int32).max)
    key_min = key_min.reshape(-1, layout.num_k_blocks, layout.k_block).min(-1)
    suffix_min = jax.lax.cummin(key_min, axis=1, reverse=True)  # [B|1, nk], non-decreasing
    query_max = q_rows.max(-1)  # [B|1, nq]
    rows = max(suffix_min.shape[0], query_max.shape[0])
    ends = jax.vmap(lambda keys, queries: jnp.searchsorted(keys, queries, side="right"))(
        jnp.broadcast_to(suffix_min, (rows, layout.num_k_blocks)),
        jnp.broadcast_to(query_max, (rows, layout.num_q_blocks)),
    )
    return ends.max(0).astype(jnp.int32)


def block_origin(positions_blk, coords_blk=None) -> jax.Array:
    """Where one block's tokens are mapped from: the first position [B|1], or per token [B, b].

    coords_blk: the block's row coordinates (packed rows), whose first one is
    the origin, translated into each token's own segment.
    """
    if coords_blk is None:
        return positions_blk[..., 0]
    return coords_blk[:, :1] - (coords_blk - positions_blk)


def transform_queries(enc, params, q_blk, qpos_blk, qcoord_blk=None) -> jax.Array:
    """q2 [B, bq, N, H] of one query block, positions measured from the block's origin."""
    origin = block_origin(qpos_blk, qcoord_blk)
    return enc.map_queries(params, q_blk, qpos_blk, origin, packed=qcoord_blk is not None)


def premap_keys(enc, params, k, k_positions, layout: Layout, k_coords=None) -> jax.Array:
    """float32 [B, S, N, H]: every key block mapped from its own origin (block_origin).

    k: [B, S, N, H] (S padded to whole blocks); k_positions: [S] or [B, S];
    k_coords: [B, S] row coordinates of packed rows, or None.
    Kept in float32: the pair map moves them again before the logits.
    """
    batch, length, heads, head_dim = k.shape
    rows = batch * layout.num_k_blocks
    blocks = k.astype(jnp.float32).reshape(rows, layout.k_block, heads, head_dim)
    positions = jnp.broadcast_to(k_positions, (batch, length)).reshape(rows, layout.k_block)
    coords = None if k_coords is None else k_coords.reshape(rows, layout.k_block)
    origin = block_origin(positions, coords)
    mapped = enc.map_keys(params, blocks, positions, origin, packed=k_coords is not None)
    return mapped.reshape(k.shape)


def pair_keys(enc, params, keys_blk, q_first, k_first, dtype) -> jax.Array:
    """The key block mapped from the query block's origin o.

    keys_blk is premapped from its own origin o_k (premap_keys) and moved
    here by o - o_k (Encoding.move_keys: one map for the whole block);
    encodings without a map (nope, ALiBi) pass it through. q_first, k_first:
    the blocks' positions, or row coordinates of packed rows ([B|1, b] or
    [b]), whose first ones are o and o_k. Returns [B, bk, N, H] in `dtype`
    (float32 when enc.keeps_float32).
    """
    if not enc.has_maps:
        return keys_blk
    shift = (q_first[..., 0] - k_first[..., 0]).reshape(-1)  # o - o_k, [B|1]
    k2 = enc.move_keys(params, keys_blk, shift)
    return k2 if enc.keeps_float32 else k2.astype(dtype)


def pair_logits(
    enc, params, q2, keys_blk, qpos_blk, kpos_blk, dtype, precision, coords=None
) -> jax.Array:
    """float32 [B, N, bq, bk] logits of one (query block, key block) pair (transform_logits
    applied), before masking.

    q2: the query block already transformed (transform_queries); keys_blk:
    the key block, raw or premapped (see pair_keys); dtype: the keys' compute
    dtype; precision: of the dot; coords: (query, key) blocks' row
    coordinates of packed rows, or None.
    """
    q_first, k_first = (qpos_blk, kpos_blk) if coords is None else coords
    k2 = pair_keys(enc, params, keys_blk, q_first, k_first, dtype)
    dtype = jnp.promote_types(q2.dtype, k2.dtype)
    logits = jnp.einsum(
        "btnh,bsnh->bnts",
        q2.astype(dtype),
        k2.astype(dtype),
        preferred_element_type=jnp.float32,
        precision=precision,
    ) / math.sqrt(q2.shape[-1])
    if enc.has_bias:
        logits = add_bias(logits, enc.logit_bias(params, qpos_blk, kpos_blk).astype(jnp.float32))
    return enc.transform_logits(params, logits)


def pair_mask(layout: Layout, k_start, qpos_blk, kpos_blk, segments=None) -> jax.Array:
    """bool [B|1, 1, bq, bk]: real keys, (if causal) keys not after the query, and of its segment.

    segments: None, or the (query, key) blocks' segment ids, int32 [B, bq] and [B, bk].
    """
    real_key = (k_start + jnp.arange(layout.k_block)) < layout.k_len
    mask = real_key[None, None, None, :]
    if layout.causal:
        visible = kpos_blk[..., None, :] <= qpos_blk[..., :, None]  # [bq, bk] or [B, bq, bk]
        visible = visible[None, None] if visible.ndim == 2 else visible[:, None]
        mask = mask & visible
    if segments is not None:
        q_segments, k_segments = segments
        mask = mask & (q_segments[:, None, :, None] == k_segments[:, None, None, :])
    return mask


def add_to_slice(total, update, start):
    """total[:, start:start + len] += update along the sequence axis, in place inside the loop."""
    current = jax.lax.dynamic_slice_in_dim(total, start, update.shape[1], axis=1)
    return jax.lax.dynamic_update_slice_in_dim(
        total, current + update.astype(total.dtype), start, axis=1
    )
