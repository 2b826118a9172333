"""The hand-written VJPs (chunked causal attention, projections) against plain autodiff."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrope.attention import dense
from jrope.model import transformer
from jrope.model.transformer import _project


def _naive_causal_attention(q, k, v, bias):
    """Queries are the last T of the S key positions."""
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        logits = logits + (bias[None] if bias.ndim == 3 else bias)
    length, key_length = q.shape[1], k.shape[1]
    visible = jnp.tril(jnp.ones((key_length, key_length), bool))[key_length - length :]
    probs = jax.nn.softmax(jnp.where(visible[None, None], logits, -1e30), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.slow
@pytest.mark.parametrize(
    "length, key_length", [(1, 1), (7, 7), (13, 13), (16, 16), (1, 9), (6, 11)]
)
@pytest.mark.parametrize("bias_rank", [None, 3, 4])
def test_chunked_attention_matches_naive_values_and_gradients(length, key_length, bias_rank):
    keys = jax.random.split(jax.random.PRNGKey(length), 6)
    q = jax.random.normal(keys[0], (2, length, 3, 4))
    k, v = (jax.random.normal(key, (2, key_length, 3, 4)) for key in keys[1:3])
    cotangent = jax.random.normal(keys[3], (2, length, 3, 4))
    bias = None
    if bias_rank is not None:
        bias = jax.random.normal(keys[4], (2, 3, length, key_length)[4 - bias_rank :])
    operands = (q, k, v) if bias is None else (q, k, v, bias)

    def loss(kernel):
        def inner(*args):
            return jnp.sum(kernel(*args[:3], args[3] if len(args) == 4 else None) * cotangent)

        return inner

    got = jax.jit(jax.value_and_grad(loss(dense.einsum_attention), argnums=range(len(operands))))(
        *operands
    )
    want = jax.value_and_grad(loss(_naive_causal_attention), argnums=range(len(operands)))(
        *operands
    )
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for got_grad, want_grad in zip(got[1], want[1], strict=False):
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "x_shape, kernel_shape, num_contracted",
    [((2, 5, 8), (8, 3, 2, 4), 1), ((2, 5, 2, 4), (2, 4, 8), 2), ((2, 5, 8), (8, 6), 1)],
)
def test_projection_gradients_equal_tensordot_autodiff(x_shape, kernel_shape, num_contracted):
    kx, kk, kc = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, x_shape)
    kernel = jax.random.normal(kk, kernel_shape)
    out_shape = x_shape[: len(x_shape) - num_contracted] + kernel_shape[num_contracted:]
    cotangent = jax.random.normal(kc, out_shape)

    def custom(x, kernel):
        return jnp.sum(_project(x, kernel, num_contracted, None) * cotangent)

    def plain(x, kernel):
        return jnp.sum(jnp.tensordot(x, kernel, axes=num_contracted) * cotangent)

    got = jax.value_and_grad(custom, argnums=(0, 1))(x, kernel)
    want = jax.value_and_grad(plain, argnums=(0, 1))(x, kernel)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for got_grad, want_grad in zip(got[1], want[1], strict=False):
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, custom", [("cpu", True), ("tpu", False), ("gpu", False)])
def test_the_projections_custom_vjp_is_used_on_cpu_only(monkeypatch, backend, custom):
    monkeypatch.setattr(transformer.jax, "default_backend", lambda: backend)
    x, kernel = jnp.ones((2, 5, 8)), jnp.ones((8, 6))
    traced = str(jax.make_jaxpr(lambda x, k: transformer._projection(x, k, 1, None))(x, kernel))
    assert ("custom_vjp_call" in traced) == custom
