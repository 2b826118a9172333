"""The mathematics of Jordan-RoPE as small pure functions (no Flax, no state).

One complex Jordan block of order m (math.md sections 1-3):

    lambda = -gamma + i*omega
    J      = lambda * I_m + eta * N_m              N_m = upper shift, N_m^m = 0
    G(d)   = exp(d J) = e^{lambda d} * sum_{r<m} (eta d)^r N^r / r!

A block occupies 2m real dims of a head, as m interleaved (re, im) pairs:
the head dim is viewed as [num_blocks, m, 2]. Chain element 0 is the top of
the chain: it receives the nilpotent contribution of element 1.

Every map here is "a scalar e^{lambda t} times a unipotent upper Toeplitz
matrix U(t) = sum_r c_r(t) N^r" acting on the chain axis. The coefficient
sequence c_r is what distinguishes the variants: the exponential series
(eta t)^r / r! gives the exact group law; gated or bounded sequences give the
stabilized variants. Keeping that split explicit lets the factorized maps,
the relative oracle and the kernel-probe bases share one implementation.

Shape legend: B batch, T query length, S key length, N heads, H head dim,
nb blocks per head, m chain order (Jordan block size).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

Coefficients = Sequence[jax.Array | float]


# ----------------------------------------------------------------------------
# Frequencies and shear time.
# ----------------------------------------------------------------------------


def rotary_frequencies(num_blocks: int, head_dim: int, theta: float) -> jax.Array:
    """omega_b = theta^(-2b / head_dim) for b < num_blocks, float32 [nb].

    RoPE uses num_blocks = head_dim / 2; an order-m Jordan head uses
    head_dim / (2m) blocks, i.e. the top 1/m of RoPE's frequency range.
    """
    exponents = -2.0 * jnp.arange(num_blocks, dtype=jnp.float32) / head_dim
    return jnp.power(jnp.float32(theta), exponents)


def bounded_time(t: jax.Array, train_context: int) -> jax.Array:
    """tau(t) = t / (1 + |t| / L): the stabilized shear time, odd in t."""
    t = jnp.asarray(t, jnp.float32)
    return t / (1.0 + jnp.abs(t) / train_context)


# ----------------------------------------------------------------------------
# Chain coefficient sequences c_r, r < m.
# ----------------------------------------------------------------------------


def shear_series(shear: jax.Array, order: int) -> list[jax.Array | float]:
    """c_r = s^r / r! for r < order: the chain of exp(s N).

    Its Toeplitz inverse is shear_series(-s, order), exactly.
    """
    coefficients: list[jax.Array | float] = [1.0]
    power = None
    for r in range(1, order):
        power = shear if power is None else power * shear
        coefficients.append(power / math.factorial(r))
    return coefficients


def toeplitz_series_inverse(coefficients: Coefficients) -> list[jax.Array | float]:
    """Coefficients of U^{-1} for U = sum_r c_r N^r (math.md section 3).

    inv_0 = 1 / c_0,   inv_p = -(sum_{r=1..p} c_r inv_{p-r}) / c_0.
    """
    c0 = coefficients[0]
    inverse: list[jax.Array | float] = [1.0 / c0]
    for p in range(1, len(coefficients)):
        total = sum(coefficients[r] * inverse[p - r] for r in range(1, p + 1))
        inverse.append(-total / c0)
    return inverse


# ----------------------------------------------------------------------------
# Generators and closed-form relative operators.
# ----------------------------------------------------------------------------


def nilpotent_shift(order: int, dtype=jnp.float32) -> jax.Array:
    """N_m: ones on the first superdiagonal, [m, m]."""
    return jnp.eye(order, k=1, dtype=dtype)


def complex_generator(gamma, omega, eta, order: int) -> jax.Array:
    """J = (-gamma + i omega) I_m + eta N_m, complex64 [m, m]."""
    lam = jax.lax.complex(-jnp.float32(gamma), jnp.float32(omega))
    eye = jnp.eye(order, dtype=jnp.complex64)
    return lam * eye + jnp.asarray(eta, jnp.complex64) * nilpotent_shift(order, jnp.complex64)


def rotation_generator(gamma, omega) -> jax.Array:
    """Real form of multiplication by -gamma + i omega on one (re, im) pair, [2, 2]."""
    gamma = jnp.float32(gamma)
    omega = jnp.float32(omega)
    return jnp.stack([jnp.stack([-gamma, -omega]), jnp.stack([omega, -gamma])])


def real_generator(gamma, omega, eta, order: int) -> jax.Array:
    """The real [2m, 2m] form of J on the interleaved (re, im) layout."""
    eye2 = jnp.eye(2, dtype=jnp.float32)
    return jnp.kron(jnp.eye(order, dtype=jnp.float32), rotation_generator(gamma, omega)) + (
        jnp.float32(eta) * jnp.kron(nilpotent_shift(order), eye2)
    )


def upper_toeplitz(coefficients: Coefficients, order: int) -> jax.Array:
    """U = sum_r c_r N^r as a matrix, [..., m, m] (c_r broadcast over leading axes)."""
    shape = jnp.broadcast_shapes(*(jnp.shape(c) for c in coefficients))
    matrix = jnp.zeros(shape + (order, order), jnp.float32)
    for r, c in enumerate(coefficients):
        c = jnp.broadcast_to(jnp.asarray(c, jnp.float32), shape)
        diagonal = jnp.eye(order, k=r, dtype=jnp.float32).reshape(
            (1,) * len(shape) + (order, order)
        )
        matrix = matrix + c[..., None, None] * diagonal
    return matrix


def complex_relative_operator(lag, gamma, omega, eta, order: int) -> jax.Array:
    """Closed-form G(d) = e^{lambda d} exp(eta d N), complex64 [..., m, m]."""
    lag = jnp.asarray(lag, jnp.float32)
    phase = jnp.exp(jax.lax.complex(-gamma * lag, omega * lag))
    unipotent = upper_toeplitz(shear_series(eta * lag, order), order)
    return phase[..., None, None] * unipotent.astype(jnp.complex64)


def real_block_operator(angle, log_scale, coefficients: Coefficients, order: int) -> jax.Array:
    """e^{log_scale} R(angle) (x) U(c), the real [..., 2m, 2m] matrix of one block.

    With angle = omega t, log_scale = -gamma t and c = c(t) this is A(t), the
    absolute operator; with t = d and the exponential series it is G(d).
    """
    angle = jnp.asarray(angle, jnp.float32)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    rotation = jnp.stack([jnp.stack([cos, -sin], -1), jnp.stack([sin, cos], -1)], -2)
    rotation = jnp.exp(jnp.asarray(log_scale, jnp.float32))[..., None, None] * rotation
    unipotent = upper_toeplitz(coefficients, order)
    # kron over the trailing two axes: index (a, c) -> 2a + c.
    batch = jnp.broadcast_shapes(rotation.shape[:-2], unipotent.shape[:-2])
    rotation = jnp.broadcast_to(rotation, batch + (2, 2))
    unipotent = jnp.broadcast_to(unipotent, batch + (order, order))
    blocks = unipotent[..., :, None, :, None] * rotation[..., None, :, None, :]
    return blocks.reshape(batch + (2 * order, 2 * order))


def real_relative_operator(lag, gamma, omega, eta, order: int) -> jax.Array:
    """Closed-form real G(d) of the exact block, [..., 2m, 2m]."""
    lag = jnp.asarray(lag, jnp.float32)
    return real_block_operator(omega * lag, -gamma * lag, shear_series(eta * lag, order), order)


def damped_phase(lag, gamma, omega) -> tuple[jax.Array, jax.Array]:
    """(e^{-gamma d} cos(omega d), e^{-gamma d} sin(omega d)), float32."""
    lag = jnp.asarray(lag, jnp.float32)
    decay = jnp.exp(-gamma * lag)
    return decay * jnp.cos(omega * lag), decay * jnp.sin(omega * lag)


# ----------------------------------------------------------------------------
# The factorized (contragredient) maps on [..., nb, m, 2] blocks.
# ----------------------------------------------------------------------------


def _shift_chain(x: jax.Array, r: int) -> jax.Array:
    """out[..., a, :] = x[..., a + r, :] (zero past the end); r may be negative."""
    order = x.shape[-2]
    if r == 0:
        return x
    if abs(r) >= order:
        return jnp.zeros_like(x)
    pad = [(0, 0)] * x.ndim
    if r > 0:
        pad[-2] = (0, r)
        return jnp.pad(x[..., r:, :], pad)
    pad[-2] = (-r, 0)
    return jnp.pad(x[..., : order + r, :], pad)


def _mix_chain(x: jax.Array, coefficients: Coefficients, direction: int) -> jax.Array:
    """sum_r c_r * x shifted by direction * r along the chain axis.

    direction +1 applies U (upper: element a gathers a + r); -1 applies U^T.
    Coefficients broadcast to [..., nb] and get the (m, 2) axes appended.
    """
    out = None
    for r, c in enumerate(coefficients):
        if isinstance(c, float):  # static coefficients (no shear): skip the trivial products
            if c == 0.0:
                continue
            term = (
                _shift_chain(x, direction * r) if c == 1.0 else c * _shift_chain(x, direction * r)
            )
        else:
            term = c[..., None, None] * _shift_chain(x, direction * r)
        out = term if out is None else out + term
    return out


def _rotate_back(x: jax.Array, cos_scaled: jax.Array, sin_scaled: jax.Array) -> jax.Array:
    """s * R(-phi) on every (re, im) pair; cos/sin_scaled = s cos(phi), s sin(phi) [..., nb]."""
    re, im = x[..., 0], x[..., 1]
    c = cos_scaled[..., None]
    s = sin_scaled[..., None]
    return jnp.stack([c * re + s * im, c * im - s * re], axis=-1)


def key_map(k: jax.Array, cos_scaled, sin_scaled, coefficients: Coefficients) -> jax.Array:
    """k' = A(-p) k = e^{gamma p} R(omega p)^T U(-p) k on [..., nb, m, 2] blocks.

    cos_scaled, sin_scaled: e^{gamma p} cos(omega p), e^{gamma p} sin(omega p), [..., nb].
    coefficients: c_r of U(-p), each broadcastable to [..., nb].
    """
    return _rotate_back(_mix_chain(k, coefficients, +1), cos_scaled, sin_scaled)


def query_map(
    q: jax.Array, cos_scaled, sin_scaled, inverse_coefficients: Coefficients
) -> jax.Array:
    """q' = A(-p)^{-T} q = e^{-gamma p} R(omega p)^T U(-p)^{-T} q on [..., nb, m, 2].

    cos_scaled, sin_scaled: e^{-gamma p} cos(omega p), e^{-gamma p} sin(omega p).
    inverse_coefficients: c_r of U(-p)^{-1}; U^{-T} is lower triangular.
    """
    return _rotate_back(_mix_chain(q, inverse_coefficients, -1), cos_scaled, sin_scaled)


# ----------------------------------------------------------------------------
# The relative (oracle) form.
# ----------------------------------------------------------------------------


def relative_block_logits(q: jax.Array, k: jax.Array, operators: jax.Array) -> jax.Array:
    """sum over blocks of q_i^T G(i, j) k_j, the O(T^2) oracle.

    q: [B, T, N, nb, 2m]; k: [B, S, N, nb, 2m];
    operators: [B|1, T, S, N, nb, 2m, 2m] (G for every query/key pair).
    Returns [B, N, T, S] float32 (unscaled).
    """
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    operators = jnp.broadcast_to(operators, (q.shape[0],) + operators.shape[1:])
    return jnp.einsum(
        'btnpx,btsnpxy,bsnpy->bnts', q, operators, k, precision=jax.lax.Precision.HIGHEST
    )


def relative_logits_for_lag_function(
    q: jax.Array, k: jax.Array, lags: jax.Array, operator_of_lag: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """The relative form for any lag function: operator_of_lag(lags) -> [..., N, nb, 2m, 2m].

    q: [B, T, N, nb, 2m]; k: [B, S, N, nb, 2m]; lags: [B|1, T, S] (i - j).
    """
    return relative_block_logits(q, k, operator_of_lag(lags))
