"""The Pallas flash shear-weight kernel: interpret mode against the float64 formula, and lowering."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.matrix import cases
from jax import export

import jrope
from jrope.attention import shear, shear_flash
from tests.helpers.shear_oracle import reference_logits
from tests.helpers.shear_oracle import setup_encoding as _setup
from tests.test_shear_attention import _compiled

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
    attend = _compiled(shear_flash.shear_flash_attention, enc=enc, block_size=8)
    got = attend(q, k, v, params=params, q_positions=positions, k_positions=positions)
    want = _reference_attention(enc, params, q, k, v, positions, positions)
    np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5)


def _packed_rows(length, batch=2):
    """Two sequences per row (positions restart at a segment id change), offset by 300."""
    first = 7
    positions = jnp.concatenate([jnp.arange(first), jnp.arange(length - first)]) + 300
    segments = jnp.concatenate([jnp.zeros(first, jnp.int32), jnp.ones(length - first, jnp.int32)])
    return jnp.tile(positions, (batch, 1)), jnp.tile(segments, (batch, 1))


def _gradients(kernel, enc, params, q, k, v, positions, segments, cotangent, **options):
    """d/d(params, q, k, v) of sum(attention * cotangent), the queries the last T of S keys."""
    length = q.shape[1]

    def loss(params, q, k, v):
        out = kernel(
            q,
            k,
            v,
            enc=enc,
            params=params,
            q_positions=positions[:, -length:],
            k_positions=positions,
            q_segments=segments[:, -length:],
            k_segments=segments,
            **options,
        )
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    # Jitted: op by op, each interpreted Pallas call would run as many small dispatches.
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(params, q, k, v)
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]


@pytest.mark.parametrize(
    ("name", "queries"),
    cases(
        [
            ("jordan_rope", 20),
            ("jordan_rope", 13),
            ("jordan_exact_m3_c010_eta100_eta1", 20),
            ("direct_sum", 20),
        ],
        (("jordan_rope", 13), ("jordan_exact_m3_c010_eta100_eta1", 20)),
    ),
)
def test_flash_gradients_equal_the_xla_kernels_on_packed_rows(name, queries):
    """Every cotangent (params, q, k, v) of the Pallas backward against the XLA kernel's autodiff.

    Packed rows, 20 keys in blocks of 8 (the last block padded), the queries
    all 20 or the last 13; the XLA kernel runs at HIGHEST, where its logits
    equal the float64 formula (tests/test_shear_attention.py).
    """
    enc, params, q, k, v = _setup(name, 20, batch=2)
    q = q[:, -queries:]
    positions, segments = _packed_rows(20)
    cotangent = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    args = (enc, params, q, k, v, positions, segments, cotangent)
    flash = _gradients(shear_flash.shear_flash_attention, *args, block_size=8)
    xla = _gradients(shear.shear_attention, *args, precision=jax.lax.Precision.HIGHEST)
    for got, want in zip(flash, xla, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_flash_damping_gradient_follows_the_row_coordinates_across_restarts():
    """gamma's cotangent, which the Pallas backward assembles outside its kernels from the
    blocks' origins, against the XLA kernel's autodiff: strong damping (0.2), positions far
    from 0, and restarts inside blocks of 8, where row coordinates and positions part."""
    enc, params, q, k, v = _setup("jordan_rope", 20, batch=2)
    gamma = params["gamma_raw"]
    noise = 0.1 * jax.random.normal(jax.random.PRNGKey(9), gamma.shape)
    params["gamma_raw"] = jnp.full(gamma.shape, np.log(np.expm1(0.2)), jnp.float32) + noise
    runs = [((500, 7), (0, 13)), ((3, 9), (200, 5), (0, 6))]
    positions = jnp.asarray([np.concatenate([a + np.arange(n) for a, n in row]) for row in runs])
    segments = jnp.asarray([np.repeat(np.arange(len(row)), [n for _, n in row]) for row in runs])
    cotangent = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    args = (enc, params, q, k, v, positions.astype(jnp.int32), segments.astype(jnp.int32))
    flash = _gradients(shear_flash.shear_flash_attention, *args, cotangent, block_size=8)
    xla = _gradients(shear.shear_attention, *args, cotangent, precision=jax.lax.Precision.HIGHEST)
    for got, want in zip(flash, xla, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_flash_under_a_device_mesh_equals_one_device():
    """A Pallas call cannot be partitioned automatically: under a (2, 2) mesh the kernel runs in
    shard_map, the two packed rows split over 'data' and replicated over 'fsdp'. Output and every
    cotangent, the replicated parameters' summed over the devices, equal the unsplit call's."""
    enc, params, q, k, v = _setup("jordan_rope", 20, batch=2)
    positions, segments = _packed_rows(20)
    cotangent = jax.random.normal(jax.random.PRNGKey(3), q.shape)
    args = (enc, params, q, k, v, positions, segments, cotangent)

    def attend(q):
        return shear_flash.shear_flash_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            q_positions=positions,
            k_positions=positions,
            q_segments=segments,
            k_segments=segments,
            block_size=8,
        )

    want_out = np.asarray(jax.jit(attend)(q))
    want = _gradients(shear_flash.shear_flash_attention, *args, block_size=8)
    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        assert "shard_map" in str(jax.make_jaxpr(attend)(q))
        got_out = np.asarray(jax.jit(attend)(q))
        got = _gradients(shear_flash.shear_flash_attention, *args, block_size=8)
    np.testing.assert_allclose(got_out, want_out, rtol=0, atol=1e-6)
    for got_grad, want_grad in zip(got, want, strict=True):
        np.testing.assert_allclose(got_grad, want_grad, rtol=0, atol=1e-6 * np.abs(want_grad).max())


def test_flash_gradients_hold_with_xlas_optimizations_on():
    """The tests turn XLA's optimizations off (conftest); on, products may fuse into
    multiply-adds, and the stabilized time lag must not rely on two equal products cancelling.
    eta's cotangent, which only the lag carries, is the one that would show it."""
    enc, params, q, k, v = _setup("jordan_rope", 20)
    positions = jnp.tile(jnp.arange(20) + 65536, (1, 1))
    segments = jnp.zeros((1, 20), jnp.int32)
    cotangent = jax.random.normal(jax.random.PRNGKey(5), q.shape)
    args = (enc, params, q, k, v, positions, segments, cotangent)
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        flash = _gradients(shear_flash.shear_flash_attention, *args, block_size=8)
        xla = _gradients(shear.shear_attention, *args, precision=jax.lax.Precision.HIGHEST)
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
    for got, want in zip(flash, xla, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())


