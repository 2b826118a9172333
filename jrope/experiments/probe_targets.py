"""The target lag kernels y(d) the kernel probes fit (jrope.experiments.kernel_probe).

With x = d/L, w = theta^(-2 i / head_dim) for i = target_freq_index and w2
the same for i = second_freq_index:

    phase                cos(w d)
    linear               -x
    mixed                x cos(w d)                       (the paper's kernel probe)
    high_jet_r{r}        x^r cos(w d)                     (v2's high-order probe; r = 1 is mixed)
    scaled_high_jet_r{r} x^r e^{-c x} cos(w d)            c = jet_decay
    phase_drift          cos(w (1 + eps) d)               eps = drift: RoPE's frequency slightly off

and the signal task's kernels seasonal_trend, damped_wave (its gamma the probe's),
rhythm_envelope and motif_spacing (jrope.data.signal). Those and the jets are the reference
code's structured benchmarks, with its constants. Every formula is computed by the numpy kernels
of the data tasks (jrope.data.synthetic, jrope.data.signal), so a probe and a trained task on the
same kernel see the same function. Values are float64.
"""

from __future__ import annotations

import re
from typing import Protocol

import numpy as np

from jrope.data import signal, synthetic


class TargetSettings(Protocol):
    """What the targets read of a probe's settings (jrope.experiments.kernel_probe's config)."""

    train_context: int  # L, the unit of time
    target_omega: float  # w
    second_freq_index: int  # w2's index i
    head_dim: int
    theta: float
    gamma: float  # damped_wave's damping
    drift: float  # phase_drift's eps
    jet_decay: float  # scaled_high_jet's c


PLAIN_TARGETS = ("phase", "linear", "mixed", "phase_drift") + signal.SIGNAL_KERNELS
_JET = re.compile(r"(scaled_)?high_jet_r(\d+)")


def check_target(target: str) -> None:
    """ValueError naming the accepted targets unless `target` is one."""
    if target not in PLAIN_TARGETS and not _JET.fullmatch(target):
        raise ValueError(
            f"Unknown probe target {target!r}; use one of {', '.join(PLAIN_TARGETS)}, "
            "high_jet_r{r} or scaled_high_jet_r{r} (e.g. high_jet_r2)."
        )


def target_values(target: str, lags: np.ndarray, probe: TargetSettings) -> np.ndarray:
    """y(d) of a target at integer lags [n] under the probe's settings, float64 [n]."""
    check_target(target)
    L, omega = probe.train_context, probe.target_omega
    if target == "linear":
        return -np.asarray(lags, np.float64) / L
    if target == "mixed":
        return synthetic.mixed_raw(lags, train_len=L, omega=omega)
    if target == "phase":
        return synthetic.high_jet(lags, train_len=L, omega=omega, power=0)
    if target == "phase_drift":
        return synthetic.high_jet(lags, train_len=L, omega=omega * (1.0 + probe.drift), power=0)
    if target in signal.SIGNAL_KERNELS:
        second = synthetic.rotary_frequency(probe.theta, probe.second_freq_index, probe.head_dim)
        options = dict(train_len=L, omega=omega, second_omega=second, gamma=probe.gamma)
        return signal.signal_kernel(target, lags, **options)
    scaled, power = _JET.fullmatch(target).groups()
    if scaled:
        jet = dict(power=int(power), decay=probe.jet_decay)
        return synthetic.scaled_high_jet(lags, train_len=L, omega=omega, **jet)
    return synthetic.high_jet(lags, train_len=L, omega=omega, power=int(power))
