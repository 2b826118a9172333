"""Key-value retrieval data: the label is recoverable, distances are placed, determinism, partition."""

import dataclasses

import numpy as np
import pytest

from jrope.data import retrieval
from jrope.data.retrieval import RetrievalConfig, RetrievalSource
from jrope.data.source import DistanceEvaluation

CFG = RetrievalConfig(seq_len=64, seed=2, num_pairs=6, num_keys=10, num_values=7)


def _answer_from_sequence(cfg, tokens):
    """(value token, distance) read off a sequence by hand: the queried key's earlier occurrence."""
    key = tokens[-1]
    (positions,) = np.nonzero(tokens[:-2] == key)
    assert positions.size == 1  # the keys of a sequence are distinct
    return tokens[positions[0] + 1], len(tokens) - 1 - positions[0]


def _check_structure(cfg, tokens):
    length = len(tokens)
    assert tokens[0] == retrieval.BOS and tokens[-2] == retrieval.QUERY
    first_value = retrieval.FIRST_KEY + cfg.num_keys
    is_key = (tokens >= retrieval.FIRST_KEY) & (tokens < first_value)
    is_value = tokens >= first_value
    body = tokens[1:-2]
    key_positions = np.nonzero(is_key[1:-2])[0] + 1
    assert key_positions.size == cfg.num_pairs and key_positions.max() <= length - 5
    assert len(set(tokens[key_positions])) == cfg.num_pairs
    np.testing.assert_array_equal(np.nonzero(is_value)[0], key_positions + 1)  # value after key
    filler = body[~(is_key[1:-2] | is_value[1:-2])]
    assert set(filler) <= {retrieval.PAD, retrieval.BOS, retrieval.QUERY, retrieval.NOISE}
    assert tokens.max() < cfg.vocab_size


def test_filler_draws_all_four_special_tokens_uniformly_as_the_reference_does():
    """The reference fills every free position with a uniform draw from PAD, BOS, QUERY, NOISE."""
    batch = RetrievalSource(CFG, 64, 0, 1).train_batch(0)
    first_key = retrieval.FIRST_KEY
    body = batch["inputs"][:, 1:-2]
    filler = body[body < first_key]
    counts = np.bincount(filler, minlength=first_key)
    # ~ 64 * (61 - 2 * num_pairs) draws; each token's share within 4 standard deviations of 1/4
    share = counts / counts.sum()
    sd = np.sqrt(0.25 * 0.75 / counts.sum())
    np.testing.assert_array_less(np.abs(share - 0.25), 4 * sd)


def test_label_is_recoverable_from_the_sequence():
    source = RetrievalSource(CFG, 16, 0, 1)
    assert source.task == "classification" and source.vocab_size == source.num_classes == 21
    distances = []
    for step in range(5):
        batch = source.train_batch(step)
        assert batch["inputs"].shape == (16, 64) and batch["inputs"].dtype == np.int32
        for tokens, targets, weights in zip(
            batch["inputs"], batch["targets"], batch["weights"], strict=False
        ):
            _check_structure(CFG, tokens)
            value, distance = _answer_from_sequence(CFG, tokens)
            assert targets[-1] == value and not targets[:-1].any()
            np.testing.assert_array_equal(weights, np.eye(64, dtype=np.float32)[-1])
            distances.append(distance)
    # training distances cover [4, T - 2]
    assert min(distances) >= 4 and max(distances) <= 62 and len(set(distances)) > 30


def test_distance_evaluation_places_the_target_pair():
    cfg = dataclasses.replace(CFG, eval_distances=(4, 16, 40, 62, 64, 500))
    source = RetrievalSource(cfg, 4, 0, 1)
    assert isinstance(source, DistanceEvaluation)
    assert source.eval_distances(64) == (4, 16, 40) and source.eval_distances(600) == (
        4,
        16,
        40,
        62,
        64,
        500,
    )
    for distance in (4, 16, 40, 62):
        for batch in source.distance_eval_batches(64, distance, 8, 4):
            for tokens, targets in zip(batch["inputs"], batch["targets"], strict=False):
                _check_structure(cfg, tokens)
                assert _answer_from_sequence(cfg, tokens) == (targets[-1], distance)
    with pytest.raises(ValueError, match="does not fit"):
        next(source.distance_eval_batches(64, 63, 4, 4))


def test_dense_sequences_always_find_room():
    cfg = RetrievalConfig(seq_len=20, num_pairs=5, num_keys=5, num_values=3)  # 3 * 5 = 20 - 5
    source = RetrievalSource(cfg, 32, 0, 1)
    for tokens in source.train_batch(0)["inputs"]:
        _check_structure(cfg, tokens)
    with pytest.raises(ValueError, match="no sure room for 6 pairs"):
        dataclasses.replace(cfg, num_pairs=6, num_keys=6)
    with pytest.raises(ValueError, match="no sure room"):
        next(RetrievalSource(CFG, 4, 0, 1).eval_batches(16, 4, 4))


def test_same_data_from_new_sources_and_disjoint_streams():
    first, second = RetrievalSource(CFG, 4, 0, 1), RetrievalSource(CFG, 4, 0, 1)
    first.train_batch(0)
    for step in (1, 77):
        a, b = first.train_batch(step), second.train_batch(step)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(first.train_batch(1)["inputs"], first.train_batch(2)["inputs"])
    reseeded = RetrievalSource(dataclasses.replace(CFG, seed=3), 4, 0, 1)
    assert not np.array_equal(first.train_batch(1)["inputs"], reseeded.train_batch(1)["inputs"])
    plain = next(first.eval_batches(64, 4, 4))["inputs"]
    at_distance = next(first.distance_eval_batches(64, 20, 4, 4))["inputs"]
    assert not np.array_equal(plain, first.train_batch(0)["inputs"])
    assert not np.array_equal(plain, at_distance)
    by_two = np.concatenate([b["inputs"] for b in second.eval_batches(64, 4, 2)])
    np.testing.assert_array_equal(by_two, plain)


def test_two_processes_partition_the_global_batch():
    whole = RetrievalSource(CFG, 6, 0, 1).train_batch(3)
    parts = [RetrievalSource(CFG, 6, i, 2).train_batch(3) for i in range(2)]
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
    whole = next(RetrievalSource(CFG, 6, 0, 1).distance_eval_batches(64, 9, 6, 6))
    parts = [next(RetrievalSource(CFG, 6, i, 2).distance_eval_batches(64, 9, 6, 6)) for i in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), whole["inputs"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_pairs=11), r"data.num_pairs must be an integer in \[1, 10\], got 11"),
        (dict(num_values=0), r"data.num_values must be an integer in \[1, "),
        (dict(eval_distances=(2,)), r"data.eval_distances must be a tuple of integers in \[4, "),
        (dict(source="synthetic"), "data.source = 'synthetic' is not one of"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CFG, **kwargs)
