"""The hand-written VJPs (chunked causal attention, projections) against plain autodiff."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.matrix import cases

import jrope
from jrope.attention import dense
from jrope.model import projection
from jrope.model.config import ModelConfig
from jrope.model.transformer import Transformer


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
    "length, key_length, bias_rank",
    cases(
        [
            (n, m, rank)
            for rank in (None, 3, 4)
            for n, m in ((1, 1), (7, 7), (13, 13), (16, 16), (1, 9), (6, 11))
        ],
        ((1, 1, None), (13, 13, None), (7, 7, 3), (1, 9, 3), (16, 16, 4), (6, 11, 4)),
    ),
)
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
    want = jax.jit(jax.value_and_grad(loss(_naive_causal_attention), argnums=range(len(operands))))(
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
@pytest.mark.parametrize("projection_fn", [projection.contract, projection.cpu_projection])
def test_projection_values_and_gradients_equal_tensordot_autodiff(
    x_shape, kernel_shape, num_contracted, projection_fn
):
    kx, kk, kc = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, x_shape)
    kernel = jax.random.normal(kk, kernel_shape)
    out_shape = x_shape[: len(x_shape) - num_contracted] + kernel_shape[num_contracted:]
    cotangent = jax.random.normal(kc, out_shape)

    def custom(x, kernel):
        return jnp.sum(projection_fn(x, kernel, num_contracted, None) * cotangent)

    def plain(x, kernel):
        return jnp.sum(jnp.tensordot(x, kernel, axes=num_contracted) * cotangent)

    got = jax.value_and_grad(custom, argnums=(0, 1))(x, kernel)
    want = jax.value_and_grad(plain, argnums=(0, 1))(x, kernel)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for got_grad, want_grad in zip(got[1], want[1], strict=False):
        np.testing.assert_allclose(got_grad, want_grad, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_model_with_the_cpu_projection_has_the_default_models_loss_and_gradients():
    cfg = ModelConfig(
        d_model=16,
        num_heads=2,
        num_layers=2,
        mlp_ratio=2,
        compute_dtype="float32",
        attention_impl="einsum",
        blockwise_min_length=4096,
        block_size=8,
        remat="none",
    )
    encoding = jrope.make_encoding(
        jrope.pe_config_from_name("jordan_rope", train_context=12), num_heads=2, head_dim=8
    )
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, 11)
    positions = jnp.arange(12, dtype=jnp.int32)

    def loss_and_grads(projection_fn):
        model = Transformer(cfg, encoding, 11, rngs=nnx.Rngs(params=0), projection=projection_fn)
        graph, params = nnx.split(model, nnx.Param)

        def loss(params):
            logits = nnx.merge(graph, params)(tokens, positions)
            return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - logits[..., 0])

        return jax.jit(jax.value_and_grad(loss))(params)

    (got_loss, got_grads), (want_loss, want_grads) = (
        loss_and_grads(projection.cpu_projection),
        loss_and_grads(projection.contract),
    )
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
