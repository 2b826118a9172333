"""The synthetic task's data: labels from an independent score, determinism, partition, lengths."""

import dataclasses
import math

import numpy as np
import pytest

from jrope.data import synthetic
from jrope.data.synthetic import SyntheticSource, SyntheticTaskConfig

TRAIN_LEN = 64


def _reference_kernel_value(cfg, d):
    """One kernel value, straight from the formulas of the task's description."""
    L = cfg.seq_len
    w = cfg.theta ** (-2.0 * cfg.freq_index / cfg.head_dim)
    w2 = cfg.theta ** (-2.0 * cfg.second_freq_index / cfg.head_dim)
    x = d / L
    if cfg.kernel == "mixed_raw":
        return x * math.cos(w * d)
    if cfg.kernel == "bounded_mixed":
        return (d / (1 + d / L)) / L * math.cos(w * d)
    if cfg.kernel == "damped_mixed":
        return math.exp(-cfg.damping_gamma * d) * (
            math.cos(w * d) + cfg.damping_sin_weight * x * math.sin(w * d)
        )
    if cfg.kernel == "rhythm_envelope":
        envelope = cfg.envelope_offset + cfg.envelope_slope * x
        return envelope * (
            cfg.carrier_cos_weight * math.cos(w * d) + cfg.carrier_sin_weight * math.sin(w2 * d)
        )
    if cfg.kernel == "high_jet":
        return x**cfg.jet_power * math.cos(w * d)
    assert cfg.kernel == "scaled_high_jet"
    return x**cfg.jet_power * math.exp(-cfg.jet_decay * x) * math.cos(w * d)


def _reference_scores(cfg, inputs):
    """Scores by explicit loops: S = sum_p s_p K(T-1-p), K normalised over d = 1..L-1."""
    norm = math.sqrt(sum(_reference_kernel_value(cfg, d) ** 2 for d in range(1, cfg.seq_len)))
    scores = []
    for row in inputs:
        length = len(row)
        total = 0.0
        for p in range(length - 1):
            total += (2 * int(row[p]) - 1) * _reference_kernel_value(cfg, length - 1 - p) / norm
        scores.append(total)
    return np.array(scores)


def _check_batch_structure(batch, rows, length):
    assert (
        batch["inputs"].shape == batch["targets"].shape == batch["weights"].shape == (rows, length)
    )
    assert batch["inputs"].dtype == np.int32 and batch["targets"].dtype == np.int32
    assert batch["weights"].dtype == np.float32
    assert set(np.unique(batch["inputs"][:, :-1])) <= {synthetic.BIT0, synthetic.BIT1}
    np.testing.assert_array_equal(batch["inputs"][:, -1], synthetic.QUERY)
    expected_weights = np.zeros((rows, length), np.float32)
    expected_weights[:, -1] = 1.0
    np.testing.assert_array_equal(batch["weights"], expected_weights)
    np.testing.assert_array_equal(batch["targets"][:, :-1], 0)


@pytest.mark.parametrize("kernel", synthetic.KERNEL_NAMES)
def test_labels_match_direct_score_at_train_and_eval_lengths(kernel):
    cfg = SyntheticTaskConfig(seq_len=TRAIN_LEN, seed=3, kernel=kernel, head_dim=16)
    source = SyntheticSource(cfg, global_batch_size=8, process_index=0, process_count=1)
    batches = [(source.train_batch(5), TRAIN_LEN)]
    batches += [(next(source.eval_batches(n, 8, 8)), n) for n in (2 * TRAIN_LEN, 8 * TRAIN_LEN)]
    for batch, length in batches:
        _check_batch_structure(batch, 8, length)
        scores = _reference_scores(cfg, batch["inputs"])
        np.testing.assert_allclose(
            synthetic.sequence_scores(cfg, batch["inputs"][:, :-1]), scores, rtol=1e-9, atol=1e-12
        )
        np.testing.assert_array_equal(batch["targets"][:, -1], (scores > 0).astype(np.int32))


def test_kernel_is_unit_norm_on_training_lags_and_keeps_growing():
    cfg = SyntheticTaskConfig(seq_len=256)
    train_lags = np.arange(1, 256)
    assert np.linalg.norm(synthetic.kernel(cfg, train_lags)) == pytest.approx(1.0, rel=1e-12)
    # The envelope d/L is 4x larger around d = 4L than around d = L.
    near_train = np.abs(synthetic.kernel(cfg, np.arange(200, 256))).max()
    far = np.abs(synthetic.kernel(cfg, np.arange(1000, 1056))).max()
    assert far > 3.5 * near_train


