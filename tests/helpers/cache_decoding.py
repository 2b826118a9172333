"""One decode step of a one-layer KV cache against the float64 formula, for accuracy checks.

A LayerCache (jrope.model.kv_cache) prefilled with the first S - 1 keys from
the origin at position S - 2, then the last token decoded over them: the
decode step's own arithmetic (cached key layout, term dots, time lags,
softmax) without the rest of a model, whose bfloat16 rounding would hide it.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jrope.model import kv_cache
from tests.helpers.shear_oracle import reference_logits


def decoded_output(enc, params, q, k, v, positions, *, shear_terms, key_dtype):
    """The last token's attention output [1, 1, N, H], float64, from a one-layer cache: the
    first S - 1 keys prefilled from origin positions[-2], then the last token decoded over them.

    q, k, v: [1, S, N, H] in the compute dtype; positions: int32 [S].
    """
    decode = functools.partial(_decoded, enc, shear_terms=shear_terms, key_dtype=key_dtype)
    return np.asarray(jax.jit(decode)(params, q, k, v, positions), np.float64)


def _decoded(enc, params, q, k, v, positions, *, shear_terms, key_dtype):
    _, length, heads, head_dim = k.shape
    width = head_dim
    if shear_terms:
        width = sum(2 * omega.shape[-1] for _, omega in enc.term_rates(params))
    positions = jnp.asarray(positions, jnp.int32)[None]
    origin = positions[:, -2]
    empty = jnp.full((1, length), kv_cache.EMPTY, jnp.int32)
    prompt = kv_cache.LayerCache(
        jnp.zeros((1, heads, width, length), key_dtype),
        jnp.zeros((1, heads, length, head_dim), v.dtype),
        empty,
        positions[:, :-1],
        origin,
        jnp.int32(0),
        jnp.ones((1, length - 1), bool),
        decoding=False,
        shear_terms=shear_terms,
    )
    prompt.add(k[:, :-1], v[:, :-1], enc, params)
    step = kv_cache.LayerCache(
        prompt.keys,
        prompt.values,
        empty.at[:, :-1].set(positions[:, :-1]),
        positions[:, -1:],
        origin,
        jnp.int32(length - 1),
        jnp.ones((1, 1), bool),
        decoding=True,
        shear_terms=shear_terms,
    )
    step.add(k[:, -1:], v[:, -1:], enc, params)
    return step.attend(q[:, -1:], enc, params)


def reference_output(enc, params, q, k, v, positions):
    """The last token's attention output [1, 1, N, H] from the float64 formula."""
    logits = reference_logits(enc, params, q[:, -1:], k, positions[-1:], positions)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", weights, np.asarray(v, np.float64))


def relative_rms(value, reference):
    """|value - reference| / |reference| over all entries."""
    return float(np.linalg.norm(value - reference) / np.linalg.norm(reference))


def logit_rms(enc, params, q, k, positions):
    """The RMS of the float64 logits over the causal pairs."""
    logits = reference_logits(enc, params, q, k, positions, positions)
    return float(np.sqrt(np.mean(logits[..., np.tril(np.ones(logits.shape[-2:], bool))] ** 2)))
