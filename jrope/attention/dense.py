"""The two kernels that form the logits of a whole sequence: XLA's fused attention and an einsum one.

Both take queries and keys already mapped by the encoding:

  xla        jax.nn.dot_product_attention (XLA implementation, causal mask):
             encodings without a bias.
  einsum     explicit logits, bias, mask and softmax, with causal row blocks
             and a hand-written VJP: any encoding. On CPU its train step is
             faster than xla's (see QUERY_CHUNKS).

Both take optional segment ids of packed rows (several sequences in a row,
each a contiguous run): the mask then also requires the query's and the
key's segment to agree. Causality stays by index, which within one segment
is the order of its positions.

Numerics: logits and softmax in float32 whatever the compute dtype; the
causal mask is a finite large negative, so a fully masked row cannot turn
into NaN. The q.k and p.v dots, forward and backward, run at the precision
passed in (jrope.attention.precision; None: the backend's default).

Shape legend: B batch, T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jrope.attention.precision import precision_scope
from jrope.encodings import add_bias

# Finite stand-in for -inf on masked logits (float32 softmax), for every kernel: the
# blockwise kernel's running maximum stays finite while a row has seen only masked
# logits, since (mask - mask) is 0 and (mask - real) underflows to exp() = 0, never
# inf - inf (its masked probabilities are also zeroed explicitly).
MASK_VALUE = -1e30
# Query row blocks of the einsum path: 4 forms 5/8 of the causal logits.
# Attention forward + backward at B 24, L 256, 4 heads of 32 on a 2-core CPU,
# relative to jax.nn.dot_product_attention: 0.74 with 1 block, 0.61 with 2,
# 0.59 with 4, 0.65 with 8 (CPU time, median of 9 interleaved rounds).
QUERY_CHUNKS = 4


def suffix_causal_mask(length: int, key_length: int) -> jax.Array:
    """bool [T, S]: query t (key index S - T + t, the queries being the last T) sees keys <= it."""
    return jnp.arange(key_length)[None, :] <= (key_length - length + jnp.arange(length))[:, None]


def segment_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
    """bool [B, 1, T, S]: the query's and the key's segment ids agree (q [B, T], k [B, S])."""
    return (q_segments[:, :, None] == k_segments[:, None, :])[:, None]


def xla_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    precision: jax.lax.Precision | None = None,
    segments: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """jax.nn.dot_product_attention with a causal mask: q [B, T, N, H] (the last T of S), k, v [B, S, N, H].

    segments: optional (int32 [B, T], int32 [B, S]) segment ids of the queries and the keys.
    """
    # Raw-shear encodings return float32 q, k (their cancellation is not
    # bf16-safe); the fused kernel wants one dtype, so v follows them.
    common = jnp.promote_types(q.dtype, v.dtype)
    length, key_length = q.shape[1], k.shape[1]
    # is_causal aligns query 0 with key 0; queries that are the last rows need the mask spelled out.
    mask = None
    if length != key_length or segments is not None:
        mask = suffix_causal_mask(length, key_length)[None, None]
    if segments is not None:
        mask = mask & segment_mask(*segments)
    with precision_scope(precision):
        qkv = [x.astype(common) for x in (q, k, v)]
        out = jax.nn.dot_product_attention(
            *qkv, mask=mask, is_causal=mask is None, implementation="xla"
        )
    return out.astype(v.dtype)


def einsum_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    precision: jax.lax.Precision | None = None,
    segments: tuple[jax.Array, jax.Array] | None = None,
    transform=None,
) -> jax.Array:
    """Explicit-logits causal attention; bias [N, T, S] or [B, N, T, S] is added after the 1/sqrt(H) scale.

    segments: optional (int32 [B, T], int32 [B, S]) segment ids of the queries and the keys.
    transform: None, or an elementwise map of the logits [B, N, t, s] after the bias
    (Encoding.transform_logits); it is differentiated by autodiff, past the hand-written VJP.
    """
    if transform is not None:
        return _chunked_forward(q, k, v, bias, segments, precision, transform)[0]
    return _chunked_causal_attention(q, k, v, bias, segments, precision)


def _chunk_bounds(length: int, key_length: int) -> list[tuple[int, int, int]]:
    """(start, stop, key_stop) of the query row blocks; block i attends to keys [0, key_stop_i)."""
    chunk = -(-length // QUERY_CHUNKS)
    offset = key_length - length
    bounds = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        bounds.append((start, stop, offset + stop))
    return bounds


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunked_causal_attention(q, k, v, bias, segments, precision):
    """Causal attention with queries cut into QUERY_CHUNKS row blocks.

    q [B, T, N, H] (the last T of S positions), k, v [B, S, N, H]; bias None,
    [N, T, S] or [B, N, T, S]; segments None or int32 ([B, T], [B, S]) -> [B, T, N, H].
    Each row block attends only to the keys at or before its last row (for
    T = S, (n + 1) / (2n) of the logits), in head-major [B, N, T, H], the
    layout XLA:CPU's batched matmuls want. A custom VJP because autodiff of
    the softmax materialises several more T x T arrays than the gradient
    needs, and on CPU attention time is spent passing over them.
    """
    return _chunked_forward(q, k, v, bias, segments, precision)[0]


def _head_major(x: jax.Array) -> jax.Array:
    """[B, T, N, H] <-> [B, N, T, H]."""
    return jnp.transpose(x, (0, 2, 1, 3))


def _chunked_forward(q, k, v, bias, segments, precision, transform=None):
    q, k, v = _head_major(q), _head_major(k), _head_major(v)
    outputs, saved = [], []
    for start, stop, key_stop in _chunk_bounds(q.shape[2], k.shape[2]):
        chunk_bias = None if bias is None else bias[..., start:stop, :key_stop]
        same_segment = None
        if segments is not None:
            same_segment = segment_mask(segments[0][:, start:stop], segments[1][:, :key_stop])
        chunk = (q[:, :, start:stop], k[:, :, :key_stop], v[:, :, :key_stop])
        out, unnormalised, row_sum = _chunk_forward(
            *chunk, chunk_bias, same_segment, precision, transform
        )
        outputs.append(out)
        saved.append((unnormalised, row_sum))
    out = outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=2)
    return _head_major(out), (q, k, v, bias, out, saved)


def _chunk_forward(q, k, v, bias, same_segment, precision, transform=None):
    """The last T query rows over S >= T keys: row t sits at key index S - T + t.

    q [B, N, T, H], k and v [B, N, S, H]; same_segment None or bool [B, 1, T, S].
    A row always sees its own key (its segment's), so no row is fully masked. Returns the output [B, N, T, H], the
    unnormalised probabilities E [B, N, T, S] (float32, 0 where masked) and
    their row sums [B, N, T].
    """
    length, key_length, head_dim = q.shape[2], k.shape[2], q.shape[-1]
    logits = jnp.einsum(
        "bnth,bnsh->bnts", q, k, preferred_element_type=jnp.float32, precision=precision
    )
    logits = logits * (1.0 / math.sqrt(head_dim))
    if bias is not None:
        logits = add_bias(logits, bias.astype(jnp.float32))
    if transform is not None:
        logits = transform(logits)
    visible = suffix_causal_mask(length, key_length)[None, None]
    if same_segment is not None:
        visible = visible & same_segment
    logits = jnp.where(visible, logits, MASK_VALUE)
    # The division by the row sum is applied to the [B, N, T, H] output, not
    # to the [B, N, T, S] matrix.
    unnormalised = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    row_sum = jnp.sum(unnormalised, axis=-1)
    dots = dict(preferred_element_type=jnp.float32, precision=precision)
    out = jnp.einsum("bnts,bnsh->bnth", unnormalised.astype(v.dtype), v, **dots)
    return (out / row_sum[..., None]).astype(v.dtype), unnormalised, row_sum


def _chunked_backward(precision, residuals, d_out):
    """Per block, with P = E / r and dO_r = dO / r (row-wise):
    dV = E^T dO_r,  dLogits = E * (dO_r V^T - rowsum(dO_r * O)),
    dQ = dLogits K / sqrt(H),  dK = dLogits^T Q / sqrt(H)."""
    q, k, v, bias, out, saved = residuals  # head-major
    d_out = _head_major(d_out).astype(jnp.float32)
    key_length = k.shape[2]
    bounds = _chunk_bounds(q.shape[2], key_length)
    scale = 1.0 / math.sqrt(q.shape[-1])
    d_q_rows, d_k_parts, d_v_parts, d_bias_rows = [], [], [], []
    dot = functools.partial(jnp.einsum, preferred_element_type=jnp.float32, precision=precision)
    for (start, stop, key_stop), (unnormalised, row_sum) in zip(bounds, saved, strict=False):
        d_scaled = d_out[:, :, start:stop] / row_sum[..., None]
        d_v_parts.append(dot("bnts,bnth->bnsh", unnormalised, d_scaled))
        d_probs = dot("bnth,bnsh->bnts", d_scaled, v[:, :, :key_stop])
        # [B, N, T]
        correction = jnp.sum(d_scaled * out[:, :, start:stop].astype(jnp.float32), axis=-1)
        d_logits = unnormalised * (d_probs - correction[..., None])
        d_q_rows.append(dot("bnts,bnsh->bnth", d_logits, k[:, :, :key_stop]))
        d_k_parts.append(dot("bnts,bnth->bnsh", d_logits, q[:, :, start:stop]))
        if bias is not None:
            rows = d_logits if bias.ndim == 4 else jnp.sum(d_logits, axis=0)
            d_bias_rows.append(
                jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, key_length - key_stop)])
            )
    d_q = _head_major(jnp.concatenate(d_q_rows, axis=2) * scale)
    d_k = _head_major(_sum_key_prefixes(d_k_parts, bounds) * scale)
    d_v = _head_major(_sum_key_prefixes(d_v_parts, bounds))
    d_bias = None if bias is None else jnp.concatenate(d_bias_rows, axis=-2).astype(bias.dtype)
    # Segment ids are integers: they take no cotangent.
    return d_q.astype(q.dtype), d_k.astype(k.dtype), d_v.astype(v.dtype), d_bias, None


_chunked_causal_attention.defvjp(_chunked_forward, _chunked_backward)


def _sum_key_prefixes(parts: list[jax.Array], bounds: list[tuple[int, int, int]]) -> jax.Array:
    """Sum of head-major gradients over key prefixes: parts[i] covers keys [0, key_stop_i).

    Key block j (keys key_stop_{j-1} .. key_stop_j) collects the parts of query
    blocks i >= j; assembling it block by block avoids padding every part to
    full length.
    """
    blocks = []
    for j, (_, _, key_stop) in enumerate(bounds):
        key_start = bounds[j - 1][2] if j else 0
        blocks.append(sum(part[:, :, key_start:key_stop] for part in parts[j:]))
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=2)
