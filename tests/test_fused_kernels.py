"""The fused kernels on CPU: splash in Pallas interpret mode, and the cuDNN call's arguments.

Splash runs here exactly as on TPU but interpreted; cuDNN cannot run without
an NVIDIA GPU, so its test checks what jrope hands to
`jax.nn.dot_product_attention` by running the same call with XLA's
implementation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrope
from jrope import attention
from jrope.attention import cudnn, splash

LENGTH = 128  # the splash kernel's key blocks are multiples of 128


def _encoding(name):
    cfg = jrope.pe_config_from_name(name, train_context=64)
    return jrope.make_encoding(cfg, num_heads=2, head_dim=16)


def _inputs(batch=2, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    shape = (batch, LENGTH, 2, 16)
    return [jax.random.normal(key, shape).astype(dtype) for key in keys]


def _loss_and_grads(enc, kernel, q, k, v, cotangent):
    positions = jnp.arange(LENGTH)

    def loss(params, q, k, v):
        out = attention.causal_attention(
            q, k, v, enc=enc, params=params, positions=positions, kernel=kernel
        )
        return jnp.vdot(out.astype(jnp.float32), cotangent)

    params = enc.init_params()
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rope", "jordan_exact_scaled"])
def test_splash_equals_xla_in_values_and_gradients(name):
    enc = _encoding(name)
    q, k, v, cotangent = _inputs()
    got_value, got_grads = _loss_and_grads(enc, "splash", q, k, v, cotangent)
    want_value, want_grads = _loss_and_grads(enc, "xla", q, k, v, cotangent)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=False):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    assert jax.tree.leaves(got_grads[0]) or name == "rope"  # the encoding's parameters learn


@pytest.mark.slow
def test_splash_under_a_device_mesh_splits_the_batch():
    # The Mosaic kernel cannot be partitioned automatically: under a mesh it runs in shard_map.
    enc = _encoding("jordan_exact_scaled")
    q, k, v, cotangent = _inputs(batch=4)
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        got_value, got_grads = _loss_and_grads(enc, "splash", q, k, v, cotangent)
        traced = jax.make_jaxpr(
            lambda q, k, v: attention.causal_attention(
                q,
                k,
                v,
                enc=enc,
                params=enc.init_params(),
                positions=jnp.arange(LENGTH),
                kernel="splash",
            )
        )(q, k, v)
    assert "shard_map" in str(traced)
    want_value, want_grads = _loss_and_grads(enc, "xla", q, k, v, cotangent)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=False):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rope", "rope_alibi"])
def test_the_cudnn_call_is_causal_attention_with_alibi_as_its_bias(monkeypatch, name):
    calls = []
    dot_product_attention = jax.nn.dot_product_attention

    def as_cudnn_would(query, key, value, bias=None, **kwargs):
        calls.append((query.dtype, key.dtype, value.dtype, None if bias is None else bias.shape))
        assert kwargs == {"is_causal": True, "implementation": "cudnn"}
        return dot_product_attention(query, key, value, bias, is_causal=True, implementation="xla")

    monkeypatch.setattr(cudnn.jax.nn, "dot_product_attention", as_cudnn_would)
    enc = _encoding(name)
    q, k, v, cotangent = _inputs(dtype=jnp.bfloat16)
    got_value, got_grads = _loss_and_grads(enc, "cudnn", q, k, v, cotangent)
    bf16 = jnp.dtype(jnp.bfloat16)
    assert calls == [(bf16, bf16, bf16, (1, 2, LENGTH, LENGTH) if enc.has_bias else None)]
    want_value, want_grads = _loss_and_grads(enc, "einsum", q, k, v, cotangent)
    # bfloat16 inputs: about three significant digits.
    np.testing.assert_allclose(got_value, want_value, rtol=2e-2)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=False):
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
        np.testing.assert_allclose(
            got.astype(jnp.float32), want.astype(jnp.float32), atol=3e-2 * scale
        )


@pytest.mark.parametrize(
    "length, head_dim, dtype", [(1024, 64, jnp.float32), (256, 32, jnp.bfloat16)]
)
def test_splash_lowers_for_tpu_forward_and_backward(length, head_dim, dtype):
    # Mosaic lowers the kernel here, in Python: block shapes it cannot tile fail now, not on a TPU.
    x = jnp.zeros((4, length, 6, head_dim), dtype)

    def loss(q, k, v):
        return jnp.sum(splash.splash_attention_causal(q, k, v, interpret=False).astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x)
    text = lowered.lower(lowering_platforms=("tpu",)).as_text()
    assert text.count("tpu_custom_call") == 3  # forward, dq, dk and dv


def test_splash_refuses_an_encoding_that_needs_float32_dots():
    """It runs its dots at its own precision, which would lose jordan_rope's lag term on TPU."""
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="splash kernel does not compute jordan_rope's float32"):
        attention.causal_attention(
            q, k, v, enc=_encoding("jordan_rope"), params={}, positions=jnp.arange(q.shape[1]),
            kernel="splash",
        )  # fmt: skip