def test_same_data_from_new_source_objects_and_different_steps_differ():
    cfg = SyntheticTaskConfig(seq_len=TRAIN_LEN, seed=11)
    first = SyntheticSource(cfg, 6, 0, 1)
    second = SyntheticSource(cfg, 6, 0, 1)
    for step in (0, 7, 123456):
        a, b = first.train_batch(step), second.train_batch(step)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(first.train_batch(1)["inputs"], first.train_batch(2)["inputs"])
    other_seed = SyntheticSource(dataclasses.replace(cfg, seed=12), 6, 0, 1)
    assert not np.array_equal(first.train_batch(1)["inputs"], other_seed.train_batch(1)["inputs"])
    eval_a = list(first.eval_batches(2 * TRAIN_LEN, 12, 6))
    eval_b = list(second.eval_batches(2 * TRAIN_LEN, 12, 6))
    assert len(eval_a) == 2
    for x, y in zip(eval_a, eval_b, strict=False):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
        np.testing.assert_array_equal(x["targets"], y["targets"])
    assert not np.array_equal(eval_a[0]["inputs"], eval_a[1]["inputs"])


def test_eval_data_independent_of_training_data_and_of_batching():
    cfg = SyntheticTaskConfig(seq_len=TRAIN_LEN, seed=0)
    source = SyntheticSource(cfg, 8, 0, 1)
    eval_inputs = next(source.eval_batches(TRAIN_LEN, 8, 8))["inputs"]
    for step in range(4):
        assert not np.array_equal(eval_inputs, source.train_batch(step)["inputs"])
    # Eval sequences do not depend on the global batch size or the process count.
    by_two = np.concatenate([b["inputs"] for b in source.eval_batches(TRAIN_LEN, 8, 2)])
    np.testing.assert_array_equal(by_two, eval_inputs)
    halves = [SyntheticSource(cfg, 8, i, 2) for i in range(2)]
    split = np.concatenate([next(h.eval_batches(TRAIN_LEN, 8, 8))["inputs"] for h in halves])
    np.testing.assert_array_equal(split, eval_inputs)


def test_two_processes_partition_the_global_batch():
    cfg = SyntheticTaskConfig(seq_len=TRAIN_LEN, seed=5, label_mode="stochastic")
    whole = SyntheticSource(cfg, 8, 0, 1).train_batch(9)
    parts = [SyntheticSource(cfg, 8, i, 2).train_batch(9) for i in range(2)]
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])
    rows = [{r.tobytes() for r in p["inputs"]} for p in parts]
    assert len(rows[0]) == len(rows[1]) == 4 and not rows[0] & rows[1]


def test_labels_roughly_balanced_on_mixed_raw():
    cfg = SyntheticTaskConfig(seq_len=256, seed=0)
    source = SyntheticSource(cfg, 100, 0, 1)
    labels = np.concatenate([source.train_batch(step)["targets"][:, -1] for step in range(20)])
    assert labels.size == 2000
    assert 0.45 < labels.mean() < 0.55


def test_stochastic_labels_reproducible_and_noisy():
    cfg = SyntheticTaskConfig(seq_len=TRAIN_LEN, seed=2, label_mode="stochastic", temperature=1.0)
    source = SyntheticSource(cfg, 200, 0, 1)
    batch = source.train_batch(4)
    again = SyntheticSource(cfg, 200, 0, 1).train_batch(4)
    np.testing.assert_array_equal(batch["targets"], again["targets"])
    np.testing.assert_array_equal(
        next(source.eval_batches(128, 200, 200))["targets"],
        next(SyntheticSource(cfg, 200, 0, 1).eval_batches(128, 200, 200))["targets"],
    )
    scores = synthetic.sequence_scores(cfg, batch["inputs"][:, :-1])
    labels = batch["targets"][:, -1]
    agreement = np.mean(labels == (scores > 0))
    # |S| is O(1), so temperature 1 flips a sizeable minority of labels but not half.
    assert 0.55 < agreement < 0.97
    # A vanishing temperature recovers the threshold labels on the same bits.
    cold = SyntheticSource(dataclasses.replace(cfg, temperature=1e-9), 200, 0, 1).train_batch(4)
    np.testing.assert_array_equal(cold["inputs"], batch["inputs"])
    np.testing.assert_array_equal(cold["targets"][:, -1], (scores > 0).astype(np.int32))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seq_len=64, kernel="mixed"), "data.kernel = 'mixed' is not one of"),
        (dict(seq_len=64, label_mode="soft"), "data.label_mode = 'soft' is not one of"),
        (dict(seq_len=1), "seq_len"),
        (dict(seq_len=64, head_dim=16, freq_index=8), "freq_index"),
        (dict(seq_len=64, temperature=0.0), "temperature"),
    ],
)
def test_bad_task_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SyntheticTaskConfig(**kwargs)


def test_bad_source_arguments_raise():
    cfg = SyntheticTaskConfig(seq_len=TRAIN_LEN)
    with pytest.raises(ValueError, match="multiple of process_count"):
        SyntheticSource(cfg, 7, 0, 2)
    with pytest.raises(ValueError, match="process_index"):
        SyntheticSource(cfg, 8, 2, 2)
    with pytest.raises(ValueError, match="divide num_sequences"):
        next(SyntheticSource(cfg, 8, 0, 1).eval_batches(TRAIN_LEN, 10, 4))
    assert SyntheticSource.vocab_size == 3 and SyntheticSource.num_classes == 2
