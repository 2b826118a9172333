"""The float64 oracle: an encoding's logits and attention through its own maps, in float64.

Every kernel is measured against this (the device check, jrope.check; the
accuracy benchmarks; the conformance tests): the encoding's own
`map_queries`, `map_keys`, `logit_bias` and `transform_logits`, evaluated in
float64, then a dense causal softmax in float64 (docs/extending.md, section 1).

Float64 runs where it is native: on the GPU, else on the host's CPU (a TPU
would emulate it). Each row's tokens are mapped from the midpoint of its
positions (packed rows: of their sequence's), which keeps every damping
factor within e^{gamma * span / 2}.

Shape legend: B batch, T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jrope.attention import packing
from jrope.attention.shear import batched_positions
from jrope.encodings import Encoding, default_origin

# Query rows per block of the attention (its logits are [B, N, ROWS, S] at a time).
ROWS = 256


def device() -> jax.Device:
    """Where float64 runs: the GPU computes it natively, a TPU would emulate it, so the host CPU."""
    if jax.default_backend() == "gpu":
        return jax.devices()[0]
    return jax.devices("cpu")[0]


@contextlib.contextmanager
def float64() -> Iterator[None]:
    """Runs the enclosed JAX code in float64 on `device()`."""
    with jax.enable_x64(True), jax.default_device(device()):
        yield


def as_float64(tree):
    """Arrays (any float dtype, on any device) as float64 numpy arrays, leaf by leaf."""
    return jax.tree.map(lambda x: np.asarray(x).astype(np.float64), tree)


def mapped(enc: Encoding, params, q, k, q_positions, k_positions, k_segments=None):
    """(q2 [B, T, N, H], k2 [B, S, N, H]) in float64: the queries are the last T of the S keys.

    Call inside `float64()`. k_segments: int32 [B, S] segment ids of packed rows,
    each sequence then mapped from its own midpoint.
    """
    q_pos, k_pos = batched_positions(q_positions), batched_positions(k_positions)
    if k_segments is None:
        q_origin = k_origin = default_origin(q_pos, k_pos)
    else:
        k_origin = packing.segment_midpoints(jnp.broadcast_to(k_pos, k_segments.shape), k_segments)
        q_origin = k_origin[:, k_origin.shape[1] - q.shape[1] :]
    q2 = enc.map_queries(params, q, q_pos, q_origin, packed=k_segments is not None)
    k2 = enc.map_keys(params, k, k_pos, k_origin, packed=k_segments is not None)
    return q2.astype(jnp.float64), k2.astype(jnp.float64)


def logits(enc: Encoding, params, q, k, q_positions, k_positions) -> jax.Array:
    """float64 [B, N, T, S]: transform_logits(q2 . k2 / sqrt(H) plus the bias), every pair (future
    ones too).

    Call inside `float64()` with float64 q, k and params.
    """
    q2, k2 = mapped(enc, params, q, k, q_positions, k_positions)
    return _scores(
        enc, params, q2, k2, batched_positions(q_positions), batched_positions(k_positions)
    )


def _scores(enc: Encoding, params, q2, k2, q_pos, k_pos) -> jax.Array:
    """transform_logits(q2 . k2 / sqrt(H) + bias), float64 [B, N, T, S], every pair."""
    scores = jnp.einsum("btnh,bsnh->bnts", q2, k2) / math.sqrt(enc.head_dim)
    bias = enc.logit_bias(params, q_pos, k_pos)
    return enc.transform_logits(
        params, scores if bias is None else scores + bias.astype(jnp.float64)
    )


def attention(enc: Encoding, params, q, k, v, positions, segment_ids=None) -> jax.Array:
    """float64 causal attention [B, T, N, H] of the last T of S positions (rows of ROWS at a time).

    q: [B, T, N, H]; k, v: [B, S, N, H]; positions: int [S] or [B, S];
    segment_ids: optional int32 [B, S]. Call inside `float64()` with float64
    arrays; differentiable in q, k, v and params.
    """
    batch, length, heads, head_dim = q.shape
    k_pos = jnp.broadcast_to(batched_positions(positions), (batch, k.shape[1]))
    q_pos = k_pos[:, k.shape[1] - length :]
    q2, k2 = mapped(enc, params, q, k, q_pos, k_pos, segment_ids)
    segments = jnp.zeros_like(k_pos) if segment_ids is None else segment_ids
    q_segments = segments[:, k.shape[1] - length :]
    rows = math.gcd(length, ROWS)

    @jax.checkpoint
    def block(args):
        q_rows, rows_pos, rows_seg = args  # [B, r, N, H], [B, r], [B, r]
        scores = _scores(enc, params, q_rows, k2, rows_pos, k_pos)
        causal = k_pos[:, None, :] <= rows_pos[:, :, None]
        visible = causal & (segments[:, None, :] == rows_seg[:, :, None])
        scores = jnp.where(visible[:, None], scores, -jnp.inf)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)

    def split(x):  # [B, T, ...] -> [T / r, B, r, ...]
        return jnp.moveaxis(x.reshape((batch, length // rows, rows) + x.shape[2:]), 1, 0)

    out = jax.lax.map(block, (split(q2), split(q_pos), split(q_segments)))
    return jnp.moveaxis(out, 0, 1).reshape(batch, length, heads, head_dim)


def attention_and_gradients(enc: Encoding, params, q, k, v, w, positions, segment_ids=None):
    """(out, grads): float64 numpy attention [B, T, N, H] and the gradients of sum(out * w).

    grads: {'dq', 'dk', 'dv', 'd<param>'} as float64 numpy arrays. Arguments
    as `attention` (any float dtype: they are taken to float64), w: [B, T, N, H].
    """
    with float64():
        q, k, v, w, params = as_float64((q, k, v, w, params))
        (_, out), grads = _value_and_grad(enc, q, k, v, params, w, positions, segment_ids)
    return np.asarray(out), named_gradients(grads)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grad(enc, q, k, v, params, w, positions, segment_ids):
    def loss(q, k, v, params):
        out = attention(enc, params, q, k, v, positions, segment_ids)
        return jnp.sum(out * w), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, params)


def named_gradients(grads) -> dict[str, np.ndarray]:
    """{'dq', 'dk', 'dv', 'd<param>'} as float64 numpy, from (dq, dk, dv, dparams)."""
    dq, dk, dv, dparams = grads
    named = {"dq": dq, "dk": dk, "dv": dv, **{f"d{name}": g for name, g in dparams.items()}}
    return as_float64(named)
