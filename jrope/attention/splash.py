"""The TPU splash (sparse flash) attention kernel that ships with JAX, on the mapped q and k.

`jax.experimental.pallas.ops.tpu.splash_attention` computes attention by
blocks in TPU memory with a causal mask whose fully masked blocks are
skipped, forward and backward (its own VJP). It has no additive bias, so the
ALiBi family never comes here (`jrope.attention.selection`).

The kernel takes heads-major [N, T, H] sequences (vmapped over the batch),
has no logit scale of its own (q is scaled first), and wants T a multiple of
the TPU's 128 lanes; under a device mesh it runs per device
(jrope.attention.mesh_split). Off TPU it runs in Pallas interpret mode (slow;
for tests on CPU).

Shape legend: B batch, T length, N heads, H head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jrope.attention.mesh_split import split_over_batch

# Key blocks must be multiples of the TPU's 128 lanes.
LENGTH_MULTIPLE = 128
_BLOCK_CHOICES = (512, 256, 128)


def splash_attention_causal(
    q: jax.Array, k: jax.Array, v: jax.Array, *, interpret: bool | None = None
) -> jax.Array:
    """Causal attention of mapped q, k [B, T, N, H] and v [B, T, N, H]; T a multiple of 128.

    interpret: run the kernel in Pallas interpret mode (default: off TPU).
    Returns [B, T, N, H] in v's dtype.
    """
    batch, length, heads, head_dim = q.shape
    if length % LENGTH_MULTIPLE or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"splash attention needs q, k, v of one shape [B, T, N, H] with T a multiple of "
            f"{LENGTH_MULTIPLE}; got {q.shape}, {k.shape}, {v.shape}."
        )
    common = jnp.promote_types(q.dtype, v.dtype)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    kernel = _kernel(length, heads, interpret=interpret)
    scale = 1.0 / math.sqrt(head_dim)

    def attend(q, k, v):  # [b, T, N, H] each, b the batch rows this call holds
        heads_major = [jnp.swapaxes(x, 1, 2).astype(common) for x in (q * scale, k, v)]
        return jnp.swapaxes(jax.vmap(kernel)(*heads_major), 1, 2)

    attend = split_over_batch(attend, batch, batched=(True, True, True))
    return attend(q, k, v).astype(v.dtype)


@functools.cache
def _kernel(length: int, heads: int, *, interpret: bool):
    """The splash kernel for causal attention of `heads` heads over `length` positions.

    Built once per shape: the causal mask's block structure is worked out in
    numpy, and its tables are made concrete arrays even when the first call is
    being traced (a cached tracer would leak into later traces).
    """
    # Imported here: the TPU kernel's module costs every process that never runs it 0.1 s.
    from jax.experimental.pallas.ops.tpu import splash_attention

    block = next(size for size in _BLOCK_CHOICES if length % size == 0)
    # One block for every size of the forward and backward passes.
    names = "q kv kv_compute q_dkv kv_dkv kv_dkv_compute q_dq kv_dq".split()
    blocks = splash_attention.BlockSizes(**{f"block_{name}": block for name in names})
    mask = splash_attention.MultiHeadMask(
        [splash_attention.CausalMask((length, length)) for _ in range(heads)]
    )
    with jax.ensure_compile_time_eval():
        return splash_attention.make_splash_mha(
            mask, head_shards=1, q_seq_shards=1, block_sizes=blocks, interpret=interpret
        )