def _outputs_and_gradients(attend, params, q, k, v):
    """attend(params, q, k, v), then d/d(params, q, k, v) of its sum against fixed weights."""
    cotangent = jax.random.normal(jax.random.PRNGKey(11), q.shape, jnp.float32)

    def loss(params, q, k, v):
        out = attend(params, q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    gradient = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, out), grads = gradient(params, q, k, v)
    return [np.asarray(x, np.float64) for x in (out, *jax.tree.leaves(grads))]


def _relative_rms_errors(result, reference):
    return [
        np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(result, reference, strict=True)
    ]


@pytest.mark.parametrize("name", ["jordan_rope", "jordan_exact_m3_c010_eta100_eta1"])
def test_flash_bfloat16_gradients_keep_ropes_own_error(name):
    """bfloat16 q, k, v: output and every cotangent within 1.5x RoPE's own bfloat16 error.

    Errors are relative RMS against the float32 XLA kernel at HIGHEST (packed
    rows at offset 65536); RoPE's are its einsum kernel's in bfloat16 against
    its float32 HIGHEST on one row, its queries scaled to the variant's logit
    RMS (as tests/test_shear_attention.py measures it). RoPE has no parameter
    to compare with: the parameters' cotangents, sums over every pair, are
    held to twice the largest of RoPE's errors.
    """
    length, highest = 64, jax.lax.Precision.HIGHEST
    positions, segments = _packed_rows(length, batch=1)
    rows = dict(
        q_positions=positions + 65536,
        k_positions=positions + 65536,
        q_segments=segments,
        k_segments=segments,
    )
    enc, params, q, k, v = _setup(name, length)

    def shear_kernel(kernel, **options):
        return lambda params, q, k, v: kernel(q, k, v, enc=enc, params=params, **rows, **options)

    reference = _outputs_and_gradients(
        shear_kernel(shear.shear_attention, precision=highest), params, q, k, v
    )
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    flash = shear_kernel(shear_flash.shear_flash_attention, block_size=32)
    got = _relative_rms_errors(_outputs_and_gradients(flash, params, *low), reference)

    rope, rope_params, rq, rk, rv = _setup("rope", length)
    row = jnp.arange(length) + 65536
    causal = np.tril(np.ones((length, length), bool))

    def logit_rms(enc, params, q, k):
        logits = np.asarray(jrope.attention_logits(enc, params, q, k, row, row))
        return np.sqrt(np.mean(logits[..., causal] ** 2))

    rq = rq * logit_rms(enc, params, q, k) / logit_rms(rope, rope_params, rq, rk)

    def rope_kernel(**options):
        return lambda params, q, k, v: jrope.attention.causal_attention(
            q, k, v, enc=rope, params=params, positions=row, kernel="einsum", **options
        )

    rope_reference = _outputs_and_gradients(rope_kernel(precision=highest), rope_params, rq, rk, rv)
    rope_low = [x.astype(jnp.bfloat16) for x in (rq, rk, rv)]
    rope_errors = _relative_rms_errors(
        _outputs_and_gradients(rope_kernel(), rope_params, *rope_low), rope_reference
    )
    output_and_qkv = [got[0], *got[-3:]]
    assert all(e <= 1.5 * r for e, r in zip(output_and_qkv, rope_errors, strict=True)), (
        got,
        rope_errors,
    )
    assert all(e <= 2 * max(rope_errors) for e in got[1:-3]), (got, rope_errors)


