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


@pytest.mark.parametrize('order', ORDERS)
def test_complex_closed_form_is_expm_and_obeys_group_law(order):
    gamma, omega, eta = _random_block(order)
    generator = pe_math.complex_generator(gamma, omega, eta, order)

    @jax.jit
    def check(a, b):
        g = lambda d: pe_math.complex_relative_operator(d, gamma, omega, eta, order)
        return g(a), g(b), g(a + b)

    a = 3.0
    ga, gb, gab = check(jnp.float32(a), jnp.float32(11.0))
    np.testing.assert_allclose(
        ga, _expm64(a * np.asarray(generator, np.complex128)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(ga @ gb, gab, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('order', ORDERS)
def test_real_closed_form_is_expm_and_obeys_group_law(order):
    gamma, omega, eta = _random_block(10 + order)
    generator = pe_math.real_generator(gamma, omega, eta, order)
    g = jax.jit(lambda d: pe_math.real_relative_operator(d, gamma, omega, eta, order))
    for a, b in [(0.0, 5.0), (2.0, 7.0), (13.0, 4.0)]:
        np.testing.assert_allclose(
            g(a), _expm64(a * np.asarray(generator, np.float64)), rtol=1e-5, atol=2e-6
        )
        np.testing.assert_allclose(g(a) @ g(b), g(a + b), rtol=1e-5, atol=2e-6)
    # The order-2 real block of math.md section 2: e^{-gamma d} [[R, s R], [0, R]].
    if order == 2:
        d = 6.0
        c, s = np.cos(omega * d), np.sin(omega * d)
        rot = np.array([[c, -s], [s, c]])
        expected = np.exp(-gamma * d) * np.block([[rot, eta * d * rot], [np.zeros((2, 2)), rot]])
        np.testing.assert_allclose(g(d), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('order', ORDERS)
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


@pytest.mark.parametrize('order', ORDERS)
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


@pytest.mark.parametrize('order', ORDERS)
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


def test_rotary_frequencies_and_bounded_time():
    omega = pe_math.rotary_frequencies(4, 16, 10000.0)
    np.testing.assert_allclose(omega, 10000.0 ** (-2.0 * np.arange(4) / 16), rtol=1e-6)
    assert omega.dtype == jnp.float32
    t = jnp.array([-2048.0, -3.0, 0.0, 3.0, 1024.0])
    np.testing.assert_allclose(
        pe_math.bounded_time(t, 1024), t / (1 + jnp.abs(t) / 1024), rtol=1e-6
    )
    np.testing.assert_allclose(pe_math.bounded_time(-t, 1024), -pe_math.bounded_time(t, 1024))
