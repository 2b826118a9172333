"""Attention of a few new queries over a KV cache whose keys the encoding has already mapped.

A decode step adds one token per row: its query must see every cached key
and its own. The cache (jrope.model.kv_cache) stores keys already mapped
from its origin, A(-(j - o)) k_j, so this kernel takes queries mapped from
the same origin and forms q2 . k2 directly: no per-key cos, sin or exp is
evaluated per step, which is what makes caching pay. The dense kernels
cannot serve here: they map raw keys themselves and mask by index, while
cache slots are masked by position (an unused slot holds a position after
every query, jrope.model.kv_cache.EMPTY).

One sequence per row: the cache takes no segment ids (packed rows), see
jrope.model.kv_cache.prefill.

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
    q_positions: jax.Array,
    cached_keys: jax.Array,
    cached_values: jax.Array,
    new_keys: jax.Array,
    new_values: jax.Array,
    key_positions: jax.Array,
    bias: jax.Array | None,
    precision: jax.lax.Precision | None = None,
) -> jax.Array:
    """softmax(q2 . k2 / sqrt(H) + bias, keys not after the query) @ v over the cache and the new keys.

    The keys are the M cache slots as they were before this step, then the
    step's own T keys. The new keys come separately, not read back from the
    updated cache: with the attention reading the buffer a decode step has
    just written into, XLA:CPU gave the write two consumers and copied the
    whole buffer for each, in every layer and step.

    Args:
      q2: [B, T, N, H] queries mapped from the cache's origin.
      q_positions: int32 [B, T].
      cached_keys: [B, N, H, M] keys mapped from the same origin; cached_values:
        [B, N, M, H] (jrope.model.kv_cache's layouts, which the matmuls read
        as they lie).
      new_keys: [B, T, N, H] the new tokens' keys, mapped; new_values: [B, T, N, H].
      key_positions: int32 [B, M + T], the slots' positions then q_positions;
        key j is visible to query i iff key_positions[j] <= q_positions[i].
      bias: None or float32 [B, N, T, M + T] (ALiBi, from positions).
      precision: of the q.k and p.v dots (jrope.attention.attention_precision).
    Returns:
      [B, T, N, H] in the values' dtype.
    """
    dtype = jnp.promote_types(q2.dtype, cached_keys.dtype)
    q2 = q2.astype(dtype)
    logits = jnp.concatenate(
        [
            jnp.einsum(
                "btnh,bnhs->bnts",
                q2,
                cached_keys.astype(dtype),
                preferred_element_type=jnp.float32,
                precision=precision,
            ),
            jnp.einsum(
                "btnh,bsnh->bnts",
                q2,
                new_keys.astype(dtype),
                preferred_element_type=jnp.float32,
                precision=precision,
            ),
        ],
        axis=-1,
    ) * (1.0 / math.sqrt(q2.shape[-1]))  # [B, N, T, M + T]
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    visible = key_positions[:, None, None, :] <= q_positions[:, None, :, None]  # [B, 1, T, M + T]
    logits = jnp.where(visible, logits, MASK_VALUE)
    unnormalised = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    row_sum = jnp.sum(unnormalised, axis=-1)  # [B, N, T]
    probs = unnormalised.astype(cached_values.dtype)
    slots = cached_values.shape[2]
    out = jnp.einsum(
        "bnts,bnsh->btnh",
        probs[..., :slots],
        cached_values,
        preferred_element_type=jnp.float32,
        precision=precision,
    ) + jnp.einsum(
        "bnts,bsnh->btnh",
        probs[..., slots:],
        new_values,
        preferred_element_type=jnp.float32,
        precision=precision,
    )
    return (out / jnp.transpose(row_sum, (0, 2, 1))[..., None]).astype(cached_values.dtype)
