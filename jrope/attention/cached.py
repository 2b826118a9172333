"""Attention of a few new queries over a KV cache whose keys the encoding has already mapped.

A decode step adds one token per row: its query must see every cached key.
The cache (jrope.model.kv_cache) stores keys already mapped from its origin,
A(-(j - o)) k_j, so this kernel takes queries mapped from the same origin
and forms q2 . k2 directly: no per-key cos, sin or exp is evaluated per
step, which is what makes caching pay. The dense kernels cannot serve here:
they map raw keys themselves and mask by index, while cache slots are
masked by position (an unused slot holds a position after every query,
jrope.model.kv_cache.EMPTY).

Numerics follow jrope.attention.dense: logits and softmax in float32, a
finite mask value, the division by the row sum applied to the [B, T, N, H]
output.

Shape legend: B batch, T new queries, M cache slots, N heads, H head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jrope.attention.dense import MASK_VALUE


def cached_attention(
    q2: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    bias: jax.Array | None,
) -> jax.Array:
    """softmax(q2 . keys / sqrt(H) + bias, keys not after the query) @ values.

    Args:
      q2: [B, T, N, H] queries mapped from the cache's origin.
      keys: [B, M, N, H] keys mapped from the same origin; values: [B, M, N, H].
      q_positions: int32 [B, T]; k_positions: int32 [B, M], the position of
        each slot (key j is visible to query i iff k_positions[j] <= q_positions[i]).
      bias: None or float32 [B, N, T, M] (ALiBi, from positions).
    Returns:
      [B, T, N, H] in values' dtype.
    """
    dtype = jnp.promote_types(q2.dtype, keys.dtype)
    logits = jnp.einsum(
        "btnh,bsnh->bnts", q2.astype(dtype), keys.astype(dtype), preferred_element_type=jnp.float32
    ) * (1.0 / math.sqrt(q2.shape[-1]))
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    visible = k_positions[:, None, None, :] <= q_positions[:, None, :, None]  # [B, 1, T, M]
    logits = jnp.where(visible, logits, MASK_VALUE)
    unnormalised = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    row_sum = jnp.sum(unnormalised, axis=-1)  # [B, N, T]
    out = jnp.einsum(
        "bnts,bsnh->btnh",
        unnormalised.astype(values.dtype),
        values,
        preferred_element_type=jnp.float32,
    )
    return (out / jnp.transpose(row_sum, (0, 2, 1))[..., None]).astype(values.dtype)