def _exported_flash_gradient(monkeypatch, platform, backend, batch, mesh=None) -> str:
    """The MLIR text of jordan_rope's flash attention, forward and backward, exported for
    `platform` with bfloat16 q, k, v [batch, 256, 2, 64] (under `mesh` where given)."""
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

    spec = jax.ShapeDtypeStruct((batch, 256, 2, 64), jnp.bfloat16)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    # Triton's custom call has no compatibility guarantee across jax versions; export says so.
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        exported = export.export(step, platforms=(platform,), disabled_checks=[triton])
        return exported(spec, spec, spec).mlir_module()


@pytest.mark.parametrize(("platform", "backend"), [("tpu", "tpu"), ("cuda", "gpu")])
def test_flash_forward_and_backward_lower_for_tpu_and_cuda(monkeypatch, platform, backend):
    text = _exported_flash_gradient(monkeypatch, platform, backend, batch=1)
    # Three kernels: the forward, and the backward's dK/dV and dQ; no attention dot outside them.
    kernel = "@tpu_custom_call" if platform == "tpu" else "@__gpu$xla.gpu.triton"
    assert text.count(kernel) == 3
    assert not [line for line in text.splitlines() if "dot_general" in line and "256x256" in line]
    assert "HIGHEST" not in text


@pytest.mark.parametrize(("platform", "backend"), [("tpu", "tpu"), ("cuda", "gpu")])
def test_flash_under_a_multi_device_mesh_lowers_per_device(monkeypatch, platform, backend):
    """Under a mesh of two devices the Pallas calls sit inside shard_map's manual computation,
    each device on its batch row: the TPU lowering refuses a Mosaic call it would have to
    partition ('cannot be automatically partitioned')."""
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    text = _exported_flash_gradient(monkeypatch, platform, backend, batch=2, mesh=mesh)
    kernel = "@tpu_custom_call" if platform == "tpu" else "@__gpu$xla.gpu.triton"
    assert text.count(kernel) == 3
    assert "sdy.manual_computation" in text
