"""Choosing the next token: greedy, temperature, top-k, top-p, seeds, and the settings' checks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrope.train.sampling import SamplingSettings, filtered_logits, next_tokens

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
        ({"top_k": -1}, "--top_k"),
        ({"top_p": 0.0}, "--top_p"),
        ({"top_p": 1.5}, "--top_p"),
    ],
)
def test_bad_settings_name_their_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        SamplingSettings(**kwargs)
