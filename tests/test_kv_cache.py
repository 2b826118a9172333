"""The KV cache: prefill + decode steps give the full forward's logits, for every encoding class
(and a packed prompt row continues its last prompt as that prompt alone).

The model is tiny and random, its encoding parameters moved off their
initial values (damping gamma ~ 0.05, for which e^{gamma p} at p = 65536
would overflow float32; nonzero shear and jet gates). The cache's rebase
bound is small, so that its origin moves several times during a test.
Shape legend: B batch, T length, V vocabulary.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.matrix import cases
from helpers.tiny_config import tiny_config
from jax import export

from jrope.model import Transformer, kv_cache
from jrope.train.setup import run_encoding
from tests.helpers.cache_decoding import decoded_output, logit_rms, reference_output, relative_rms
from tests.helpers.shear_oracle import setup_encoding as _shear_setup

VOCAB = 11
PROMPT = 6
LENGTH = 26  # prompt + 20 decode steps
REBASE_BOUND = 4
# One name per encoding class of the issue: every layout, shear and order.
ENCODINGS = (
    "rope",
    "alibi",
    "rope_alibi",
    "damped_rope",
    "direct_sum",
    "jordan_rope",
    "jordan_raw_tau",
    "jordan_exact_scaled_alibi",
    "jordan_exact_m3",
    "jordan_m3",
    "jordan_jetmix_m3_c150_g050_g030",
    "rope_alibi_softcap3",
)
QUICK = ("jordan_exact_scaled_alibi",)  # in the quick loop; the others are marked slow
# The raw-shear encodings whose shear is an exact per-pair weight: every shear time and order.
SHEAR_TERM_ENCODINGS = (
    "jordan_rope",
    "jordan_raw_tau",
    "jordan_exact_m3_eta1",
    "jordan_m3",
    "direct_sum",
    "real_jordan",
    "jordan_rope_alibi",
    "jordan_rope_softcap3",
)


def _model(name, dtype="float32", impl="einsum"):
    """2 layers, 2 heads of 24 (every chain order fits), parameters away from their initial values."""
    cfg = tiny_config(
        **{
            "pe.name": name,
            "model.d_model": 48,
            "model.readout": "all",
            "model.compute_dtype": dtype,
            "model.attention_impl": impl,
            "model.block_size": 4,
        }
    )
    model = Transformer(cfg.model, run_encoding(cfg), VOCAB, rngs=nnx.Rngs(params=0))
    key = jax.random.key(1)
    for layer, block in enumerate(model.blocks):
        for index, (param_name, param) in enumerate(sorted(block.attn.pe_params.items())):
            param_key = jax.random.fold_in(jax.random.fold_in(key, layer), index)
            noise = 0.5 * jax.random.normal(param_key, param.shape)
            base = -3.0 if param_name == "gamma_raw" else param[...]  # softplus(-3) = 0.05
            param[...] = base + noise
    return model


def _tokens(batch=2, length=LENGTH, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (batch, length)), jnp.int32)


@functools.partial(jax.jit, static_argnums=0)
def _full_forward(graphdef, params, tokens, offsets):
    positions = offsets[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return nnx.merge(graphdef, params)(tokens, positions)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def _prefill(graphdef, params, tokens, lengths, offsets, max_length, bound, segment_ids=None):
    model = nnx.merge(graphdef, params)
    return kv_cache.prefill(
        model,
        tokens,
        lengths,
        offsets,
        max_length=max_length,
        rebase_bound=bound,
        segment_ids=segment_ids,
    )


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef, params, cache, tokens):
    return kv_cache.decode_step(nnx.merge(graphdef, params), cache, tokens)


def _cached_logits(
    model, tokens, lengths, offsets, steps=LENGTH - PROMPT, bound=REBASE_BOUND, segment_ids=None
):
    """float32 [B, steps + 1, V]: the logits after the prompt, then after each decoded token.

    Row b's prompt is tokens[b, :lengths[b]] (packed by segment_ids [B, max(lengths)] if
    given); it then decodes the `steps` tokens that follow it. Also returns the origins
    after each step ([steps + 1, B]).
    """
    graphdef, params = nnx.split(model)
    prompt = int(np.max(lengths))
    logits, cache = _prefill(
        graphdef, params, tokens[:, :prompt], lengths, offsets, prompt + steps, bound, segment_ids
    )
    outputs, origins = [logits], [cache.origin]
    rows = jnp.arange(tokens.shape[0])
    for step in range(steps):
        logits, cache = _decode(graphdef, params, cache, tokens[rows, lengths + step])
        outputs.append(logits)
        origins.append(cache.origin)
    return jnp.stack(outputs, 1), np.stack(origins)


def _assert_matches_full_forward(model, offsets, tolerance):
    tokens = _tokens()
    lengths = jnp.full((2,), PROMPT, jnp.int32)
    offsets = jnp.asarray(offsets, jnp.int32)
    cached, origins = _cached_logits(model, tokens, lengths, offsets)
    graphdef, params = nnx.split(model)
    full = _full_forward(graphdef, params, tokens, offsets)[:, PROMPT - 1 : LENGTH]
    assert np.all(np.isfinite(cached))
    error = float(jnp.max(jnp.abs(cached - full)))
    assert error <= tolerance, f"offsets {offsets}: max logit error {error:.3g}"
    # The origin moved several times, and never let a position get more than the bound past it.
    moves = np.sum(np.any(np.diff(origins, axis=0) != 0, axis=1))
    assert moves >= 3
    last_positions = offsets + LENGTH - 1
    assert np.all(last_positions - origins[-1] <= REBASE_BOUND)


@pytest.mark.parametrize(
    "name",
    cases(ENCODINGS, (*QUICK, "rope", "jordan_rope", "jordan_m3"), quick=QUICK),
)
def test_prefill_and_decode_equal_the_full_forward_at_offsets_0_and_65536(name):
    model = _model(name)
    # Per-row offsets: row 1 starts where e^{gamma p} from position 0 would overflow float32.
    _assert_matches_full_forward(model, (0, 65536), tolerance=1e-4)
    _assert_matches_full_forward(model, (65536, 65536 + 17), tolerance=1e-4)


@pytest.mark.slow
def test_a_batch_of_prompts_of_different_lengths_equals_each_prompt_alone():
    model = _model("jordan_exact_m3")
    tokens = _tokens(batch=3, length=9 + 12, seed=3)
    lengths = jnp.asarray((3, 9, 5), jnp.int32)
    offsets = jnp.asarray((0, 40, 65536), jnp.int32)
    batched, _ = _cached_logits(model, tokens, lengths, offsets, steps=12)
    for row in range(3):
        alone, _ = _cached_logits(
            model, tokens[row : row + 1], lengths[row : row + 1], offsets[row : row + 1], steps=12
        )
        error = float(jnp.max(jnp.abs(batched[row] - alone[0])))
        assert error <= 1e-4, f"row {row}: max logit error {error:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name, impl", [("jordan_exact_m3", "einsum"), ("jordan_rope", "shear")])
def test_a_packed_prompt_row_decodes_its_last_prompt_as_that_prompt_alone(name, impl):
    model = _model(name, impl=impl)
    steps = 6
    tokens = _tokens(batch=2, length=9 + steps, seed=4)
    # Row 0 packs prompts of 4 and 5 tokens; row 1 holds one prompt of 8 and a pad (an id of its own).
    segment_ids = jnp.asarray([[3] * 4 + [8] * 5, [1] * 8 + [2]], jnp.int32)
    lengths, offsets = jnp.asarray((9, 8), jnp.int32), jnp.asarray((0, 65536), jnp.int32)
    packed, origins = _cached_logits(model, tokens, lengths, offsets, steps, 4, segment_ids)
    for row, first in ((0, 4), (1, 0)):
        alone, _ = _cached_logits(
            model,
            tokens[row : row + 1, first:],
            lengths[row : row + 1] - first,
            offsets[row : row + 1],
            steps,
        )
        error = float(jnp.max(jnp.abs(packed[row] - alone[0])))
        assert error <= 1e-4, f"row {row}: max logit error {error:.3g}"
    # Row 0 continues its second prompt: positions restart at the row's offset.
    assert origins[0, 0] == 0 + 5 - 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["jordan_exact_scaled_alibi", "jordan_rope"])
def test_bfloat16_cache_tracks_the_bfloat16_full_forward(name):
    # Keys are stored in bfloat16 (jordan_exact_scaled) or float32 (jordan_rope keeps its
    # raw-shear maps in float32) and moved several times; logits are O(50) here (tied
    # embeddings), where one bfloat16 step is 0.25.
    model = _model(name, dtype="bfloat16")
    tokens, offsets = _tokens(), jnp.asarray((0, 65536), jnp.int32)
    cached, _ = _cached_logits(model, tokens, jnp.full((2,), PROMPT, jnp.int32), offsets)
    graphdef, params = nnx.split(model)
    full = _full_forward(graphdef, params, tokens, offsets)[:, PROMPT - 1 : LENGTH]
    scale = float(jnp.max(jnp.abs(full)))
    assert float(jnp.max(jnp.abs(cached - full))) <= 0.005 * scale


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_prefill_fills_the_same_cache_through_any_attention_kernel(impl):
    tokens, offsets = _tokens(length=PROMPT + 4), jnp.asarray((0, 65536), jnp.int32)
    lengths = jnp.asarray((PROMPT, PROMPT - 2), jnp.int32)
    reference = _model("jordan_exact_scaled", impl="einsum")
    other = _model("jordan_exact_scaled", impl=impl)
    got, want = (
        _cached_logits(m, tokens, lengths, offsets, steps=4)[0] for m in (other, reference)
    )
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_decoding_fills_every_slot_and_a_step_past_the_last_gives_nan():
    model = _model("jordan_rope")
    graphdef, params = nnx.split(model)
    tokens, lengths = _tokens(length=PROMPT), jnp.asarray((PROMPT, 2), jnp.int32)
    # Seven slots: row 0's prompt takes six, so one decode step fills the cache.
    logits, cache = _prefill(graphdef, params, tokens, lengths, jnp.zeros((2,), jnp.int32), 7, 4)
    logits, cache = _decode(graphdef, params, cache, tokens[:, 0])
    assert np.all(np.isfinite(logits))
    logits, _ = _decode(graphdef, params, cache, tokens[:, 0])
    assert np.all(np.isnan(logits))
    with pytest.raises(TypeError, match="update shape must be smaller"):  # jax's refusal
        kv_cache.prefill(model, tokens, lengths, lengths, max_length=5, rebase_bound=4)


@pytest.mark.slow
def test_offsets_whose_positions_would_reach_the_empty_marker_are_refused():
    model = _model("jordan_exact_scaled")
    tokens, lengths = _tokens(length=PROMPT), jnp.asarray((PROMPT, 2), jnp.int32)
    offsets = np.asarray([0, kv_cache.EMPTY - 7], np.int64)  # slot 7 of row 1 would be EMPTY
    with pytest.raises(ValueError, match="marks empty slots"):
        kv_cache.prefill(model, tokens, lengths, offsets, max_length=8, rebase_bound=4)
    offsets = np.asarray([0, 2**31], np.int64)
    with pytest.raises(ValueError, match="beyond int32"):
        kv_cache.prefill(model, tokens, lengths, offsets, max_length=8, rebase_bound=4)
    # One slot fewer is accepted: the last position stays below the marker.
    logits, _ = kv_cache.prefill(
        model, tokens, lengths, np.asarray([0, kv_cache.EMPTY - 8]), max_length=8, rebase_bound=4
    )
    assert np.all(np.isfinite(logits))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    cases(SHEAR_TERM_ENCODINGS, ("jordan_rope", "jordan_exact_m3_eta1", "jordan_rope_alibi")),
)
def test_a_cache_of_shear_terms_equals_the_shear_kernels_forward_up_to_offset_2_30(name):
    """attention_impl='shear': the cache stores the keys' shear terms, the decode step weights
    the term dots by the exact time lag, and a rebase moves the terms' pairs elementwise. Its
    logits equal the full forward through the shear kernel (itself equal to the float64 formula
    at these offsets, tests/test_shear_attention.py), and, where float32 maps still resolve the
    lag, the forward through the maps at HIGHEST."""
    model = _model(name, impl="shear")
    assert kv_cache.keeps_shear_terms(model)
    _assert_matches_full_forward(model, (0, 65536), tolerance=1e-4)
    _assert_matches_full_forward(model, (2**30, 2**30 + 17), tolerance=1e-4)
    tokens, offsets = _tokens(), jnp.asarray((0, 65536), jnp.int32)
    cached, _ = _cached_logits(model, tokens, jnp.full((2,), PROMPT, jnp.int32), offsets)
    graphdef, params = nnx.split(_model(name, impl="einsum"))
    full = _full_forward(graphdef, params, tokens, offsets)[:, PROMPT - 1 : LENGTH]
    assert float(jnp.max(jnp.abs(cached - full))) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("offset", [0, 65536, 2**30])
def test_a_bfloat16_decode_step_over_shear_terms_keeps_ropes_own_error(offset):
    """bfloat16 q, k, v, the shear terms stored in bfloat16, their dots at the default precision:
    the decoded output's error against the float64 formula is within 1.5x RoPE's own (its
    queries scaled to the variant's logit RMS)."""
    length = 96
    positions = np.arange(length) + offset
    rope, rope_params, rq, rk, rv = _shear_setup("rope", length)
    for name in ("jordan_rope", "jordan_exact_m3_eta1", "jordan_m3"):
        enc, params, q, k, v = _shear_setup(name, length)
        scale = logit_rms(enc, params, q, k, positions) / logit_rms(
            rope, rope_params, rq, rk, positions
        )
        low = [x.astype(jnp.bfloat16) for x in (rq * scale, rk, rv)]
        reference = reference_output(rope, rope_params, *low, positions)
        options = dict(shear_terms=False, key_dtype=jnp.bfloat16)
        rope_error = relative_rms(
            decoded_output(rope, rope_params, *low, positions, **options), reference
        )
        low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
        reference = reference_output(enc, params, *low, positions)
        options = dict(shear_terms=True, key_dtype=jnp.bfloat16)
        error = relative_rms(decoded_output(enc, params, *low, positions, **options), reference)
        assert error <= 1.5 * rope_error, (name, offset, error, rope_error)


@pytest.mark.parametrize(("platform", "backend"), [("tpu", "tpu"), ("cuda", "gpu")])
@pytest.mark.parametrize(("impl", "highest"), [("auto", False), ("xla", True)])
def test_the_exported_decode_step_has_highest_dots_only_without_shear_terms(
    monkeypatch, platform, backend, impl, highest
):
    """jordan_rope in bfloat16 on TPU and GPU: with 'auto' the cache keeps shear terms and the
    decode step (rebase included) lowers with no HIGHEST dot; with 'xla' it keeps float32 mapped
    keys, whose q . k, p . v and rebase dots run at HIGHEST."""
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    model = _model("jordan_rope", dtype="bfloat16", impl=impl)
    assert kv_cache.keeps_shear_terms(model) is not highest
    graphdef, params = nnx.split(model)
    tokens = _tokens(length=PROMPT)
    lengths, offsets = jnp.full((2,), PROMPT, jnp.int32), jnp.zeros((2,), jnp.int32)
    cache = jax.eval_shape(
        lambda params: kv_cache.prefill(
            nnx.merge(graphdef, params), tokens, lengths, offsets, max_length=16, rebase_bound=4
        )[1],
        params,
    )
    step = jax.jit(lambda params, cache, tokens: _decode(graphdef, params, cache, tokens))
    text = export.export(step, platforms=(platform,))(params, cache, tokens[:, 0]).mlir_module()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert dots
    assert any("HIGHEST" in line for line in dots) is highest
