"""The mathematics of Jordan-RoPE as small pure functions (no Flax, no state).

What they compute is docs/mathematics.md, sections 1-3: the block G(d) =
exp(d J), the head viewed as [nb, m, 2] (chain element 0 the top of the
chain), and every map a scalar e^{lambda t} times a unipotent upper Toeplitz
U(t) = sum_r c_r(t) N^r on the chain axis, the coefficients c_r telling the
variants apart. That split lets the factorized maps, the relative oracle and
the kernel-probe bases share one implementation.

Shape legend: B batch, T query length, S key length, N heads, H head dim,
nb blocks per head, m chain order (Jordan block size).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

Coefficients = Sequence[jax.Array | float]


# ---- Frequencies and shear time.


def rotary_frequencies(num_blocks: int, head_dim: int, theta: float) -> jax.Array:
    """omega_b = theta^(-2b / head_dim) for b < num_blocks, float32 [nb]."""
    exponents = -2.0 * jnp.arange(num_blocks, dtype=jnp.float32) / head_dim
    return jnp.power(jnp.float32(theta), exponents)


def real_dtype(x) -> jnp.dtype:
    """float64 for float64 x (the oracle, jrope.oracle), else float32: the maps' arithmetic."""
    return jnp.dtype(jnp.float64 if jnp.result_type(x) == jnp.float64 else jnp.float32)


class ShearTime(NamedTuple):
    """The shear's clock: s(p) / eta = scale * time(p), time the bounded tau(p) or the raw p.

    The one place the shear time is formed: the maps (segments.py), the shear
    kernels' per-pair weight (jrope.attention.shear, shear_flash) and the kernel
    probe all call it. Static and hashable, so a Pallas kernel takes it as is.
    """

    bounded: bool  # tau(p) = p / (1 + |p| / L) (stabilized), else the raw p (exact)
    scale: float  # 1, or 1 / L for the scaled-exact variants
    train_context: float  # L of the bounded time

    def unscaled(self, t, dtype=None) -> jax.Array:
        """time(t) before the scale; float32 (float64 for float64 t, or `dtype`)."""
        t = jnp.asarray(t, dtype or real_dtype(t))
        return t / (1.0 + jnp.abs(t) / self.train_context) if self.bounded else t

    def __call__(self, t, dtype=None) -> jax.Array:
        """s(t) / eta = scale * time(t)."""
        return self.scale * self.unscaled(t, dtype)

    def lag(self, i: jax.Array, j: jax.Array) -> jax.Array:
        """s(i) - s(j) over eta for integer positions i, j (broadcast), float32, cancellation-free.

        Raw and scaled: scale * (i - j), the integer lag made float. Bounded:
        tau(i) - tau(j) = L (L (i - j) + i |j| - j |i|) / ((L + |i|)(L + |j|)),
        whose numerator's two terms are 0 (same signs) or of one sign. Either keeps
        a relative error of a few float32 roundings at any position within int32.
        """
        lag = (i - j).astype(jnp.float32)
        if not self.bounded:
            return self.scale * lag
        length = self.train_context
        fi, fj = i.astype(jnp.float32), j.astype(jnp.float32)
        # i |j| - j |i| is 0 for same signs: selected, not left to cancel, which a compiler's
        # fused multiply-add (allowed on accelerators) would not do exactly.
        cross = jnp.where((i < 0) == (j < 0), 0.0, fi * jnp.abs(fj) - fj * jnp.abs(fi))
        numerator = length * (length * lag + cross)
        return self.scale * numerator / ((length + jnp.abs(fi)) * (length + jnp.abs(fj)))


# ---- Chain coefficient sequences c_r, r < m.


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
    """Coefficients of U^{-1} for U = sum_r c_r N^r (docs/mathematics.md, section 3).

    inv_0 = 1 / c_0,   inv_p = -(sum_{r=1..p} c_r inv_{p-r}) / c_0.
    """
    c0 = coefficients[0]
    inverse: list[jax.Array | float] = [1.0 / c0]
    for p in range(1, len(coefficients)):
        total = sum(coefficients[r] * inverse[p - r] for r in range(1, p + 1))
        inverse.append(-total / c0)
    return inverse


# ---- Generators and closed-form relative operators.


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
    gamma, omega = jnp.float32(gamma), jnp.float32(omega)
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


# ---- The factorized (contragredient) maps on [..., nb, m, 2] blocks.


def map_tables(cos, sin, coefficients: Coefficients) -> jax.Array:
    """The per-position weights of a factorized map, float32 (float64 from float64 cos) [..., nb, R, 2].

    Entry r holds (cos(phi) c_r, sin(phi) c_r): the rotation folded into each
    chain coefficient, so applying the map is R multiply-adds per element. A
    damping scale s is carried by the coefficients (c_r = s u_r). Trailing
    static zeros (no shear) are dropped.
    cos, sin: of the rotation angle, [..., 1|N, nb]; coefficients: c_r, each a
    python float or broadcastable to [..., nb].
    """
    coefficients = list(coefficients)
    while len(coefficients) > 1 and isinstance(coefficients[-1], float) and coefficients[-1] == 0.0:
        coefficients.pop()
    shape = jnp.broadcast_shapes(
        jnp.shape(cos), jnp.shape(sin), *(jnp.shape(c) for c in coefficients)
    )
    # The rotation is built once as its own array and the coefficients as
    # another: XLA:CPU then keeps the [T, 1, nb, 2] rotation (the same in every
    # layer) as one table, instead of evaluating cos and sin again inside each
    # layer's [T, N, nb, R, 2] table and its gradient.
    dtype = real_dtype(cos)
    rotation = jnp.stack([jnp.asarray(cos, dtype), jnp.asarray(sin, dtype)], -1)
    weights = jnp.stack([jnp.broadcast_to(jnp.asarray(c, dtype), shape) for c in coefficients], -1)
    return weights[..., None] * rotation[..., None, :]


