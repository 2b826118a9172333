"""The "Jordan-friendly" synthetic classification task of the Jordan-RoPE paper.

A sequence is ``T - 1`` fair random bits followed by one QUERY token. With
signs ``s_p = 2 b_p - 1`` (``p = 0 .. T-2``) and the lag ``d = T - 1 - p``
from the query back to bit ``p``, the hidden score and label are

    S = sum_p s_p K(T - 1 - p)        label = 1[S > 0]   ('threshold')
                                      label ~ Bernoulli(sigmoid(S / temperature))   ('stochastic')

The model reads the last position's logits over the first two tokens and is
trained with cross-entropy on the label. A kernel ``K`` that is a
distance-modulated phase, ``(d/L) cos(w d)``, is exactly the relative feature
an order-2 Jordan block produces and RoPE cannot, hence the task's name.

Kernels (``x = d / L``, ``L`` the training length ``seq_len``, ``w`` and
``w2`` two of the model's rotary frequencies, ``theta^(-2 i / head_dim)`` for
``i = freq_index`` and ``second_freq_index``), defined for lags ``d >= 1``:

    mixed_raw        x cos(w d)                                       (the paper's)
    bounded_mixed    (tau(d) / L) cos(w d),   tau(d) = d / (1 + d/L)
    damped_mixed     e^{-gamma d} (cos(w d) + a x sin(w d))           gamma = damping_gamma, a = damping_sin_weight
    rhythm_envelope  (e0 + e1 x) (c1 cos(w d) + c2 sin(w2 d))         a linear envelope that keeps growing
                                                                      past L, times a two-frequency carrier;
                                                                      e0, e1 = envelope_offset, envelope_slope,
                                                                      c1, c2 = carrier_cos_weight, carrier_sin_weight
    high_jet         x^r cos(w d)                                     r = jet_power (the paper's v2)
    scaled_high_jet  x^r e^{-c x} cos(w d)                            c = jet_decay

The defaults of the parameters are the reference code's. ``K`` is divided by
its L2 norm over ``d = 1 .. L-1`` at the training length; evaluation at a
longer length ``T`` uses that same constant, so the growing kernels keep
growing beyond ``L`` (which is what makes extrapolation hard).

Every sequence has a generator of its own (jrope.data.source.SeededSource);
all arithmetic is host-side numpy in float64.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import numpy as np

from jrope.data.source import SeededSource, last_position_batch
from jrope.fields import PARAMETERS, RESULT, Declared, setting

BIT0 = 0
BIT1 = 1
QUERY = 2
VOCAB_SIZE = 3
NUM_CLASSES = 2

KERNEL_NAMES = (
    "mixed_raw",
    "bounded_mixed",
    "damped_mixed",
    "rhythm_envelope",
    "high_jet",
    "scaled_high_jet",
)
LABEL_MODES = ("threshold", "stochastic")


@dataclasses.dataclass(frozen=True)
class SyntheticTaskConfig(Declared):
    """Everything that determines the synthetic task's data (kernels: the module docstring)."""

    section = "data"

    # Training length L (QUERY included); also the kernel's length scale and normalisation range.
    seq_len: int = setting(ge=2)
    source: str = setting("synthetic", choices=("synthetic",), defines=PARAMETERS)
    seed: int = setting(0, le=2**32 - 1, defines=RESULT)  # follows seed, which checks its floor
    kernel: str = setting("mixed_raw", choices=KERNEL_NAMES, defines=RESULT)
    # The kernel's rotary frequencies: w = theta^(-2 * freq_index / head_dim), and w2 of
    # second_freq_index ('rhythm_envelope').
    head_dim: int = setting(32, ge=2)
    freq_index: int = setting(3, defines=RESULT)
    second_freq_index: int = setting(5, defines=RESULT)
    theta: float = setting(10000.0, gt=1.0)
    # 'threshold': 1[S > 0]; 'stochastic': Bernoulli(sigmoid(S / temperature)).
    label_mode: str = setting("threshold", choices=LABEL_MODES, defines=RESULT)
    temperature: float = setting(1.0 / 3.0, gt=0.0, defines=RESULT)  # the reference's scale 3
    jet_power: int = setting(2, ge=0, defines=RESULT)  # r of 'high_jet' and 'scaled_high_jet'
    jet_decay: float = setting(0.1, defines=RESULT)  # c of 'scaled_high_jet'
    damping_gamma: float = setting(1e-4, defines=RESULT)  # gamma of 'damped_mixed'
    damping_sin_weight: float = setting(0.75, defines=RESULT)  # a of 'damped_mixed'
    # e0, e1 and c1, c2 of 'rhythm_envelope'.
    envelope_offset: float = setting(0.25, defines=RESULT)
    envelope_slope: float = setting(0.85, defines=RESULT)
    carrier_cos_weight: float = setting(0.65, defines=RESULT)
    carrier_sin_weight: float = setting(0.35, defines=RESULT)
    # Keys only some kernels or label modes read (chooser, its values that read the keys, whether
    # setting them anyway is refused) -> keys: one section carries every kernel's parameters, so
    # a value the chosen kernel ignores is only warned of (keys_without_effect).
    KEYS_READ_ONLY_BY: ClassVar = {
        ("kernel", ("high_jet", "scaled_high_jet"), False): ("jet_power",),
        ("kernel", ("scaled_high_jet",), False): ("jet_decay",),
        ("kernel", ("damped_mixed",), False): ("damping_gamma", "damping_sin_weight"),
        ("kernel", ("rhythm_envelope",), False): (
            *("envelope_offset", "envelope_slope", "carrier_cos_weight", "carrier_sin_weight"),
        ),
        ("label_mode", ("stochastic",), False): ("temperature",),
    }

    def __post_init__(self):
        super().__post_init__()
        check_frequencies(self.head_dim, self.freq_index, self.second_freq_index)

    @property
    def omega(self) -> float:
        return rotary_frequency(self.theta, self.freq_index, self.head_dim)

    @property
    def second_omega(self) -> float:
        return rotary_frequency(self.theta, self.second_freq_index, self.head_dim)


