"""The encoded logits in float64 from the definitions, for every encoding with an eta shear.

score(i, j) = sum over blocks of q_i^T A(-i)^{-1} A(-j) k_j (docs/mathematics.md,
section 3) with A(-p) = e^{gamma p} R(omega p)^T exp(-s(p) N): the damped rotation
of the lag i - j times the chain's exp((s_i - s_j) N), whose time lag is an exact
fraction of the integer positions (no rounding at any offset). And the encodings
the shear tests and benchmarks run it on (setup_encoding).
"""

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

import jrope
from jrope.encodings import alibi_slopes

TRAIN_CONTEXT = 32
HEAD_DIM = 48  # divisible by 2, 4, 6 and 8: every layout and order 3


def _time(cfg, p: int) -> Fraction:
    scale = Fraction(cfg.shear_scale).limit_denominator(1 << 40)
    if cfg.shear_time == "bounded":
        return scale * Fraction(p) / (1 + Fraction(abs(p), cfg.train_context))
    return scale * p


def time_lags(cfg, q_positions, k_positions) -> np.ndarray:
    """float64 [T, S]: time(i) - time(j), exact before the one rounding to float64."""
    tq = [_time(cfg, int(p)) for p in q_positions]
    tk = [_time(cfg, int(p)) for p in k_positions]
    return np.array([[float(a - b) for b in tk] for a in tq])


def reference_logits(encoding, params, q, k, q_positions, k_positions) -> np.ndarray:
    """float64 [B, N, T, S] logits (1/sqrt(H) and ALiBi included) for q [B, T, N, H], k [B, S, N, H]."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    qp = np.asarray(q_positions, np.int64)
    kp = np.asarray(k_positions, np.int64)
    lag = (qp[:, None] - kp[None, :]).astype(np.float64)  # [T, S]
    logits = np.zeros((q.shape[0], encoding.num_heads, q.shape[1], k.shape[1]))
    if not encoding.segments:
        logits += np.einsum("btnh,bsnh->bnts", q, k)
    for segment in encoding.segments:
        physical = {
            key: np.asarray(v, np.float64) for key, v in segment.physical_params(params).items()
        }
        m, nb = segment.order, segment.num_blocks
        omega = np.asarray(segment.frequencies(), np.float64)  # [nb]
        gamma = physical.get("gamma", np.zeros((encoding.num_heads, nb)))
        window = slice(segment.start, segment.start + segment.width)
        qs = q[..., window].reshape(q.shape[:3] + (nb, m, 2))
        ks = k[..., window].reshape(k.shape[:3] + (nb, m, 2))
        cos = np.cos(lag[..., None] * omega)  # [T, S, nb]
        sin = np.sin(lag[..., None] * omega)
        decay = np.exp(-lag[:, :, None, None] * gamma)  # [T, S, N, nb]
        if segment.shear == "eta":
            shear = time_lags(segment.cfg, qp, kp)[:, :, None, None] * physical["eta"]
        else:
            shear = np.zeros_like(decay)
        for a in range(m):
            for c in range(a, m):
                coefficient = shear ** (c - a) / math.factorial(c - a) * decay  # [T, S, N, nb]
                q0, q1 = qs[..., a, 0], qs[..., a, 1]  # [B, T, N, nb]
                k0, k1 = ks[..., c, 0], ks[..., c, 1]
                rotated = (
                    np.einsum("btnp,bsnp,tsp->btsnp", q0, k0, cos)
                    - np.einsum("btnp,bsnp,tsp->btsnp", q0, k1, sin)
                    + np.einsum("btnp,bsnp,tsp->btsnp", q1, k0, sin)
                    + np.einsum("btnp,bsnp,tsp->btsnp", q1, k1, cos)
                )
                logits += np.einsum("btsnp,tsnp->bnts", rotated, coefficient)
    logits /= math.sqrt(encoding.head_dim)
    if encoding.has_bias:
        slopes = alibi_slopes(encoding.num_heads).astype(np.float64)
        logits -= slopes[:, None, None] * np.maximum(lag, 0.0)[None]
    return logits


def setup_encoding(name, length, dtype=jnp.float32, batch=1):
    """An encoding with learned-looking parameters (eta near its bound, some damping) and q, k, v."""
    cfg = jrope.pe_config_from_name(name, train_context=TRAIN_CONTEXT)
    enc = jrope.make_encoding(cfg, 2, HEAD_DIM)
    params = {}
    for i, (key, value) in enumerate(enc.init_params().items()):
        noise = 0.3 * jax.random.normal(jax.random.PRNGKey(i), value.shape)
        params[key] = value + (2.0 if key == "eta_raw" else 0.0) + noise
    keys = jax.random.split(jax.random.PRNGKey(7), 3)
    q, k, v = (jax.random.normal(key, (batch, length, 2, HEAD_DIM)).astype(dtype) for key in keys)
    return enc, params, q, k, v