def _apply_tables(x: jax.Array, tables: jax.Array, direction: int) -> jax.Array:
    """out[a] = R(-phi) s sum_r c_r x[a + direction * r] on [..., nb, m, 2] blocks."""
    order, num_terms = x.shape[-2], tables.shape[-2]
    re, im = x[..., 0], x[..., 1]
    out_re, out_im = [], []
    for a in range(order):
        acc_re = acc_im = None
        for r in range(num_terms):
            source = a + direction * r
            if not 0 <= source < order:
                continue
            c, s = tables[..., r, 0], tables[..., r, 1]
            term_re = c * re[..., source] + s * im[..., source]
            term_im = c * im[..., source] - s * re[..., source]
            acc_re = term_re if acc_re is None else acc_re + term_re
            acc_im = term_im if acc_im is None else acc_im + term_im
        out_re.append(acc_re)
        out_im.append(acc_im)
    return jnp.stack([jnp.stack(out_re, -1), jnp.stack(out_im, -1)], -1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def apply_map(x: jax.Array, tables: jax.Array, direction: int) -> jax.Array:
    """Applies map_tables weights to x [..., nb, m, 2]; direction +1: U, -1: U^T.

    tables [..., nb, R, 2] broadcast against x's leading axes (typically
    [1, T, N, nb] against [B, T, N, nb]). A custom VJP because the tables'
    gradient is a sum over the broadcast batch axis, which XLA:CPU reduces
    about ten times slower than an elementwise pass; here it is a matrix-vector
    product with ones instead.
    """
    return _apply_tables(x, tables, direction)


def _apply_map_forward(x, tables, direction):
    return _apply_tables(x, tables, direction), (x, tables)


def _apply_map_backward(direction, residuals, d_out):
    x, tables = residuals
    # The adjoint is the same map in the other direction with sin negated.
    adjoint_tables = jnp.stack([tables[..., 0], -tables[..., 1]], -1)
    d_x = _apply_tables(d_out, adjoint_tables, -direction)
    order, num_terms = x.shape[-2], tables.shape[-2]
    re, im, d_re, d_im = x[..., 0], x[..., 1], d_out[..., 0], d_out[..., 1]
    terms = []
    for r in range(num_terms):
        d_c = d_s = 0.0  # r < m: at least one chain element has a source
        for a in range(order):
            source = a + direction * r
            if 0 <= source < order:
                d_c = d_c + d_re[..., a] * re[..., source] + d_im[..., a] * im[..., source]
                d_s = d_s + d_re[..., a] * im[..., source] - d_im[..., a] * re[..., source]
        terms.append(jnp.stack([d_c, d_s], -1))
    d_tables = _sum_to_shape(jnp.stack(terms, -2), tables.shape)
    return d_x.astype(x.dtype), d_tables.astype(tables.dtype)


apply_map.defvjp(_apply_map_forward, _apply_map_backward)


def _sum_to_shape(g: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums g over the axes that `shape` broadcasts (size 1 there, not in g)."""
    g = jnp.sum(g, axis=tuple(range(g.ndim - len(shape))))
    if g.ndim and shape[0] == 1 and g.shape[0] != 1:
        # The leading (batch) axis as a matrix-vector product; at full precision, as a
        # sum is (a default-precision dot rounds its terms to bfloat16 on TPU).
        g = jnp.tensordot(
            jnp.ones(g.shape[0], g.dtype), g, axes=(0, 0), precision=jax.lax.Precision.HIGHEST
        )[None]
    axes = tuple(
        i for i, (n, m) in enumerate(zip(g.shape, shape, strict=False)) if m == 1 and n != 1
    )
    return jnp.sum(g, axis=axes, keepdims=True) if axes else g


def key_map(k: jax.Array, cos, sin, coefficients: Coefficients) -> jax.Array:
    """k' = A(-p) k = e^{gamma p} R(omega p)^T U(-p) k on [..., nb, m, 2] blocks.

    cos, sin: cos(omega p), sin(omega p), [..., nb].
    coefficients: e^{gamma p} times the c_r of U(-p), each broadcastable to [..., nb].
    """
    return apply_map(k, map_tables(cos, sin, coefficients), +1)


def query_map(q: jax.Array, cos, sin, inverse_coefficients: Coefficients) -> jax.Array:
    """q' = A(-p)^{-T} q = e^{-gamma p} R(omega p)^T U(-p)^{-T} q on [..., nb, m, 2].

    cos, sin: cos(omega p), sin(omega p), [..., nb].
    inverse_coefficients: e^{-gamma p} times the c_r of U(-p)^{-1}; U^{-T} is
    lower triangular.
    """
    return apply_map(q, map_tables(cos, sin, inverse_coefficients), -1)


# ---- The relative (oracle) form.


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
        "btnpx,btsnpxy,bsnpy->bnts", q, operators, k, precision=jax.lax.Precision.HIGHEST
    )
