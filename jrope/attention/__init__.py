"""Causal self-attention over a positional encoding's hooks, with interchangeable kernels.

The encoding reaches attention only through its per-position maps of
queries and keys (`map_queries`, `map_keys`; the blockwise kernel also moves
mapped keys to a block's origin with `move_keys`) and its additive bias
(`logit_bias`, ALiBi-type variants only), and a kernel that declares it applies
its map of the logits (`transform_logits`). `choose_kernel` picks the kernel;
`causal_attention` runs it:

  xla, einsum  jrope.attention.dense: the whole T x S logits at once.
  cudnn        jrope.attention.cudnn: cuDNN's fused flash attention (NVIDIA GPUs).
  splash       jrope.attention.splash: JAX's splash attention kernel (TPU).
  blockwise    jrope.attention.blockwise: flash-style blocks in pure JAX, memory
               linear in length; it applies the encoding per block itself.
  shear        jrope.attention.shear: the exponential-chain encodings as RoPE-kind
               dots with the shear as an exact per-pair weight, whole logits in
               XLA; bfloat16-safe at the backend's default precision.
  shear_flash  jrope.attention.shear_flash: the same as a Pallas flash kernel,
               memory linear in length (interpret mode off TPU and GPU).

The dots run at the precision `jrope.attention.precision` resolves. Packed
rows (segment ids, jrope.attention.packing) run on the PACKING_KERNELS: xla,
einsum, blockwise, shear and shear_flash.

Shape legend: B batch, T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jrope import encodings
from jrope.attention.blockwise import blockwise_attention
from jrope.attention.cudnn import cudnn_attention
from jrope.attention.dense import MASK_VALUE, einsum_attention, xla_attention
from jrope.attention.packing import check_segments, segment_midpoints
from jrope.attention.precision import attention_precision, matmul_precision
from jrope.attention.selection import KERNELS, PACKING_KERNELS, choose_kernel, feature_refusal
from jrope.attention.settings import AttentionSettings
from jrope.attention.shear import shear_attention
from jrope.attention.shear_flash import BLOCK as SHEAR_FLASH_BLOCK
from jrope.attention.shear_flash import shear_flash_attention
from jrope.attention.splash import splash_attention_causal
from jrope.encodings import check_positions

__all__ = [
    "KERNELS",
    "MASK_VALUE",
    "PACKING_KERNELS",
    "AttentionSettings",
    "attention_precision",
    "blockwise_attention",
    "causal_attention",
    "check_positions",
    "check_segments",
    "choose_kernel",
    "feature_refusal",
    "matmul_precision",
    "shear_attention",
    "shear_flash_attention",
]


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
    precision: jax.lax.Precision | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention of raw (not yet position-encoded) q, k, v.

    Args:
      q: [B, T, N, H]; k, v: [B, S, N, H], T <= S, in the compute dtype.
      enc: a jrope encoding (map_queries, map_keys, logit_bias, has_bias).
      params: the encoding's parameters for this layer.
      positions: int32 [S] or [B, S], the key positions (queries: the last T),
        increasing in each row and within int32 (check_positions refuses
        concrete ones that are not; under jit that is the caller's care).
      kernel: one of KERNELS, as choose_kernel returns it; one that does not compute
        every feature of `enc` (selection.KERNEL_FEATURES) is refused.
      block_size: query/key block length of the blockwise kernel.
      precision: of the q.k and p.v dots (attention_precision; None: the
        backend's default). The fused kernels run at their own.
      segment_ids: optional int32 [B, S] of packed rows (jrope.attention.packing):
        the PACKING_KERNELS take them, the others refuse (check_segments refuses
        concrete ids and positions that break its rules).
    Returns:
      [B, T, N, H] in v's dtype.
    """
    length, key_length = q.shape[1], k.shape[1]
    if length > key_length:
        raise ValueError(
            f"q holds the last T of the S key positions: T = {length} > S = {key_length}."
        )
    refusal = feature_refusal(kernel, enc)
    if refusal:
        raise ValueError(refusal[0].upper() + refusal[1:])
    if segment_ids is not None and kernel not in PACKING_KERNELS:
        raise ValueError(
            f"The {kernel!r} kernel does not take segment ids (packed rows); use one of "
            f"{PACKING_KERNELS}."
        )
    check_positions(positions, packed=segment_ids is not None, causal=True)
    if segment_ids is not None:
        check_segments(positions, segment_ids, q.shape[0], key_length)
    q_positions = positions[..., key_length - length :]
    q_segments = None if segment_ids is None else segment_ids[:, key_length - length :]
    segments = None if segment_ids is None else (q_segments, segment_ids)
    sides = dict(enc=enc, params=params, q_positions=q_positions, k_positions=positions)
    if kernel == "blockwise":
        return blockwise_attention(
            q, k, v, **sides, block_size=block_size, precision=precision, segment_ids=segment_ids
        )
    if kernel in ("shear", "shear_flash"):
        sides.update(q_segments=q_segments, k_segments=segment_ids)
        with jax.named_scope("attention_kernel"):
            if kernel == "shear":
                return shear_attention(q, k, v, **sides, precision=precision)
            block = min(block_size, SHEAR_FLASH_BLOCK)
            return shear_flash_attention(q, k, v, **sides, block_size=block)
    # Named scopes label the compiled ops, so that profiles split encoding and kernel time.
    with jax.named_scope("encoding"):
        if segment_ids is None:
            q, k = enc.transform_qk(params, q, k, q_positions, positions)
        else:
            # Each sequence's tokens are mapped from its own midpoint, as it would be alone.
            origin = segment_midpoints(positions, segment_ids)
            q = enc.map_queries(
                params, q, q_positions, origin[:, key_length - length :], packed=True
            )
            k = enc.map_keys(params, k, positions, origin, packed=True)
        bias = enc.logit_bias(params, q_positions, positions) if enc.has_bias else None
    with jax.named_scope("attention_kernel"):
        if kernel == "xla":
            return xla_attention(q, k, v, precision, segments)
        if kernel == "cudnn":
            return cudnn_attention(q, k, v, bias)
        if kernel == "splash":
            return splash_attention_causal(q, k, v)
        transform = None
        if encodings.LOGITS in enc.features:
            transform = functools.partial(enc.transform_logits, params)
        return einsum_attention(q, k, v, bias, precision, segments, transform)
