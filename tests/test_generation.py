"""jrope.model.generation: sampling filters, cached and recomputed decoding agree, stop tokens, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.tiny_config import tiny_text_config_dict
from jax.sharding import NamedSharding, PartitionSpec

from jrope.model import Transformer
from jrope.model.generation import (
    GenerationSettings,
    Generator,
    SamplingSettings,
    filtered_logits,
    next_tokens,
    pad_prompts,
)
from jrope.train import setup
from jrope.train.config import TrainConfig
from jrope.train.setup import run_encoding

# Probabilities 0.5, 0.3, 0.15, 0.05 for tokens 0..3, in a shuffled order.
PROBS = np.asarray([0.15, 0.5, 0.05, 0.3])
LOGITS = jnp.asarray(np.log(PROBS)[None], jnp.float32)  # [1, 4]


def _draws(settings, count=4000, logits=LOGITS):
    keys = jax.random.split(jax.random.key(settings.seed), count)
    draw = jax.jit(jax.vmap(lambda key: next_tokens(logits, key, settings)[0]))
    return np.asarray(draw(keys))


def test_greedy_is_the_argmax_of_every_row():
    logits = jnp.asarray([[0.1, 2.0, -1.0], [3.0, 0.0, 2.9]])
    tokens = next_tokens(logits, jax.random.key(0), SamplingSettings(temperature=0.0))
    np.testing.assert_array_equal(tokens, [1, 0])
    assert tokens.dtype == jnp.int32


def test_temperature_one_draws_the_model_distribution():
    counts = np.bincount(_draws(SamplingSettings(temperature=1.0)), minlength=4) / 4000
    np.testing.assert_allclose(counts, PROBS, atol=0.03)


def test_low_temperature_sharpens_and_high_temperature_flattens():
    sharp = np.bincount(_draws(SamplingSettings(temperature=0.25)), minlength=4) / 4000
    flat = np.bincount(_draws(SamplingSettings(temperature=4.0)), minlength=4) / 4000
    expected_sharp = PROBS**4 / np.sum(PROBS**4)
    np.testing.assert_allclose(sharp, expected_sharp, atol=0.03)
    assert flat.max() < 0.36 and flat.min() > 0.15


def test_top_k_keeps_the_k_most_likely_tokens():
    kept = np.isfinite(filtered_logits(LOGITS, SamplingSettings(temperature=1.0, top_k=2)))[0]
    np.testing.assert_array_equal(kept, [False, True, False, True])
    drawn = set(_draws(SamplingSettings(temperature=1.0, top_k=2, seed=1)).tolist())
    assert drawn == {1, 3}


@pytest.mark.slow
@pytest.mark.parametrize(
    "top_p, kept_tokens",
    [(0.3, {1}), (0.45, {1}), (0.55, {1, 3}), (0.85, {1, 3, 0}), (0.96, {0, 1, 2, 3})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept_tokens):
    # The tokens more likely than token t must hold less than p for t to stay.
    kept = np.isfinite(filtered_logits(LOGITS, SamplingSettings(temperature=1.0, top_p=top_p)))
    assert set(np.flatnonzero(kept[0]).tolist()) == kept_tokens
    assert set(_draws(SamplingSettings(temperature=1.0, top_p=top_p), count=500).tolist()) <= (
        kept_tokens
    )


@pytest.mark.slow
def test_top_k_and_top_p_together_and_per_row():
    logits = jnp.concatenate([LOGITS, LOGITS[:, ::-1]])  # row 1: tokens reversed
    kept = np.isfinite(filtered_logits(logits, SamplingSettings(1.0, top_k=3, top_p=0.7)))
    np.testing.assert_array_equal(kept, [[False, True, False, True], [True, False, True, False]])


def test_the_seed_decides_the_draws():
    first = _draws(SamplingSettings(temperature=1.0, seed=7), count=64)
    again = _draws(SamplingSettings(temperature=1.0, seed=7), count=64)
    other = _draws(SamplingSettings(temperature=1.0, seed=8), count=64)
    np.testing.assert_array_equal(first, again)
    assert np.any(first != other)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        ({"temperature": -0.5}, "--temperature"),
        ({"temperature": float("nan")}, "--temperature"),
        ({"temperature": float("inf")}, "--temperature"),
        ({"top_k": -1}, "--top_k"),
        ({"top_p": 0.0}, "--top_p"),
        ({"top_p": 1.5}, "--top_p"),
    ],
)
def test_bad_settings_name_their_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingSettings(**kwargs)


VOCAB = 257
PROMPTS = [
    np.asarray([5, 17, 200, 33, 9], np.int32),
    np.asarray([101, 7], np.int32),
    np.asarray([66, 67, 68, 69, 70, 71, 72, 73, 74], np.int32),
]


def _text_model(tmp_path, name="jordan_exact_scaled", **overrides):
    """(cfg, graphdef, params) of a random tiny text model, damping raised to ~0.05."""
    config = tiny_text_config_dict(
        tmp_path, **{"pe.name": name, "model.d_model": 48, "model.num_layers": 2, **overrides}
    )
    cfg = TrainConfig.from_config_dict(config)
    model = Transformer(cfg.model, run_encoding(cfg), VOCAB, rngs=nnx.Rngs(params=0))
    # A random model's tied N(0, 1) embedding makes it repeat its last token with certainty;
    # scaled down, attention and the MLP decide, and sampling has several likely tokens.
    model.embedding[...] = 0.15 * model.embedding[...]
    for block in model.blocks:
        params = block.attn.pe_params
        if "gamma_raw" in params:
            params["gamma_raw"][...] = jnp.full(params["gamma_raw"].shape, -3.0)
        if "eta_raw" in params:
            params["eta_raw"][...] = jnp.full(params["eta_raw"].shape, 0.5)
    graphdef, params = nnx.split(model)
    return cfg, graphdef, params


def _generate(cfg, graphdef, params, prompts, mesh=None, **settings):
    settings = GenerationSettings(**{"rebase_bound": 4, **settings})
    mesh = setup.make_mesh(cfg.mesh) if mesh is None else mesh
    return Generator(graphdef, settings, mesh=mesh, rules=cfg.mesh.rules)(params, prompts)


def _assert_same_rows(got, want):
    assert len(got) == len(want)
    for row, (a, b) in enumerate(zip(got, want, strict=False)):
        np.testing.assert_array_equal(a, b, err_msg=f"row {row}")


@pytest.mark.slow
@pytest.mark.parametrize("offset", [0, 65536])
def test_greedy_with_the_cache_equals_greedy_by_recomputation(tmp_path, offset):
    cfg, graphdef, params = _text_model(tmp_path)
    settings = {"num_tokens": 24, "position_offset": offset}
    cached = _generate(cfg, graphdef, params, PROMPTS, **settings)
    recomputed = _generate(cfg, graphdef, params, PROMPTS, use_cache=False, **settings)
    assert [len(row) for row in cached] == [24, 24, 24]
    _assert_same_rows(cached, recomputed)
    assert len({tuple(row) for row in cached}) > 1  # the prompts lead to different texts


@pytest.mark.slow
def test_seeded_sampling_draws_the_same_tokens_with_and_without_the_cache(tmp_path):
    cfg, graphdef, params = _text_model(tmp_path, name="jordan_exact_scaled_alibi")
    sampling = SamplingSettings(temperature=1.5, top_k=100, top_p=0.95, seed=3)
    settings = {"num_tokens": 20, "sampling": sampling}
    cached = _generate(cfg, graphdef, params, PROMPTS, **settings)
    _assert_same_rows(
        cached, _generate(cfg, graphdef, params, PROMPTS, use_cache=False, **settings)
    )
    greedy = _generate(cfg, graphdef, params, PROMPTS, num_tokens=20)
    assert any(np.any(a != b) for a, b in zip(cached, greedy, strict=False))
    other_seed = SamplingSettings(temperature=1.5, top_k=100, top_p=0.95, seed=4)
    redrawn = _generate(cfg, graphdef, params, PROMPTS, num_tokens=20, sampling=other_seed)
    assert any(np.any(a != b) for a, b in zip(cached, redrawn, strict=False))


@pytest.mark.slow
def test_a_row_stops_after_its_stop_token(tmp_path):
    cfg, graphdef, params = _text_model(tmp_path)
    free = _generate(cfg, graphdef, params, PROMPTS[:2], num_tokens=12)
    stop = int(free[0][3])
    first_stops = [int(np.argmax(row == stop)) if np.any(row == stop) else None for row in free]
    stopped = _generate(cfg, graphdef, params, PROMPTS[:2], num_tokens=12, stop_token=stop)
    for row, first in zip(range(2), first_stops, strict=False):
        want = free[row] if first is None else free[row][: first + 1]
        np.testing.assert_array_equal(stopped[row], want)
    assert len(stopped[0]) <= 4 and stopped[0][-1] == stop


@pytest.mark.slow
def test_the_cache_is_sharded_like_the_activations(tmp_path):
    cfg, graphdef, params = _text_model(tmp_path, **{"mesh.data": 4, "mesh.tensor": 2})
    mesh = setup.make_mesh(cfg.mesh)
    generator = Generator(
        graphdef, GenerationSettings(num_tokens=4), mesh=mesh, rules=cfg.mesh.rules
    )
    tokens, lengths = pad_prompts([np.arange(1, 4 + row, dtype=np.int32) for row in range(8)])
    with jax.set_mesh(mesh):
        _, cache = generator.start(params, tokens, lengths, np.zeros(8, np.int32))
    # Keys [B, N, H, M] and values [B, N, M, H]: batch over data, heads over tensor.
    kv_sharding = NamedSharding(mesh, PartitionSpec("data", "tensor", None, None))
    for array in cache.keys + cache.values:
        assert array.sharding.is_equivalent_to(kv_sharding, 4), array.sharding
    slot_sharding = NamedSharding(mesh, PartitionSpec("data", None))
    assert cache.positions.sharding.is_equivalent_to(slot_sharding, 2)


def test_bad_generation_settings_name_their_flag():
    with pytest.raises(ValueError, match="--num_tokens"):
        GenerationSettings(num_tokens=0)
    with pytest.raises(ValueError, match="--position_offset"):
        GenerationSettings(num_tokens=1, position_offset=-1)
    with pytest.raises(ValueError, match="--rebase_bound"):
        GenerationSettings(num_tokens=1, rebase_bound=0)
    with pytest.raises(ValueError, match="non-empty --prompt"):
        pad_prompts([np.zeros(0, np.int32)])


def test_an_offset_past_the_int32_range_is_refused_before_compiling(tmp_path):
    cfg, graphdef, params = _text_model(tmp_path)
    with pytest.raises(ValueError, match=r"--position_offset=.* an offset of at most 2147483637"):
        _generate(cfg, graphdef, params, PROMPTS[:1], num_tokens=4, position_offset=2**31 - 5)
