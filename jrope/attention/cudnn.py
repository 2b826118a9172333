"""cuDNN's fused (flash) attention on NVIDIA GPUs, through `jax.nn.dot_product_attention`.

The encodings other than the ALiBi family are a map of q and k followed by
plain causal attention, so the fused kernel takes the mapped q and k as they
are; ALiBi's logit bias goes in as cuDNN's additive bias. cuDNN's flash
attention takes float16 or bfloat16 only (and head dims that are multiples
of 8, up to 128, or 256 from Hopper on): `jrope.attention.selection` uses it
for bfloat16 runs of encodings whose q and k may be rounded to bfloat16, and
refuses it for the others with the reason. On other backends JAX raises.

Shape legend: B batch, T length, N heads, H head dim.
"""

from __future__ import annotations

import jax

# The head dims cuDNN's flash attention takes on every GPU generation JAX supports.
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 128


def cudnn_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None = None
) -> jax.Array:
    """Causal attention of mapped q, k [B, T, N, H] and v [B, T, N, H] (bfloat16 or float16).

    bias: None, or ALiBi's float32 [N, T, T] / [B, N, T, T], added after the
    1/sqrt(H) scale; it is cast to the inputs' dtype (cuDNN adds it in that
    dtype) and holds no parameters, so no gradient flows into it.
    Returns [B, T, N, H] in v's dtype.
    """
    if bias is not None:
        bias = jax.lax.stop_gradient(bias).astype(q.dtype)
        bias = bias[None] if bias.ndim == 3 else bias
    out = jax.nn.dot_product_attention(
        q.astype(v.dtype),
        k.astype(v.dtype),
        v,
        bias=bias,
        is_causal=True,
        implementation="cudnn",
    )
    return out.astype(v.dtype)
