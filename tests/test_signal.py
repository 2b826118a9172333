"""Signal regression data: kernels against their formulas, the convolution, determinism, partition."""

import dataclasses
import math

import numpy as np
import pytest

from jrope.data import signal
from jrope.data.signal import SignalRegressionConfig, SignalRegressionSource

TRAIN_LEN = 48


def _formula(kernel, d, cfg):
    """K(d) before normalisation, written out from the task's description."""
    L = cfg.seq_len
    w = cfg.theta ** (-2.0 * cfg.freq_index / cfg.head_dim)
    w2 = cfg.theta ** (-2.0 * cfg.second_freq_index / cfg.head_dim)
    x = d / L
    if kernel == "seasonal_trend":
        return (0.35 + 0.9 * x) * math.cos(w * d) + 0.25 * math.sin(w * d)
    if kernel == "damped_wave":
        return math.exp(-cfg.gamma * d) * (math.cos(w * d) + 0.75 * x * math.sin(w * d))
    if kernel == "rhythm_envelope":
        return (0.25 + 0.85 * x) * (0.65 * math.cos(w * d) + 0.35 * math.sin(w2 * d))
    assert kernel == "motif_spacing"
    return x / (1 + 0.25 * x) * (0.7 * math.cos(w2 * d) - 0.3 * math.sin(w2 * d))


@pytest.mark.parametrize("kernel", signal.SIGNAL_KERNELS)
def test_kernels_match_their_formulas_and_normalisation(kernel):
    # gamma large enough that the damping shows within the lags checked
    cfg = SignalRegressionConfig(seq_len=TRAIN_LEN, kernel=kernel, head_dim=16, gamma=0.01)
    lags = np.arange(0, 5 * TRAIN_LEN)
    norm = math.sqrt(sum(_formula(kernel, d, cfg) ** 2 for d in range(1, TRAIN_LEN)))
    expected = [0.0] + [_formula(kernel, d, cfg) / norm for d in lags[1:]]
    np.testing.assert_allclose(cfg.kernel_values(lags), expected, rtol=1e-12, atol=1e-15)
    assert np.linalg.norm(cfg.kernel_values(np.arange(TRAIN_LEN))) == pytest.approx(1.0)


def test_targets_are_the_causal_convolution_of_the_inputs():
    cfg = SignalRegressionConfig(seq_len=TRAIN_LEN, kernel="rhythm_envelope", input_channels=2)
    batch = SignalRegressionSource(cfg, 3, 0, 1).train_batch(5)
    inputs, targets = batch["inputs"].astype(np.float64), batch["targets"]
    assert inputs.shape == targets.shape == (3, TRAIN_LEN, 2) and targets.dtype == np.float32
    kernel = cfg.kernel_values(np.arange(TRAIN_LEN))
    for i in range(TRAIN_LEN):
        # y_i = sum_{j < i} K(i - j) x_j; the inputs are float32 in the batch
        direct = sum(kernel[i - j] * inputs[:, j] for j in range(i)) if i else 0.0 * inputs[:, 0]
        np.testing.assert_allclose(targets[:, i], direct, rtol=1e-5, atol=1e-5)
    assert np.abs(targets[:, 0]).max() < 1e-12  # K(0) = 0: nothing before the first input
    np.testing.assert_array_equal(batch["weights"], np.ones((3, TRAIN_LEN), np.float32))
    # Long sequences: the FFT convolution stays exact to float64 rounding.
    x = np.random.default_rng(0).standard_normal((1, 4096, 1))
    long_kernel = cfg.kernel_values(np.arange(4096))
    direct = np.convolve(x[0, :, 0], long_kernel)[:4096]
    np.testing.assert_allclose(
        signal.causal_convolution(x, long_kernel)[0, :, 0], direct, atol=1e-11
    )


def test_inputs_are_standard_normal_and_targets_grow_beyond_the_training_length():
    cfg = SignalRegressionConfig(seq_len=TRAIN_LEN, kernel="seasonal_trend")
    source = SignalRegressionSource(cfg, 8, 0, 1)
    batch = next(source.eval_batches(8 * TRAIN_LEN, 64, 64))
    assert abs(batch["inputs"].mean()) < 0.02 and batch["inputs"].std() == pytest.approx(1, 0.02)
    # Var y_i = sum_{d <= i} K(d)^2: 1 at the training length, more beyond it.
    early = batch["targets"][:, TRAIN_LEN - 8 : TRAIN_LEN].var()
    late = batch["targets"][:, -8:].var()
    assert 0.8 < early < 1.2 and late > 10 * early


def test_same_data_from_new_sources_and_disjoint_streams():
    cfg = SignalRegressionConfig(seq_len=TRAIN_LEN, seed=3)
    first, second = SignalRegressionSource(cfg, 4, 0, 1), SignalRegressionSource(cfg, 4, 0, 1)
    first.train_batch(0)  # a source that has produced batches before gives the same later ones
    for step in (1, 99):
        a, b = first.train_batch(step), second.train_batch(step)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(first.train_batch(1)["inputs"], first.train_batch(2)["inputs"])
    reseeded = SignalRegressionSource(dataclasses.replace(cfg, seed=4), 4, 0, 1)
    assert not np.array_equal(first.train_batch(1)["inputs"], reseeded.train_batch(1)["inputs"])
    evaluation = next(first.eval_batches(TRAIN_LEN, 4, 4))["inputs"]
    assert not np.array_equal(evaluation, first.train_batch(0)["inputs"])
    by_two = np.concatenate([b["inputs"] for b in second.eval_batches(TRAIN_LEN, 4, 2)])
    np.testing.assert_array_equal(by_two, evaluation)


def test_two_processes_partition_the_global_batch():
    cfg = SignalRegressionConfig(seq_len=TRAIN_LEN, seed=1)
    whole = SignalRegressionSource(cfg, 6, 0, 1).train_batch(4)
    parts = [SignalRegressionSource(cfg, 6, i, 2).train_batch(4) for i in range(2)]
    for key in whole:
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_source_declares_the_regression_task():
    source = SignalRegressionSource(SignalRegressionConfig(seq_len=8, input_channels=3), 2, 0, 1)
    assert source.task == "regression" and source.vocab_size is None
    assert source.input_channels == source.output_channels == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kernel="sawtooth"), "data.kernel = 'sawtooth' is not one of"),
        (dict(input_channels=0), "input_channels"),
        (dict(second_freq_index=16), "second_freq_index"),
        (dict(source="text"), r"data.source = 'text' is not one of \('signal',\)"),
        (dict(gamma=-1.0), "gamma"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SignalRegressionConfig(seq_len=TRAIN_LEN, **kwargs)