def check_frequencies(head_dim: int, freq_index: int, second_freq_index: int) -> None:
    """ValueError unless head_dim is even and both frequency indices are rotary pairs of it."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}.")
    for name, index in (("freq_index", freq_index), ("second_freq_index", second_freq_index)):
        if not 0 <= index < head_dim // 2:
            raise ValueError(f"{name} must lie in [0, head_dim/2 = {head_dim // 2}), got {index}.")


def rotary_frequency(theta: float, index: int, head_dim: int) -> float:
    """``theta^(-2 index / head_dim)``: the index-th rotary frequency of a head."""
    return float(theta) ** (-2.0 * index / head_dim)


# ---- Kernels: plain functions of an integer lag array d (any shape) -> float64, same shape.


def mixed_raw(lags, *, train_len: int, omega: float) -> np.ndarray:
    """(d/L) cos(w d): the paper's distance-modulated phase."""
    d = np.asarray(lags, np.float64)
    return (d / train_len) * np.cos(omega * d)


def bounded_mixed(lags, *, train_len: int, omega: float) -> np.ndarray:
    """(tau(d)/L) cos(w d) with the bounded time tau(d) = d / (1 + d/L)."""
    d = np.asarray(lags, np.float64)
    tau = d / (1.0 + d / train_len)
    return (tau / train_len) * np.cos(omega * d)


def damped_mixed(
    lags, *, train_len: int, omega: float, gamma: float, sin_weight: float
) -> np.ndarray:
    """e^{-gamma d} (cos(w d) + a (d/L) sin(w d))."""
    d = np.asarray(lags, np.float64)
    wave = np.cos(omega * d) + sin_weight * (d / train_len) * np.sin(omega * d)
    return np.exp(-gamma * d) * wave


def rhythm_envelope(
    lags,
    *,
    train_len: int,
    omega: float,
    second_omega: float,
    envelope_offset: float,
    envelope_slope: float,
    cos_weight: float,
    sin_weight: float,
) -> np.ndarray:
    """(e0 + e1 d/L) (c1 cos(w d) + c2 sin(w2 d)): a linear envelope on a two-tone carrier."""
    d = np.asarray(lags, np.float64)
    envelope = envelope_offset + envelope_slope * (d / train_len)
    carrier = cos_weight * np.cos(omega * d) + sin_weight * np.sin(second_omega * d)
    return envelope * carrier


def high_jet(lags, *, train_len: int, omega: float, power: int) -> np.ndarray:
    """(d/L)^r cos(w d): needs a Jordan block of order > r to be represented exactly."""
    d = np.asarray(lags, np.float64)
    return (d / train_len) ** power * np.cos(omega * d)


def scaled_high_jet(lags, *, train_len: int, omega: float, power: int, decay: float) -> np.ndarray:
    """(d/L)^r e^{-c d/L} cos(w d): the high jet under the scaled-exact damping gamma = c/L."""
    d = np.asarray(lags, np.float64)
    x = d / train_len
    return x**power * np.exp(-decay * x) * np.cos(omega * d)


def seasonal_trend(lags, *, train_len: int, omega: float) -> np.ndarray:
    """(0.35 + 0.9 d/L) cos(w d) + 0.25 sin(w d): a seasonal wave whose amplitude grows with the lag.

    The structured benchmarks' kernel (the reference's constants); used by the
    structured kernel probe and the signal regression task, not by this task.
    """
    d = np.asarray(lags, np.float64)
    return (0.35 + 0.9 * (d / train_len)) * np.cos(omega * d) + 0.25 * np.sin(omega * d)


