"""Every encoding's logits against an oracle, at short and long range, under jax.jit."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrope
import jrope.attention
from jrope import segments
from tests.helpers.shear_oracle import definition_logits

L = 64  # training context of the tiny test encodings
NUM_HEADS, HEAD_DIM = 2, 24

EXACT = (
    "nope",
    "rope",
    "alibi",
    "rope_alibi",
    "damped_rope",
    "jordan_raw_tau",
    "jordan_exact_scaled",
    "jordan_exact_m3",
    "jordan_exact_c150_eta010_alibi",
    "jordan_exact_m3_c010_eta100_eta1",
)
STABILIZED = (
    "jordan_rope",
    "jordan_no_gamma",
    "jordan_m3",
    "jordan_eta020",
    "real_jordan",
    "jordan_jetmix_m4_c150_g050_g030_g020",
    "jordan_jetmixfull_m3_c150_g100_g050_g030",
    "direct_sum",
    "jordan_rope_alibi",
)


def _encoding(name, head_dim=HEAD_DIM):
    return jrope.make_encoding(
        jrope.pe_config_from_name(name, train_context=L), NUM_HEADS, head_dim
    )


def _perturbed(params, seed=0, scale=0.5):
    """Random parameters around the initial ones, so gamma, eta and gates are all nonzero."""
    keys = jax.random.split(jax.random.PRNGKey(seed), max(len(params), 1))
    return {
        name: value + scale * jax.random.normal(key, value.shape)
        for key, (name, value) in zip(keys, sorted(params.items()), strict=False)
    }


def _qk(t, s, head_dim=HEAD_DIM, batch=2, seed=1, dtype=jnp.float32):
    kq, kk = jax.random.split(jax.random.PRNGKey(seed))
    q = jax.random.normal(kq, (batch, t, NUM_HEADS, head_dim)).astype(dtype)
    k = jax.random.normal(kk, (batch, s, NUM_HEADS, head_dim)).astype(dtype)
    return q, k


logits_fn = jax.jit(jrope.attention_logits, static_argnums=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT)
def test_factorized_equals_relative_oracle(name):
    enc = _encoding(name)
    params = _perturbed(enc.init_params())
    q, k = _qk(9, 12)
    q_pos, k_pos = jnp.arange(9) + 5, jnp.arange(12)
    factorized = logits_fn(enc, params, q, k, q_pos, k_pos)
    relative = jax.jit(enc.relative_logits)(params, q, k, q_pos, k_pos)
    np.testing.assert_allclose(factorized, relative, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", STABILIZED + ("jordan_exact_m3", "jordan_raw_tau"))
def test_factorized_equals_reference_formula(name):
    """Stabilized and jet-mix variants against q^T A(-i)^{-1} A(-j) k (not the group law)."""
    enc = _encoding(name)
    params = _perturbed(enc.init_params(), scale=0.3)
    q, k = _qk(5, 6, batch=1)
    q_pos, k_pos = np.arange(5) + 40, np.arange(6) + 37
    factorized = logits_fn(enc, params, q, k, jnp.asarray(q_pos), jnp.asarray(k_pos))
    expected = definition_logits(enc, params, q, k, q_pos, k_pos)
    np.testing.assert_allclose(factorized, expected, rtol=2e-4, atol=2e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", STABILIZED)
def test_stabilized_variants_are_not_translation_invariant(name):
    """The property the exact variants have must really be absent here (else the test above is vacuous)."""
    enc = _encoding(name)
    assert not enc.cfg.is_translation_invariant
    params = _perturbed(enc.init_params(), scale=0.3)
    q, k = _qk(6, 6)
    pos = jnp.arange(6)
    near = logits_fn(enc, params, q, k, pos, pos)
    far = logits_fn(enc, params, q, k, pos + 500, pos + 500)
    assert float(jnp.max(jnp.abs(near - far))) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    (
        "rope",
        "damped_rope",
        "jordan_raw_tau",
        "jordan_exact_scaled",
        "jordan_exact_m3",
        "jordan_exact_c150_eta010_alibi",
    ),
)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16))
def test_exact_variants_are_shift_invariant_to_65536(name, dtype):
    """Same lags, same logits, wherever the window sits: no exponent clamp, no cancellation."""
    enc = _encoding(name)
    params = _perturbed(enc.init_params())
    # gamma ~ 0.05: e^{+gamma p} at p = 65536 would overflow float32 without re-centring.
    if "gamma_raw" in params:
        params["gamma_raw"] = jnp.full_like(params["gamma_raw"], math.log(math.expm1(0.05)))
    q, k = _qk(16, 16, dtype=dtype)
    pos = jnp.arange(16)
    base = logits_fn(enc, params, q, k, pos, pos)
    assert bool(jnp.all(jnp.isfinite(base)))
    for shift in (1000, 16384, 65536 - 16):
        shifted = logits_fn(enc, params, q, k, pos + shift, pos + shift)
        np.testing.assert_array_equal(shifted, base)
    # And against the float32 relative oracle at the far end (the bf16 inputs are exact in fp32).
    oracle = enc.relative_logits(
        params, q.astype(jnp.float32), k.astype(jnp.float32), pos + 65520, pos + 65520
    )
    causal = np.tril(np.ones((16, 16), bool))[None, None]
    tol = 1e-4 if dtype == jnp.float32 else 0.05
    np.testing.assert_allclose(
        np.where(causal, base, 0), np.where(causal, oracle, 0), rtol=tol, atol=tol
    )


@pytest.mark.slow
def test_raw_shear_stays_float32_under_bfloat16_inputs():
    """Raw shear's lag term is a difference of O(p) products: q/k must stay fp32 (docs/numerics.md, section 3)."""
    enc = _encoding("jordan_raw_tau")
    params = enc.init_params()
    params["eta_raw"] = jnp.full_like(params["eta_raw"], 2.0)  # eta ~ 0.096
    q, k = _qk(4, 4, dtype=jnp.bfloat16)
    q2, k2 = enc.transform_qk(params, q, k, jnp.arange(4), jnp.arange(4))
    assert q2.dtype == k2.dtype == jnp.float32
    # Positions far apart inside one window: shear up to eta * 2000.
    q_pos, k_pos = jnp.arange(4) + 4000, jnp.arange(4)
    got = logits_fn(enc, params, q, k, q_pos, k_pos)
    oracle = enc.relative_logits(params, q.astype(jnp.float32), k.astype(jnp.float32), q_pos, k_pos)
    np.testing.assert_allclose(got, oracle, rtol=1e-3, atol=1e-2 * float(jnp.abs(oracle).max()))
    # The scaled variants stay in the activation dtype (their shear is O(T / L)).
    assert (
        _encoding("jordan_exact_scaled")
        .transform_qk(
            _encoding("jordan_exact_scaled").init_params(), q, k, jnp.arange(4), jnp.arange(4)
        )[0]
        .dtype
        == jnp.bfloat16
    )


