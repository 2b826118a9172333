"""Attention of a few new queries over a KV cache whose keys the encoding has already mapped.

A decode step adds one token per row: its query must see every cached key
and its own. The cache (jrope.model.kv_cache) stores keys already mapped
from its origin, A(-(j - o)) k_j, so this kernel forms q2 . k2 of queries
mapped from the same origin directly, with no per-key cos, sin or exp per
step. Slots are masked by position (an unused slot holds a position after
every query, jrope.model.kv_cache.EMPTY). One sequence per row: no segment ids.

Keys may also come as the shear kernels' terms (jrope.attention.shear), side
by side: the score is then sum_r lag^r (q_r . k_r), the lag formed exactly
from the positions. Numerics follow jrope.attention.dense.

Shape legend: B batch, T new queries, M cache slots, N heads, H head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jrope.attention.dense import MASK_VALUE
from jrope.attention.shear import combine_terms


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
    term_widths: tuple[int, ...] | None = None,
    time_lag: jax.Array | None = None,
    transform=None,
) -> jax.Array:
    """softmax(q2 . k2 / sqrt(H) + bias, keys not after the query) @ v over the cache and the new keys.

    The keys are the M cache slots as they were before this step, then the
    step's own T keys, passed separately so that XLA:CPU does not copy the
    buffer (docs/performance.md, "The decode step's cache layout").

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
      term_widths: the widths d_r of the shear terms along q2's and the keys'
        last axis, in order (default: one term, the whole axis).
      time_lag: float32 [B, T, M + T], the shear's time(i) - time(j) per pair
        (jrope.attention.shear.pair_time_lag); needed for more than one term.
      transform: None, or the encoding's map of the logits (Encoding.transform_logits).
    Returns:
      [B, T, N, H] in the values' dtype.
    """
    dtype = jnp.promote_types(q2.dtype, cached_keys.dtype)
    q2 = q2.astype(dtype)
    widths = term_widths or (q2.shape[-1],)
    splits = [int(x) for x in np.cumsum(widths)[:-1]]

    def terms(x, axis):  # x's term slices along `axis`
        return jnp.split(x, splits, axis) if splits else [x]

    einsum = functools.partial(jnp.einsum, preferred_element_type=jnp.float32, precision=precision)
    visible = key_positions[:, None, None, :] <= q_positions[:, None, :, None]  # [B, 1, T, M + T]
    dots = [
        jnp.concatenate(
            [
                einsum("btnh,bnhs->bnts", q_r, cached_r.astype(dtype)),
                einsum("btnh,bsnh->bnts", q_r, new_r.astype(dtype)),
            ],
            axis=-1,
        )  # [B, N, T, M + T]
        for q_r, cached_r, new_r in zip(
            terms(q2, -1), terms(cached_keys, 2), terms(new_keys, -1), strict=True
        )
    ]
    if len(dots) > 1:
        # Empty slots' positions (kv_cache.EMPTY) would give huge lags: zeroed, as they are masked.
        time_lag = jnp.where(visible, time_lag[:, None], 0.0)
    head_dim = cached_values.shape[-1]
    logits = combine_terms(dots, time_lag) * (1.0 / math.sqrt(head_dim))  # [B, N, T, M + T]
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if transform is not None:
        logits = transform(logits)
    logits = jnp.where(visible, logits, MASK_VALUE)
    unnormalised = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    row_sum = jnp.sum(unnormalised, axis=-1)  # [B, N, T]
    probs = unnormalised.astype(cached_values.dtype)
    slots = cached_values.shape[2]
    out = einsum("bnts,bnsh->btnh", probs[..., :slots], cached_values)
    out = out + einsum("bnts,bsnh->btnh", probs[..., slots:], new_values)
    return (out / jnp.transpose(row_sum, (0, 2, 1))[..., None]).astype(cached_values.dtype)
