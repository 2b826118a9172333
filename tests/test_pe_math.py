"""The closed forms of pe_math against expm, and the group law, under jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import expm

from jrope import pe_math

ORDERS = (2, 3, 4)


def _expm64(matrix):
    """Ground truth: expm in float64 (float32 expm itself errs by ~1e-3 at |dJ| ~ 10)."""
    with jax.enable_x64(True):
        return np.asarray(expm(jnp.asarray(np.asarray(matrix))))


def _random_block(seed):
    rng = np.random.default_rng(seed)
    return (
        float(rng.uniform(0.0, 0.05)),
        float(rng.uniform(0.01, 1.0)),
        float(rng.uniform(-0.3, 0.3)),
    )


@pytest.mark.parametrize("order", ORDERS)
def test_complex_closed_form_is_expm_and_obeys_group_law(order):
    gamma, omega, eta = _random_block(order)
    generator = pe_math.complex_generator(gamma, omega, eta, order)

    @jax.jit
    def check(a, b):
        def g(d):
            return pe_math.complex_relative_operator(d, gamma, omega, eta, order)

        return g(a), g(b), g(a + b)

    a = 3.0
    ga, gb, gab = check(jnp.float32(a), jnp.float32(11.0))
    np.testing.assert_allclose(
        ga, _expm64(a * np.asarray(generator, np.complex128)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(ga @ gb, gab, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ORDERS)
def test_real_closed_form_is_expm_and_obeys_group_law(order):
    gamma, omega, eta = _random_block(10 + order)
    generator = pe_math.real_generator(gamma, omega, eta, order)
    g = jax.jit(lambda d: pe_math.real_relative_operator(d, gamma, omega, eta, order))
    for a, b in [(0.0, 5.0), (2.0, 7.0), (13.0, 4.0)]:
        np.testing.assert_allclose(
            g(a), _expm64(a * np.asarray(generator, np.float64)), rtol=1e-5, atol=2e-6
        )
        np.testing.assert_allclose(g(a) @ g(b), g(a + b), rtol=1e-5, atol=2e-6)
    # The order-2 real block of docs/mathematics.md, section 2: e^{-gamma d} [[R, s R], [0, R]].
    if order == 2:
        d = 6.0
        c, s = np.cos(omega * d), np.sin(omega * d)
        rot = np.array([[c, -s], [s, c]])
        expected = np.exp(-gamma * d) * np.block([[rot, eta * d * rot], [np.zeros((2, 2)), rot]])
        np.testing.assert_allclose(g(d), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ORDERS)
def test_real_form_matches_complex_form(order):
    """The interleaved (re, im) real matrix is the realification of the complex one."""
    gamma, omega, eta = _random_block(20 + order)
    z = np.asarray(pe_math.complex_relative_operator(4.0, gamma, omega, eta, order))
    real = np.asarray(pe_math.real_relative_operator(4.0, gamma, omega, eta, order))
    for a in range(order):
        for b in range(order):
            block = real[2 * a : 2 * a + 2, 2 * b : 2 * b + 2]
            expected = np.array([[z[a, b].real, -z[a, b].imag], [z[a, b].imag, z[a, b].real]])
            np.testing.assert_allclose(block, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ORDERS)
def test_toeplitz_inverse_inverts_any_sequence(order):
    rng = np.random.default_rng(order)
    coefficients = [float(c) for c in rng.uniform(0.5, 2.0, size=order)]
    inverse = pe_math.toeplitz_series_inverse(coefficients)
    product = pe_math.upper_toeplitz(coefficients, order) @ pe_math.upper_toeplitz(inverse, order)
    np.testing.assert_allclose(product, np.eye(order), atol=1e-6)
    # The exponential chain's inverse is the chain of -s.
    s = 0.7
    np.testing.assert_allclose(
        pe_math.toeplitz_series_inverse(pe_math.shear_series(s, order)),
        pe_math.shear_series(-s, order),
        atol=1e-6,
    )


@pytest.mark.parametrize("order", ORDERS)
def test_contragredient_maps_give_the_relative_operator(order):
    """query_map(q, i) . key_map(k, j) == q^T G(i - j) k for the exact chain."""
    gamma, omega, eta = _random_block(30 + order)
    rng = np.random.default_rng(order)
    q = jnp.asarray(rng.normal(size=(1, order, 2)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, order, 2)), jnp.float32)

    @jax.jit
    def score(i, j):
        def factors(p, sign):
            scale = jnp.exp(sign * gamma * p)
            return (scale * jnp.cos(omega * p)).reshape(1), (scale * jnp.sin(omega * p)).reshape(1)

        qc, qs = factors(i, -1.0)
        kc, ks = factors(j, +1.0)
        q2 = pe_math.query_map(q, qc, qs, pe_math.shear_series(eta * i * jnp.ones(1), order))
        k2 = pe_math.key_map(k, kc, ks, pe_math.shear_series(-eta * j * jnp.ones(1), order))
        return jnp.sum(q2 * k2)

    for i, j in [(5.0, 2.0), (9.0, 9.0), (30.0, 1.0)]:
        expected = (
            q.reshape(-1)
            @ pe_math.real_relative_operator(i - j, gamma, omega, eta, order)
            @ k.reshape(-1)
        )
        np.testing.assert_allclose(score(i, j), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("order", (1, 2, 3))
@pytest.mark.parametrize("direction", (1, -1))
def test_apply_map_gradient_matches_autodiff_of_its_formula(order, direction):
    """The custom VJP (batch sum as a matmul by ones) equals plain autodiff.

    Tables broadcast over batch and, for the rotation-only table, heads, as
    in training: [1, T, N|1, nb, R, 2] against x [B, T, N, nb, m, 2].
    """
    rng = np.random.default_rng(order + 10 * (direction + 1))
    x = jnp.asarray(rng.normal(size=(3, 5, 2, 4, order, 2)), jnp.float32)
    d_out = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    for table_heads in (2, 1):
        tables = jnp.asarray(rng.normal(size=(1, 5, table_heads, 4, order, 2)), jnp.float32)

        @jax.jit
        def both(x, tables):
            custom = jax.vjp(lambda a, b: pe_math.apply_map(a, b, direction), x, tables)
            plain = jax.vjp(lambda a, b: pe_math._apply_tables(a, b, direction), x, tables)
            return custom[0], plain[0], custom[1](d_out), plain[1](d_out)

        out, expected_out, grads, expected_grads = both(x, tables)
        np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
        for grad, expected in zip(grads, expected_grads, strict=False):
            assert grad.shape == expected.shape
            np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5)
    # Undifferentiated, tables materialized (broadcast) or fused (one per row) alike.
    for table_batch in (1, 3):
        tables = jnp.asarray(rng.normal(size=(table_batch,) + x.shape[1:]), jnp.float32)
        np.testing.assert_allclose(
            jax.jit(pe_math.apply_map, static_argnums=2)(x, tables, direction),
            pe_math._apply_tables(x, tables, direction),
            rtol=1e-6,
            atol=1e-6,
        )


def test_map_tables_drop_static_zero_coefficients():
    cos, sin = jnp.ones((3, 2)), jnp.zeros((3, 2))
    assert pe_math.map_tables(cos, sin, [1.0, 0.0, 0.0]).shape == (3, 2, 1, 2)
    eta = jnp.full((3, 2), 0.5)
    tables = pe_math.map_tables(cos, sin, [1.0, eta, 0.0])
    assert tables.shape == (3, 2, 2, 2)
    np.testing.assert_allclose(tables[..., 1, 0], 0.5)


def test_rotary_frequencies_and_bounded_time():
    omega = pe_math.rotary_frequencies(4, 16, 10000.0)
    np.testing.assert_allclose(omega, 10000.0 ** (-2.0 * np.arange(4) / 16), rtol=1e-6)
    assert omega.dtype == jnp.float32
    t = jnp.array([-2048.0, -3.0, 0.0, 3.0, 1024.0])
    bounded_time = pe_math.ShearTime(bounded=True, scale=1.0, train_context=1024)
    np.testing.assert_allclose(bounded_time(t), t / (1 + jnp.abs(t) / 1024), rtol=1e-6)
    np.testing.assert_allclose(bounded_time(-t), -bounded_time(t))