def test_batched_positions_match_shared_positions():
    enc = _encoding("jordan_exact_c150_eta010_alibi")
    params = _perturbed(enc.init_params())
    q, k = _qk(5, 5)
    pos = jnp.arange(5)
    shared = logits_fn(enc, params, q, k, pos, pos)
    batched = logits_fn(enc, params, q, k, jnp.stack([pos, pos + 300]), jnp.stack([pos, pos + 300]))
    np.testing.assert_allclose(batched, shared, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", EXACT + STABILIZED)
def test_position_zero_is_the_identity(name):
    enc = _encoding(name)
    params = _perturbed(enc.init_params())
    q, k = _qk(1, 1)
    zero = jnp.zeros(1, jnp.int32)
    q2, k2 = enc.transform_qk(params, q, k, zero, zero, origin=0)
    if enc.cfg.jet_base is not None:
        # A learned alpha_0 makes A(0) = alpha_0 I: k scales by alpha_0 and q by 1 / alpha_0.
        alpha = np.repeat(
            np.asarray(enc.physical_params(params)["jet_base"]), 2 * enc.cfg.order, axis=-1
        )
        q2, k2 = q2 * alpha[None, None], k2 / alpha[None, None]
    np.testing.assert_allclose(q2, q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k2, k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ("jordan_no_gamma", "jordan_exact_scaled", "jordan_m3"))
def test_zero_eta_and_zero_gamma_give_rope_on_the_jordan_layout(name):
    cfg = jrope.pe_config_from_name(name, train_context=L, gamma_min=0.0, init_gamma=0.0)
    enc = jrope.make_encoding(cfg, NUM_HEADS, HEAD_DIM)
    params = enc.init_params()
    if "gamma_raw" in params:  # gamma = gamma_min + softplus(-inf) = 0
        params["gamma_raw"] = jnp.full_like(params["gamma_raw"], -jnp.inf)
    params["eta_raw"] = jnp.zeros_like(params["eta_raw"])
    order = enc.cfg.order
    num_blocks = HEAD_DIM // (2 * order)
    q, k = _qk(7, 7)
    pos = jnp.arange(7) * 3
    got = logits_fn(enc, params, q, k, pos, pos)
    # RoPE with each block's frequency repeated over its m chain elements, in the
    # Jordan maps' phase convention (q and k rotated by R(-omega p)).
    omega = -(10000.0 ** (-2.0 * np.arange(num_blocks) / HEAD_DIM))
    angle = np.asarray(pos)[:, None] * np.repeat(omega, order)[None, :]

    def rotate(x):
        x = np.asarray(x, np.float64).reshape(x.shape[:-1] + (HEAD_DIM // 2, 2))
        c, s = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
        return np.stack([c * x[..., 0] - s * x[..., 1], s * x[..., 0] + c * x[..., 1]], -1).reshape(
            x.shape[:-2] + (HEAD_DIM,)
        )

    expected = np.einsum("btnh,bsnh->bnts", rotate(q), rotate(k)) / math.sqrt(HEAD_DIM)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_rope_is_the_textbook_rotation():
    """rope rotates each interleaved pair of q and k by R(+omega_b p), omega_b = theta^(-2b/H)."""
    enc = _encoding("rope")
    q, k = _qk(3, 3)
    pos = jnp.array([0, 5, 900])
    q2, _ = enc.transform_qk({}, q, k, pos, pos, origin=0)
    omega = 10000.0 ** (-2.0 * np.arange(HEAD_DIM // 2) / HEAD_DIM)
    angle = np.asarray(pos)[:, None] * omega[None, :]
    x = np.asarray(q).reshape(q.shape[:-1] + (HEAD_DIM // 2, 2))
    c, s = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]
    expected = np.stack([c * x[..., 0] - s * x[..., 1], s * x[..., 0] + c * x[..., 1]], -1)
    np.testing.assert_allclose(q2, expected.reshape(q.shape), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "num_heads,expected",
    [
        (4, [2**-2, 2**-4, 2**-6, 2**-8]),
        (8, [2.0**-k for k in range(1, 9)]),
        (6, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]),
        (12, [2.0**-k for k in range(1, 9)] + [2**-0.5, 2**-1.5, 2**-2.5, 2**-3.5]),
    ],
)
def test_alibi_slopes(num_heads, expected):
    np.testing.assert_allclose(jrope.alibi_slopes(num_heads), expected, rtol=1e-6)


def test_alibi_bias_values():
    enc = jrope.make_encoding(jrope.pe_config_from_name("alibi", train_context=L), 4, 8)
    bias = enc.logit_bias({}, jnp.arange(3), jnp.arange(3))
    assert bias.shape == (4, 3, 3)
    np.testing.assert_allclose(bias[0], -0.25 * np.array([[0, 0, 0], [1, 0, 0], [2, 1, 0]]))
    assert _encoding("rope").logit_bias({}, jnp.arange(3), jnp.arange(3)) is None


@pytest.mark.parametrize(
    "name",
    (
        "jordan_rope",
        "jordan_exact_m3_c010_eta100_eta1",
        "damped_rope",
        "jordan_jetmixfull_m3_c150_g100_g050_g030",
    ),
)
def test_initial_parameters_are_the_configured_ones(name):
    cfg = jrope.pe_config_from_name(name, train_context=1024, init_gamma=3e-4, init_eta=0.05)
    enc = jrope.make_encoding(cfg, NUM_HEADS, HEAD_DIM)
    phys = enc.physical_params(enc.init_params())
    np.testing.assert_allclose(phys["gamma"], cfg.init_gamma, rtol=1e-6)
    if cfg.shear == "eta":
        np.testing.assert_allclose(phys["eta"], cfg.init_eta, rtol=1e-6)
    if cfg.shear == "jet":
        np.testing.assert_allclose(
            phys["jet_gates"],
            np.asarray(cfg.jet_gates)[:, None, None] + 0 * phys["jet_gates"],
            rtol=1e-6,
        )
        np.testing.assert_allclose(phys["jet_base"], cfg.jet_base, rtol=1e-6)


def test_gamma_initialised_at_its_floor_sits_just_above_it():
    """softplus cannot reach 0: the reference's 1e-8 margin, and a usable gradient."""
    enc = _encoding("jordan_rope")
    phys = enc.physical_params(enc.init_params())
    np.testing.assert_allclose(phys["gamma"], 1e-4 + 1e-8, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    (
        "jordan_rope",
        "jordan_exact_scaled",
        "direct_sum",
        "jordan_jetmixfull_m3_c150_g100_g050_g030",
        "damped_rope",
    ),
)
def test_gradients_reach_every_parameter_and_are_finite(name):
    enc = _encoding(name)
    params = _perturbed(enc.init_params(), scale=0.2)
    q, k = _qk(8, 8)
    pos = jnp.arange(8) + 100

    def loss(p):
        logits = jrope.attention_logits(enc, p, q, k, pos, pos)
        return jnp.sum(jnp.tanh(logits) * jnp.cos(jnp.arange(8.0))[None, None, :, None])

    grads = jax.jit(jax.grad(loss))(params)
    assert set(grads) == set(params) and grads
    for g in grads.values():
        assert bool(jnp.all(jnp.isfinite(g)))
        assert float(jnp.max(jnp.abs(g))) > 0


@pytest.mark.parametrize(
    "name,head_dim,block",
    [
        ("rope", 15, 2),
        ("jordan_rope", 22, 4),
        ("jordan_m3", 16, 6),
        ("jordan_exact_m4", 20, 8),
        ("direct_sum", 20, 8),
    ],
)
def test_head_dim_not_divisible_by_the_block_raises(name, head_dim, block):
    cfg = jrope.pe_config_from_name(name, train_context=L)
    with pytest.raises(ValueError, match=f"head_dim {head_dim} is not divisible by {block}"):
        jrope.make_encoding(cfg, NUM_HEADS, head_dim)


def test_wrong_qk_shapes_raise():
    enc = _encoding("rope")
    q, k = _qk(3, 3, head_dim=16)
    with pytest.raises(ValueError, match="must be"):
        enc.transform_qk({}, q, k, jnp.arange(3), jnp.arange(3))


@pytest.mark.parametrize("dtype", [np.int64, np.uint32])
def test_positions_beyond_int32_are_refused_not_wrapped(dtype):
    enc = _encoding("jordan_rope")
    q, k = _qk(2, 2)
    positions = np.asarray([2**31 - 1, 2**31], dtype)
    with pytest.raises(ValueError, match="beyond int32"):
        enc.transform_qk(enc.init_params(), q, k, positions, positions)
    with pytest.raises(ValueError, match="beyond int32"):
        jrope.attention_logits(enc, enc.init_params(), q, k, positions, positions)


def test_positions_that_go_back_down_within_a_row_are_refused():
    enc = _encoding("jordan_exact_scaled")
    q, k = _qk(4, 4)
    packed = np.asarray([[0, 1, 0, 1], [0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"must not go back down along a row, got 1 -> 0 at"):
        enc.transform_qk(enc.init_params(), q, k, packed, packed)


def test_repeated_or_empty_positions_are_refused():
    """Every kernel decides visibility by position: a repeated one would differ from the
    tokens' order (an index-masked kernel would not let [0, 0]'s first token see its second)."""
    enc = _encoding("rope")
    q, k = _qk(4, 4)
    with pytest.raises(ValueError, match=r"must increase along a row, got 0 -> 0 at index 1"):
        jrope.attention.causal_attention(
            q, k, k, enc=enc, params={}, positions=jnp.array([0, 0, 1, 1]), kernel="einsum"
        )
    with pytest.raises(ValueError, match="zero-size array"):
        enc.transform_qk({}, q[:, :0], k[:, :0], jnp.arange(0), jnp.arange(0))


@pytest.mark.slow
def test_jetmixfull_alpha_0_at_zero_stays_finite_at_its_floor():
    enc = _encoding("jordan_jetmixfull_m3_c150_g100_g050_g030")
    params = dict(_perturbed(enc.init_params(), scale=0.1))
    params["jet_base_raw"] = jnp.zeros_like(params["jet_base_raw"])
    floor = segments.JET_BASE_FLOOR_FRACTION * enc.cfg.jet_gate_max
    np.testing.assert_allclose(np.abs(enc.physical_params(params)["jet_base"]), floor)
    q, k = _qk(8, 8)
    pos = jnp.arange(8)

    def loss(p):
        return jnp.sum(jnp.tanh(jrope.attention_logits(enc, p, q, k, pos, pos)))

    value, grads = jax.value_and_grad(loss)(params)
    assert np.isfinite(value)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads.values())


def test_float32_follows_the_largest_shear_term_not_the_name():
    def encoding(name, max_length):
        cfg = jrope.pe_config_from_name(name, train_context=L)
        return jrope.make_encoding(cfg, NUM_HEADS, HEAD_DIM, max_length=max_length)

    # Scaled shear with eta up to 1 reaches eta * 8L / L = 8 at eight times the training length.
    assert encoding("jordan_exact_scaled_eta1", 8 * L).keeps_float32
    assert encoding("jordan_exact_scaled_eta1", 8 * L).dot_precision == jax.lax.Precision.HIGHEST
    # ... and stays below the rotation (eta 0.1) at the training length.
    assert not encoding("jordan_exact_scaled", L).keeps_float32
    assert encoding("jordan_exact_scaled", L).dot_precision is None
    # Higher orders add (eta tau)^r / r! terms: order 4 passes where order 2 does not.
    assert not encoding("jordan_exact_scaled_eta1", L // 2).keeps_float32
    assert encoding("jordan_exact_m4_eta1", 2 * L).keeps_float32
    # Stabilized shear reads absolute positions, eta L at any length.
    assert encoding("jordan_rope", L).keeps_float32
    assert not encoding("rope", 1 << 20).keeps_float32


def test_the_logit_softcap_caps_the_logits_and_an_identity_hook_adds_no_op():
    plain, capped = _encoding("jordan_rope"), _encoding("jordan_rope_softcap3")
    params = _perturbed(plain.init_params())
    q, k = _qk(8, 8)
    positions = jnp.arange(8)
    logits = jrope.attention_logits(plain, params, 4 * q, k, positions, positions)
    got = jrope.attention_logits(capped, params, 4 * q, k, positions, positions)
    np.testing.assert_allclose(got, 3 * np.tanh(np.asarray(logits) / 3), rtol=1e-5, atol=1e-6)
    assert np.abs(logits).max() > 6  # the cap binds
    assert jrope.encodings.LOGITS in capped.features
    for name in jrope.pe_config.FAMILY_EXAMPLES:
        enc = _encoding(name)
        if not enc.cfg.logit_softcap:
            probe = jnp.zeros((1, NUM_HEADS, 1, 1))
            assert not jax.make_jaxpr(enc.transform_logits)(enc.init_params(), probe).eqns, name
            assert jrope.encodings.LOGITS not in enc.features, name
