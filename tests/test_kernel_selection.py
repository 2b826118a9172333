"""choose_kernel: the kernel 'auto' takes on each backend, the refusals, and the one-origin bound."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_config import tiny_config

import jrope
from jrope import attention
from jrope.attention import selection
from jrope.train.setup import run_encoding


def _model_cfg(**changes):
    base = dataclasses.replace(
        tiny_config().model.attention,
        attention_impl="auto",
        blockwise_min_length=4096,
        max_damping=0.02,
    )
    return dataclasses.replace(base, **changes)


def _encoding(name, head_dim=48):
    cfg = jrope.pe_config_from_name(name, train_context=1024)
    return jrope.make_encoding(cfg, num_heads=2, head_dim=head_dim)


BF16 = {"compute_dtype": "bfloat16"}


@pytest.mark.parametrize(
    "backend, name, length, changes, expected",
    [
        # CPU: today's choice, einsum below blockwise_min_length, blockwise from it on.
        ("cpu", "rope", 1024, {}, "einsum"),
        ("cpu", "rope_alibi", 1024, {}, "einsum"),
        ("cpu", "rope", 4096, {}, "blockwise"),
        ("cpu", "rope", 8192, {"blockwise_min_length": 1 << 20}, "einsum"),
        # ... except where one origin would overflow: 0.02 * 8192 > 80.
        ("cpu", "jordan_exact_scaled", 8192, {"blockwise_min_length": 1 << 20}, "blockwise"),
        # TPU: splash where it applies.
        ("tpu", "rope", 1024, {}, "splash"),
        ("tpu", "damped_rope", 1024, BF16, "splash"),
        ("tpu", "jordan_exact_scaled", 2048, {}, "splash"),
        ("tpu", "jordan_exact_scaled", 8192, {"blockwise_min_length": 1 << 20}, "blockwise"),
        ("tpu", "rope", 1000, {}, "xla"),  # not a multiple of 128
        ("tpu", "rope_alibi", 1024, {}, "einsum"),  # a bias
        # The raw shear: its exact per-pair weight, in place of float32 HIGHEST dots.
        ("tpu", "jordan_raw_tau", 1024, {}, "shear"),
        ("tpu", "jordan_rope", 1024, BF16, "shear"),
        ("tpu", "direct_sum", 512, BF16, "shear"),
        ("tpu", "jordan_rope", 8192, BF16, "shear_flash"),  # memory linear in length
        ("gpu", "jordan_raw_tau", 4096, BF16, "shear_flash"),
        ("tpu", "jordan_jetmix_m3_c150_g050_g030", 1024, BF16, "xla"),  # gated jets: not covered
        ("tpu", "rope", 1024, {"attention_precision": "highest"}, "xla"),
        ("tpu", "rope", 8192, {}, "splash"),  # memory linear: no blockwise needed
        # GPU: cuDNN for bfloat16 runs where it applies.
        ("gpu", "rope", 1024, BF16, "cudnn"),
        ("gpu", "rope_alibi", 1024, BF16, "cudnn"),  # ALiBi as cuDNN's bias
        ("gpu", "jordan_exact_scaled", 1024, BF16, "cudnn"),
        ("gpu", "rope", 1024, {}, "xla"),  # float32: cuDNN takes 16-bit inputs only
        ("gpu", "rope_alibi", 1024, {}, "einsum"),
        ("gpu", "jordan_raw_tau", 1024, BF16, "shear"),
        ("gpu", "jordan_exact_m3_eta1", 1024, BF16, "shear"),
        ("cpu", "jordan_raw_tau", 1024, BF16, "einsum"),  # CPU dots are float32 dots
        ("gpu", "rope", 8192, {}, "blockwise"),
        (
            "gpu",
            "jordan_exact_scaled",
            8192,
            {**BF16, "blockwise_min_length": 1 << 20},
            "blockwise",
        ),
    ],
)
def test_auto_chooses_by_backend_encoding_and_length(backend, name, length, changes, expected):
    kernel = attention.choose_kernel(
        _model_cfg(**changes), _encoding(name), length=length, backend=backend
    )
    assert kernel == expected


@pytest.mark.parametrize("backend", ["tpu", "gpu"])
def test_auto_reads_out_the_last_position_with_a_dense_kernel(backend):
    kernel = attention.choose_kernel(
        _model_cfg(**BF16), _encoding("rope"), length=1024, num_queries=1, backend=backend
    )
    assert kernel == "xla"


def test_auto_keeps_cudnn_within_its_head_dims():
    cfg = dataclasses.replace(_model_cfg(**BF16), head_dim=144)
    assert attention.choose_kernel(cfg, _encoding("rope", 144), length=512, backend="gpu") == "xla"


@pytest.mark.parametrize(
    "impl, backend, name, changes, reason",
    [
        ("splash", "cpu", "rope", {}, "runs on TPU only and this run is on cpu"),
        ("cudnn", "tpu", "rope", BF16, "runs on GPU only"),
        (
            "cudnn",
            "gpu",
            "rope",
            {},
            r"bfloat16 or float16 only; set model\.compute_dtype='bfloat16'",
        ),
        (
            "splash",
            "tpu",
            "rope_alibi",
            {},
            "splash kernel does not compute rope_alibi's logit bias",
        ),
        ("splash", "tpu", "jordan_raw_tau", {}, "not compute jordan_raw_tau's float32 dots"),
        ("cudnn", "gpu", "jordan_rope", BF16, "not compute jordan_rope's float32 dots"),
        ("xla", "cpu", "alibi", {}, "the kernels that do: einsum, blockwise, cudnn, shear"),
        ("shear", "tpu", "jordan_jetmix_m3_c150_g050_g030", {}, "gated shear"),
        ("shear_flash", "tpu", "jordan_exact_c150_eta010_alibi", {}, "logit bias"),
    ],
)
def test_an_explicit_kernel_that_cannot_run_is_refused_with_the_reason(
    impl, backend, name, changes, reason
):
    with pytest.raises(ValueError, match=reason):
        attention.choose_kernel(
            _model_cfg(attention_impl=impl, **changes),
            _encoding(name),
            length=1024,
            backend=backend,
        )


def test_explicit_fused_kernels_are_taken_where_they_apply():
    cfg = _model_cfg(attention_impl="splash")
    assert attention.choose_kernel(cfg, _encoding("rope"), length=256, backend="tpu") == "splash"
    cfg = _model_cfg(attention_impl="cudnn", **BF16)
    assert attention.choose_kernel(cfg, _encoding("rope"), length=256, backend="gpu") == "cudnn"


def test_the_shear_kernels_dots_run_at_the_default_precision_and_the_maps_at_highest():
    enc, settings = _encoding("jordan_raw_tau"), _model_cfg(**BF16)
    assert enc.keeps_float32 and enc.dot_precision == jax.lax.Precision.HIGHEST
    assert attention.attention_precision(settings, enc, "xla") == jax.lax.Precision.HIGHEST
    assert attention.attention_precision(settings, enc, "shear") is None
    highest = dataclasses.replace(settings, attention_precision="highest")
    assert attention.attention_precision(highest, enc, "shear") == jax.lax.Precision.HIGHEST


def test_the_one_origin_bound_is_max_damping_times_length_80():
    damped, undamped = _encoding("jordan_exact_scaled"), _encoding("rope")
    assert selection.single_origin_is_safe(damped, 0.01, 8000)
    assert not selection.single_origin_is_safe(damped, 0.01, 8001)
    assert selection.single_origin_is_safe(undamped, 0.01, 1 << 30)


def test_the_kernel_choice_follows_the_span_of_the_positions_and_the_measured_damping():
    cfg = _model_cfg(max_damping=0.02)
    damped = _encoding("jordan_exact_scaled")
    assert attention.choose_kernel(cfg, damped, length=64, backend="cpu") == "einsum"
    # Far apart positions: 64 keys spanning 5039 positions.
    assert attention.choose_kernel(cfg, damped, length=64, span=5039, backend="cpu") == "blockwise"
    # A learned damping past model.max_damping: 0.5 * 512 is far past float32's e^88.
    assert attention.choose_kernel(cfg, damped, length=512, damping=0.5, backend="cpu") == (
        "blockwise"
    )
    for backend in ("tpu", "gpu"):
        assert (
            attention.choose_kernel(cfg, damped, length=512, damping=0.5, backend=backend)
            == "blockwise"
        )
    with pytest.raises(ValueError, match="damping of 0.5 overflows"):
        attention.choose_kernel(
            _model_cfg(attention_impl="einsum"), damped, length=512, damping=0.5, backend="cpu"
        )
    with pytest.raises(ValueError, match="damping of 0.5 overflows float32"):
        attention.choose_kernel(
            _model_cfg(attention_impl="splash"),
            _encoding("jordan_exact_scaled"),
            length=512,
            damping=0.5,
            backend="tpu",
        )


@functools.cache
def _damped_attention(kernel: str, length: int):
    """jit(params) -> attention output of jordan_exact_scaled over `length` fixed inputs."""
    enc = _encoding("jordan_exact_scaled", 16)
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (1, length, 2, 16)) for key in keys)
    return enc, jax.jit(
        lambda params: attention.causal_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            positions=jnp.arange(length),
            kernel=kernel,
            block_size=64,
        )
    )


def _attend_with_damping(kernel: str, gamma: float, length: int) -> np.ndarray:
    """Attention output of jordan_exact_scaled with every damping set to `gamma`."""
    enc, attend = _damped_attention(kernel, length)
    params = enc.init_params()
    # gamma = softplus(gamma_raw) (gamma_min is 0 for the scaled-exact variant).
    params["gamma_raw"] = jnp.full_like(params["gamma_raw"], np.log(np.expm1(gamma)))
    return np.asarray(attend(params))


@pytest.mark.slow
def test_one_origin_is_finite_within_the_bound_and_overflows_beyond_it():
    length = 256
    # gamma * S = 80: one origin (the einsum kernel) agrees with the blockwise kernel.
    within = _attend_with_damping("einsum", 80.0 / length, length)
    np.testing.assert_allclose(
        within, _attend_with_damping("blockwise", 80.0 / length, length), rtol=2e-4, atol=2e-5
    )
    # gamma * S = 200: e^{gamma S / 2} = e^100 is past float32; blockwise stays finite.
    assert not np.all(np.isfinite(_attend_with_damping("einsum", 200.0 / length, length)))
    assert np.all(np.isfinite(_attend_with_damping("blockwise", 200.0 / length, length)))


def test_the_blockwise_blocks_and_the_cache_rebase_bound_carry_a_measured_damping():
    # e^(0.5 * 511) is past float32; e^(0.5 * 127) is not, and 128 is a power of two.
    assert selection.blockwise_block_size(512, 0.5) == 128
    assert selection.blockwise_block_size(512, 0.02) == 512
    assert selection.blockwise_block_size(512, None) == 512
    assert selection.blockwise_block_size(512, 1e6) == 1
    assert selection.cache_rebase_bound(1024, 0.01) == 1024  # e^10.24: the cache keeps its bound
    assert selection.cache_rebase_bound(1024, 0.5) == 160  # e^512 would overflow: e^80 at most


def _model_with_damping(gamma: float, **model_changes):
    """A tiny Transformer whose every head has damping `gamma` (past model.max_damping 0.02)."""
    from flax import nnx

    from jrope.model.transformer import Transformer

    cfg = tiny_config(**{f"model.{key}": value for key, value in model_changes.items()})
    model = Transformer(cfg.model, run_encoding(cfg), 11, rngs=nnx.Rngs(params=0))
    raw = np.log(np.expm1(gamma - cfg.pe.gamma_min))
    for block in model.blocks:
        gamma_raw = block.attn.pe_params["gamma_raw"]
        gamma_raw[...] = jnp.full_like(gamma_raw[...], raw)
    return model


def _jitted_logits(model, tokens):
    from flax import nnx

    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t, jnp.arange(t.shape[1])))
    return np.asarray(forward(state, tokens))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["auto", "blockwise"])
def test_a_model_following_its_damping_past_the_bound_is_exact_under_jit(impl):
    gamma, length = 0.5, 512
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, length), 0, 11)
    model = _model_with_damping(gamma, attention_impl=impl, block_size=512)
    # Planned for model.max_damping alone, a jitted model overflows float32 at this damping:
    # one origin over 512 positions, or blocks of 512 (e^(0.5 * 511)).
    assert not np.all(np.isfinite(_jitted_logits(model, tokens)))
    assert model.follow_damping() == pytest.approx(gamma, rel=1e-5)
    followed = _jitted_logits(model, tokens)
    # The reference: the blockwise kernel in blocks of 32, far within the damping's reach.
    reference = _jitted_logits(
        _model_with_damping(gamma, attention_impl="blockwise", block_size=32), tokens
    )
    assert np.all(np.isfinite(followed))
    np.testing.assert_allclose(followed, reference, rtol=1e-4, atol=1e-4)
    # An eager call measures by itself and runs in the same blocks.
    eager = model(tokens, jnp.arange(length))
    np.testing.assert_allclose(np.asarray(eager), reference, rtol=1e-4, atol=1e-4)
