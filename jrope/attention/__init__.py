"""Causal self-attention over a positional encoding's hooks, with interchangeable kernels.

The encoding reaches attention only through its per-position maps of
queries and keys (`map_queries`, `map_keys`) and its additive bias
(`logit_bias`, ALiBi-type variants only). `choose_kernel` picks the kernel;
`causal_attention` runs it:

  xla, einsum  jrope.attention.dense: the whole T x S logits at once.
  blockwise    jrope.attention.blockwise: flash-style blocks, memory linear in
               length; it applies the encoding per block itself.

Shape legend: B batch, T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

from typing import Any

import jax

from jrope.attention.blockwise import blockwise_attention
from jrope.attention.dense import MASK_VALUE, einsum_attention, xla_attention
from jrope.attention.selection import KERNELS, choose_kernel

__all__ = ["KERNELS", "MASK_VALUE", "blockwise_attention", "causal_attention", "choose_kernel"]


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    enc: Any,
    params: dict[str, jax.Array],
    positions: jax.Array,
    kernel: str,
    block_size: int = 512,
) -> jax.Array:
    """Causal self-attention of raw (not yet position-encoded) q, k, v.

    The queries are the last T of the S key positions (T = S for a full
    sequence; T = 1 reads out the last position only).

    Args:
      q: [B, T, N, H]; k, v: [B, S, N, H], T <= S, in the compute dtype.
      enc: a jrope encoding (map_queries, map_keys, logit_bias, has_bias).
      params: the encoding's parameters for this layer.
      positions: int32 [S] or [B, S], the key positions (queries: the last T).
      kernel: one of KERNELS, as choose_kernel returns it.
      block_size: query/key block length of the blockwise kernel.
    Returns:
      [B, T, N, H] in v's dtype.
    """
    length, key_length = q.shape[1], k.shape[1]
    if length > key_length:
        raise ValueError(f"{length} queries cannot be the last rows of {key_length} keys.")
    if kernel not in KERNELS:
        raise ValueError(f"Unknown attention kernel {kernel!r}; choose one of {KERNELS}.")
    q_positions = positions[..., key_length - length :]
    if kernel == "blockwise":
        return blockwise_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            q_positions=q_positions,
            k_positions=positions,
            block_size=block_size,
        )
    # Named scopes label the compiled ops, so that profiles split encoding and kernel time.
    with jax.named_scope("encoding"):
        q, k = enc.transform_qk(params, q, k, q_positions, positions)
        bias = enc.logit_bias(params, q_positions, positions) if enc.has_bias else None
    with jax.named_scope("attention_kernel"):
        if kernel == "xla":
            return xla_attention(q, k, v)
        return einsum_attention(q, k, v, bias)