def motif_spacing(lags, *, train_len: int, second_omega: float) -> np.ndarray:
    """x / (1 + 0.25 x) (0.7 cos(w2 d) - 0.3 sin(w2 d)), x = d/L: a repeating motif whose
    weight grows, sublinearly, with the lag (a structured benchmarks' kernel, like seasonal_trend)."""
    d = np.asarray(lags, np.float64)
    x = d / train_len
    return x / (1.0 + 0.25 * x) * (0.7 * np.cos(second_omega * d) - 0.3 * np.sin(second_omega * d))


def unnormalised_kernel(cfg: SyntheticTaskConfig, lags) -> np.ndarray:
    """The configured kernel at the given lags, before normalisation."""
    common = dict(train_len=cfg.seq_len, omega=cfg.omega)
    if cfg.kernel == "mixed_raw":
        return mixed_raw(lags, **common)
    if cfg.kernel == "bounded_mixed":
        return bounded_mixed(lags, **common)
    if cfg.kernel == "damped_mixed":
        return damped_mixed(
            lags, **common, gamma=cfg.damping_gamma, sin_weight=cfg.damping_sin_weight
        )
    if cfg.kernel == "rhythm_envelope":
        weights = dict(envelope_offset=cfg.envelope_offset, envelope_slope=cfg.envelope_slope)
        weights.update(cos_weight=cfg.carrier_cos_weight, sin_weight=cfg.carrier_sin_weight)
        return rhythm_envelope(lags, **common, second_omega=cfg.second_omega, **weights)
    if cfg.kernel == "high_jet":
        return high_jet(lags, **common, power=cfg.jet_power)
    # The config validated the name, so this is the last kernel.
    return scaled_high_jet(lags, **common, power=cfg.jet_power, decay=cfg.jet_decay)


def training_norm(raw_kernel, seq_len: int, name: str) -> float:
    """L2 norm of `raw_kernel(lags)` over the training lags d = 1 .. L-1 (this task's and the
    signal task's normalisation); ValueError where it vanishes."""
    norm = float(np.linalg.norm(raw_kernel(np.arange(1, seq_len))))
    if norm == 0.0:
        raise ValueError(f"Kernel {name!r} vanishes on the training lags; change its parameters.")
    return norm


def kernel_norm(cfg: SyntheticTaskConfig) -> float:
    return training_norm(functools.partial(unnormalised_kernel, cfg), cfg.seq_len, cfg.kernel)


def kernel(cfg: SyntheticTaskConfig, lags) -> np.ndarray:
    """The normalised kernel K(d) (training-length normalisation at every length)."""
    return unnormalised_kernel(cfg, lags) / kernel_norm(cfg)


def sequence_scores(cfg: SyntheticTaskConfig, bits: np.ndarray) -> np.ndarray:
    """Hidden scores S float64 [b] of bit rows int [b, T-1] (the sequence before its QUERY):
    sum_p (2 b_p - 1) K(T - 1 - p)."""
    num_bits = bits.shape[-1]
    # position p sits T - 1 - p = num_bits - p before the query
    lags = num_bits - np.arange(num_bits)
    signs = 2.0 * bits.astype(np.float64) - 1.0
    return signs @ kernel(cfg, lags)


class SyntheticSource(SeededSource):
    """Data source of the synthetic task: 'inputs' int32 [b, T] (bits then QUERY), the label
    the target of the last position, the only one weighted (last_position_batch)."""

    task = "classification"
    vocab_size = VOCAB_SIZE
    num_classes = NUM_CLASSES

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kernel_norm(self.data_cfg)  # a vanishing kernel fails here, not at the first batch

    def make_batch(self, rngs: list[np.random.Generator], length: int) -> dict:
        bits = np.stack([rng.integers(0, 2, size=length - 1, dtype=np.int32) for rng in rngs])
        scores = sequence_scores(self.data_cfg, bits)
        if self.data_cfg.label_mode == "threshold":
            labels = (scores > 0).astype(np.int32)
        else:
            # sigmoid(z) = (1 + tanh(z/2)) / 2 cannot overflow for large |z|.
            probs = 0.5 * (1.0 + np.tanh(0.5 * scores / self.data_cfg.temperature))
            # Each row's own generator draws its label after its bits: reproducible per row.
            uniforms = np.array([rng.random() for rng in rngs])
            labels = (uniforms < probs).astype(np.int32)
        query = np.full((len(rngs), 1), QUERY, np.int32)
        return last_position_batch(np.concatenate([bits, query], axis=1), labels)
