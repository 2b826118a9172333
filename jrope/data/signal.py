"""Signal regression: recover a causal convolution of white noise (the paper's signal benchmarks).

A sequence is ``T`` real-valued inputs ``x_t ~ N(0, 1)`` (``C`` independent
channels) and the target at every position is the causal convolution

    y_i = sum_{j < i} K(i - j) x_j        (per channel; K(0) = 0, so y_0 = 0)

with one of four structured lag kernels (``x = d / L``, ``L`` the training
length ``seq_len``, ``w`` and ``w2`` two of the model's rotary frequencies
``theta^(-2 i / head_dim)`` for ``i = freq_index`` and ``second_freq_index``;
the constants are the reference code's):

    seasonal_trend   (0.35 + 0.9 x) cos(w d) + 0.25 sin(w d)
    damped_wave      e^{-gamma d} (cos(w d) + 0.75 x sin(w d))
    rhythm_envelope  (0.25 + 0.85 x)(0.65 cos(w d) + 0.35 sin(w2 d))
    motif_spacing    x / (1 + 0.25 x) (0.7 cos(w2 d) - 0.3 sin(w2 d))

The formulas live in jrope.data.synthetic beside that task's kernels, and
``K`` is normalised as there (training_norm). Every position is a target of
the 'regression' task of jrope.data.source.

The convolution is computed with a float64 FFT of length ``2T`` (exact up to
float64 rounding, about 1e-13 here; the tests check it against the direct
sum); batches are float32.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jrope.data import synthetic
from jrope.data.source import SeededSource
from jrope.fields import PARAMETERS, RESULT, Declared, setting

SIGNAL_KERNELS = ("seasonal_trend", "damped_wave", "rhythm_envelope", "motif_spacing")


def signal_kernel(
    name: str, lags, *, train_len: int, omega: float, second_omega: float, gamma: float
) -> np.ndarray:
    """K(d) of a kernel of SIGNAL_KERNELS at integer lags (any shape), unnormalised, float64."""
    common = dict(train_len=train_len, omega=omega)
    if name == "seasonal_trend":
        return synthetic.seasonal_trend(lags, **common)
    if name == "damped_wave":
        return synthetic.damped_mixed(lags, **common, gamma=gamma, sin_weight=0.75)
    if name == "rhythm_envelope":
        weights = dict(envelope_offset=0.25, envelope_slope=0.85, cos_weight=0.65, sin_weight=0.35)
        return synthetic.rhythm_envelope(lags, **common, second_omega=second_omega, **weights)
    # The config (or the probe's target check) validated the name, so this is the last kernel.
    return synthetic.motif_spacing(lags, train_len=train_len, second_omega=second_omega)


@dataclasses.dataclass(frozen=True)
class SignalRegressionConfig(Declared):
    """Everything that determines the signal regression data (kernels: the module docstring)."""

    section = "data"

    seq_len: int = setting(ge=2)  # training length L; the kernel's length scale and norm range
    source: str = setting("signal", choices=("signal",), defines=PARAMETERS)
    seed: int = setting(0, le=2**32 - 1, defines=RESULT)  # follows seed, which checks its floor
    kernel: str = setting("seasonal_trend", choices=SIGNAL_KERNELS, defines=RESULT)
    # C independent noise channels, each convolved with the same kernel (the model's input
    # projection and regression head have C channels; the reference uses 1).
    input_channels: int = setting(1, ge=1, defines=PARAMETERS)
    # The kernel's rotary frequencies: w of freq_index, w2 of second_freq_index
    # (rhythm_envelope, motif_spacing), theta^(-2 index / head_dim).
    head_dim: int = setting(32, ge=2)
    freq_index: int = setting(3, defines=RESULT)
    second_freq_index: int = setting(5, defines=RESULT)
    theta: float = setting(10000.0, gt=1.0)
    gamma: float = setting(1e-4, ge=0.0, defines=RESULT)  # damping of damped_wave

    def __post_init__(self):
        super().__post_init__()
        synthetic.check_frequencies(self.head_dim, self.freq_index, self.second_freq_index)

    def kernel_values(self, lags) -> np.ndarray:
        """The normalised K(d) at integer lags >= 0 (K(0) = 0), float64."""
        lags = np.asarray(lags)
        values = self._raw_kernel(lags) / self.kernel_norm()
        return np.where(lags == 0, 0.0, values)

    def kernel_norm(self) -> float:
        return synthetic.training_norm(self._raw_kernel, self.seq_len, self.kernel)

    def _raw_kernel(self, lags) -> np.ndarray:
        indices = (self.freq_index, self.second_freq_index)
        omega, second = (synthetic.rotary_frequency(self.theta, i, self.head_dim) for i in indices)
        options = dict(train_len=self.seq_len, omega=omega, second_omega=second, gamma=self.gamma)
        return signal_kernel(self.kernel, lags, **options)


def causal_convolution(inputs: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """y[:, i] = sum_{j <= i} kernel[i - j] inputs[:, j], per channel: inputs [b, T, C],
    kernel [T] (kernel[0] included; the task's is 0) -> float64 [b, T, C]."""
    length = inputs.shape[1]
    size = 2 * length  # no wrap-around: the circular convolution of length 2T is the linear one
    spectrum = np.fft.rfft(inputs, n=size, axis=1) * np.fft.rfft(kernel, n=size)[None, :, None]
    return np.fft.irfft(spectrum, n=size, axis=1)[:, :length]


class SignalRegressionSource(SeededSource):
    """Data source of the signal regression task: 'inputs' float32 [b, T, C] (the noise),
    'targets' its causal convolution with K, 'weights' ones (as in the reference's loss)."""

    task = "regression"
    vocab_size = None
    num_classes = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.input_channels = self.output_channels = self.data_cfg.input_channels
        self._kernels = {}  # length -> normalised kernel [length]

    def make_batch(self, rngs: list[np.random.Generator], length: int) -> dict:
        if length not in self._kernels:
            self._kernels[length] = self.data_cfg.kernel_values(np.arange(length))
        channels = self.data_cfg.input_channels
        inputs = np.stack([rng.standard_normal((length, channels)) for rng in rngs])
        targets = causal_convolution(inputs, self._kernels[length])
        return {
            "inputs": inputs.astype(np.float32),
            "targets": targets.astype(np.float32),
            "weights": np.ones((len(rngs), length), np.float32),
        }
