"""The tests' own oracle: the encoded logits in float64 from the definitions, not the library.

score(i, j) = sum over blocks of q_i^T A(-i)^{-1} A(-j) k_j (docs/mathematics.md,
section 3). reference_logits, for every encoding with an eta shear: with A(-p) =
e^{gamma p} R(omega p)^T exp(-s(p) N), the damped rotation of the lag i - j times the
chain's exp((s_i - s_j) N), whose time lag is an exact fraction of the integer positions
(no rounding at any offset). definition_logits, for any chain (the gated jets too): the
dense matrices A(t) and their inverses. jrope.oracle, which every kernel is measured
against, evaluates the library's own maps; this module checks those maps. And the
encodings the shear tests and benchmarks run it on (setup_encoding).
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


def definition_logits(enc, params, q, k, q_pos, k_pos) -> np.ndarray:
    """float64 [B, N, T, S]: q_i^T A(-i)^{-1} A(-j) k_j / sqrt(H) (+ ALiBi), for any chain.

    A(t) = e^{-gamma t} U(t) (x) R(omega t) per block, U(t) = sum_r c_r(t) N^r
    with the variant's coefficient sequence (gated jets too); the inverse is a
    dense solve, per pair: for a few positions only.
    """
    cfg = enc.cfg
    phys = {k_: np.asarray(v, np.float64) for k_, v in enc.physical_params(params).items()}
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    head_dim = enc.head_dim

    def tau(t):
        return t / (1 + abs(t) / cfg.train_context) if cfg.shear_time == "bounded" else t

    def block_matrix(t, n, b, order, omega, gamma, segment_cfg):
        rot = np.array(
            [
                [math.cos(omega * t), -math.sin(omega * t)],
                [math.sin(omega * t), math.cos(omega * t)],
            ]
        )
        s = segment_cfg.shear_scale * tau(t)
        if segment_cfg.shear == "eta":
            coeffs = [(phys["eta"][n, b] * s) ** r / math.factorial(r) for r in range(order)]
        elif segment_cfg.shear == "jet":
            base = phys["jet_base"][n, b] if "jet_base" in phys else 1.0
            coeffs = [base] + [
                phys["jet_gates"][r - 1, n, b] * s**r / math.factorial(r) for r in range(1, order)
            ]
        else:
            coeffs = [1.0] + [0.0] * (order - 1)
        unipotent = sum(c * np.eye(order, k=r) for r, c in enumerate(coeffs))
        return math.exp(-gamma * t) * np.kron(unipotent, rot)

    def full_matrix(t, n):
        blocks = []
        for segment in enc.segments:
            omegas = np.asarray(segment.frequencies(), np.float64)
            gammas = phys["gamma"][n] if segment.learn_gamma else np.zeros(segment.num_blocks)
            for b in range(segment.num_blocks):
                blocks.append(
                    block_matrix(t, n, b, segment.order, omegas[b], gammas[b], segment.cfg)
                )
        size = sum(x.shape[0] for x in blocks)
        out = np.eye(head_dim)
        out[:size, :size] = 0
        at = 0
        for x in blocks:
            out[at : at + x.shape[0], at : at + x.shape[0]] = x
            at += x.shape[0]
        return out

    logits = np.zeros((q.shape[0], enc.num_heads, q.shape[1], k.shape[1]))
    for n in range(enc.num_heads):
        inv_a = {int(i): np.linalg.inv(full_matrix(-float(i), n)) for i in q_pos}
        a = {int(j): full_matrix(-float(j), n) for j in k_pos}
        for ti, i in enumerate(q_pos):
            for sj, j in enumerate(k_pos):
                op = inv_a[int(i)] @ a[int(j)]
                logits[:, n, ti, sj] = np.einsum("bx,xy,by->b", q[:, ti, n], op, k[:, sj, n])
    logits /= math.sqrt(head_dim)
    if cfg.alibi:
        slopes = jrope.alibi_slopes(enc.num_heads)
        lag = np.maximum(np.asarray(q_pos)[:, None] - np.asarray(k_pos)[None, :], 0)
        logits -= slopes[None, :, None, None] * lag[None, None]
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
