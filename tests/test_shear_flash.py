"""The Pallas flash shear-weight kernel: interpret mode against the float64 formula, and lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jrope
from jrope.attention import shear, shear_flash
from tests.helpers.shear_oracle import reference_logits
from tests.test_shear_attention import _setup

pytestmark = pytest.mark.slow  # Pallas interpret mode: tens of seconds per call on 2 CPU cores


def _reference_attention(enc, params, q, k, v, q_positions, k_positions):
    """float64 softmax(logits + causal mask) v from the float64 formula."""
    logits = reference_logits(enc, params, q, k, q_positions, k_positions)
    visible = np.asarray(k_positions)[None, :] <= np.asarray(q_positions)[:, None]
    logits = np.where(visible, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", weights, np.asarray(v, np.float64))


@pytest.mark.parametrize("name", ["jordan_rope", "jordan_exact_m3_c010_eta100_eta1", "direct_sum"])
def test_flash_equals_the_float64_formula_in_interpret_mode(name):
    enc, params, q, k, v = _setup(name, 24)
    positions = jnp.arange(24) + 65536
    got = shear_flash.shear_flash_attention(
        q, k, v, enc=enc, params=params, q_positions=positions, k_positions=positions, block_size=8
    )
    want = _reference_attention(enc, params, q, k, v, positions, positions)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5)


def test_flash_gradients_equal_the_xla_kernels():
    enc, params, q, k, v = _setup("jordan_rope", 20)
    positions = jnp.arange(20) + 300
    cotangent = jax.random.normal(jax.random.PRNGKey(3), q.shape)

    def loss(kernel, params, q, k, v):
        out = kernel(q, k, v, enc=enc, params=params, q_positions=positions, k_positions=positions)
        return jnp.sum(out * cotangent)

    flash = jax.tree.map(
        np.asarray,
        jax.grad(lambda *a: loss(shear_flash.shear_flash_attention, *a), argnums=(0, 1, 2, 3))(
            params, q, k, v
        ),
    )
    xla = jax.grad(lambda *a: loss(shear.shear_attention, *a), argnums=(0, 1, 2, 3))(
        params, q, k, v
    )
    for got, want in zip(jax.tree.leaves(flash), jax.tree.leaves(xla), strict=True):
        np.testing.assert_allclose(got, np.asarray(want), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("platform", "backend"), [("tpu", "tpu"), ("cuda", "gpu")])
def test_flash_forward_and_backward_lower_for_tpu_and_cuda(monkeypatch, platform, backend):
    cfg = jrope.pe_config_from_name("jordan_rope", train_context=256)
    enc = jrope.make_encoding(cfg, 2, 64)
    params, positions = enc.init_params(), jnp.arange(256)

    def loss(q, k, v):
        out = shear_flash.shear_flash_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            q_positions=positions,
            k_positions=positions,
            interpret=False,
        )
        return jnp.sum(out.astype(jnp.float32))

    spec = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    # Triton's custom call has no compatibility guarantee across jax versions; export says so.
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = export.export(
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
        platforms=(platform,),
        disabled_checks=[triton],
    )(spec, spec, spec)
    text = exported.mlir_module()
    assert ("tpu_custom_call" in text) if platform == "tpu" else ("xla.gpu.triton" in text)
    assert "HIGHEST" not in text
