"""Causal self-attention over a positional encoding's two hooks.

The encoding reaches attention only through `enc.transform_qk` (a
per-position linear map of queries and keys) and `enc.logit_bias` (an
additive bias, ALiBi-type variants only). Three interchangeable kernels:

  xla        jax.nn.dot_product_attention(is_causal=True): encodings without a bias.
  einsum     explicit logits, bias, mask and softmax: any encoding (the one
             path for biased variants).
  blockwise  jrope.blockwise_attention: flash-style blocks, memory linear in
             length; it applies the encoding per block itself.

'auto' picks blockwise from `blockwise_min_length` on (when that module is
present), else einsum for biased encodings and xla otherwise.

Numerics: logits and softmax in float32 whatever the compute dtype; the
causal mask is a finite large negative, so a fully masked row cannot turn
into NaN.

Shape legend: B batch, T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from typing import Any

import jax
import jax.numpy as jnp

# Finite stand-in for -inf on masked logits (float32 softmax).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

_BLOCKWISE_MODULE = "jrope.blockwise_attention"


def blockwise_available() -> bool:
    """Whether the blockwise kernel module is installed in this checkout."""
    return importlib.util.find_spec(_BLOCKWISE_MODULE) is not None


def resolve_impl(impl: str, *, has_bias: bool, length: int, blockwise_min_length: int) -> str:
    """The concrete kernel ('xla', 'einsum' or 'blockwise') for a requested `impl`."""
    if impl == "blockwise":
        if not blockwise_available():
            raise ValueError(
                f"attention_impl='blockwise' needs {_BLOCKWISE_MODULE}, which is not installed; "
                "use 'auto', 'xla' or 'einsum'."
            )
        return "blockwise"
    if impl == "auto":
        if length >= blockwise_min_length and blockwise_available():
            return "blockwise"
        return "einsum" if has_bias else "xla"
    if impl == "xla" and has_bias:
        raise ValueError("attention_impl='xla' cannot add a logit bias; use 'einsum' or 'auto' for ALiBi variants.")
    if impl not in ("xla", "einsum"):
        raise ValueError(f"Unknown attention_impl {impl!r}; choose auto, xla, einsum or blockwise.")
    return impl


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    enc: Any,
    params: dict[str, jax.Array],
    positions: jax.Array,
    impl: str = "auto",
    blockwise_min_length: int = 4096,
    block_size: int = 512,
) -> jax.Array:
    """Causal self-attention of raw (not yet position-encoded) q, k, v.

    Args:
      q, k, v: [B, T, N, H] in the compute dtype.
      enc: a jrope encoding (transform_qk, logit_bias, has_bias).
      params: the encoding's parameters for this layer.
      positions: int32 [T] or [B, T], query and key positions.
      impl: 'auto', 'xla', 'einsum' or 'blockwise' (see the module docstring).
    Returns:
      [B, T, N, H] in v's dtype.
    """
    choice = resolve_impl(
        impl, has_bias=enc.has_bias, length=q.shape[1], blockwise_min_length=blockwise_min_length
    )
    if choice == "blockwise":
        blockwise = importlib.import_module(_BLOCKWISE_MODULE).blockwise_attention
        return blockwise(
            q, k, v, enc=enc, params=params, q_positions=positions, k_positions=positions, block_size=block_size
        )
    q, k = enc.transform_qk(params, q, k, positions, positions)
    if choice == "xla":
        return _xla_attention(q, k, v)
    bias = enc.logit_bias(params, positions, positions) if enc.has_bias else None
    return _einsum_attention(q, k, v, bias)


def _xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    # Raw-shear encodings return float32 q, k (their cancellation is not
    # bf16-safe); the fused kernel wants one dtype, so v follows them.
    common = jnp.promote_types(q.dtype, v.dtype)
    out = jax.nn.dot_product_attention(
        q.astype(common), k.astype(common), v.astype(common), is_causal=True, implementation="xla"
    )
    return out.astype(v.dtype)


def _einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None) -> jax.Array:
    """Explicit-logits attention; bias [N, T, S] or [B, N, T, S] is added after the 1/sqrt(H) scale."""
    length, key_length, head_dim = q.shape[1], k.shape[1], q.shape[-1]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(head_dim))
    if bias is not None:
        bias = bias.astype(jnp.float32)
        logits = logits + (bias[None] if bias.ndim == 3 else bias)
    # Key j is visible to query i iff j <= i (queries and keys share positions).
    visible = jnp.arange(key_length)[None, :] <= jnp.arange(length)[:, None]
    logits = jnp.where(visible[None, None], logits, MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)
