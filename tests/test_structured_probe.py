"""The structured kernel probes: each target against its formula, the configs, the paper's pattern."""

import dataclasses
import math

import numpy as np
import pytest

from configs import structured_probe, structured_probe_high_order
from jrope.experiments import kernel_probe
from jrope.experiments.kernel_probe import KernelProbeConfig
from jrope.experiments.probe_targets import target_values

PROBE = KernelProbeConfig.from_config_dict(structured_probe.get_config())


def _formula(target, d, probe):
    """y(d) written out from the issue's list (x = d/L, w = omega_3, w2 = omega_5)."""
    L = probe.train_context
    w = probe.theta ** (-2 * 3 / probe.head_dim)
    w2 = probe.theta ** (-2 * 5 / probe.head_dim)
    x = d / L
    formulas = {
        "phase_drift": lambda: math.cos(w * (1 + 5e-5) * d),
        "seasonal_trend": lambda: (0.35 + 0.9 * x) * math.cos(w * d) + 0.25 * math.sin(w * d),
        "damped_wave": lambda: math.exp(-1e-4 * d) * (math.cos(w * d) + 0.75 * x * math.sin(w * d)),
        "rhythm_envelope": lambda: (
            (0.25 + 0.85 * x) * (0.65 * math.cos(w * d) + 0.35 * math.sin(w2 * d))
        ),
        "motif_spacing": lambda: (
            x / (1 + 0.25 * x) * (0.7 * math.cos(w2 * d) - 0.3 * math.sin(w2 * d))
        ),
        "high_jet_r1": lambda: x * math.cos(w * d),
        "high_jet_r2": lambda: x**2 * math.cos(w * d),
        "high_jet_r3": lambda: x**3 * math.cos(w * d),
        "scaled_high_jet_r2": lambda: x**2 * math.exp(-0.1 * x) * math.cos(w * d),
        "scaled_high_jet_r3": lambda: x**3 * math.exp(-0.1 * x) * math.cos(w * d),
    }
    return formulas[target]()


@pytest.mark.parametrize("target", structured_probe.STRUCTURED_TARGETS)
def test_targets_match_their_formulas(target):
    lags = np.arange(0, 8192, 13)
    expected = [_formula(target, int(d), PROBE) for d in lags]
    np.testing.assert_allclose(target_values(target, lags, PROBE), expected, rtol=1e-12, atol=1e-13)


def test_configs_hold_the_reference_settings():
    assert PROBE.targets == structured_probe.STRUCTURED_TARGETS == PROBE.plot_targets
    assert len(PROBE.methods) == 11 and PROBE.methods[-1] == "jordan_m3"
    assert (PROBE.head_dim, PROBE.num_freqs, PROBE.theta, PROBE.gamma, PROBE.ridge) == (
        64,
        16,
        1e4,
        1e-4,
        1e-4,
    )
    assert (PROBE.target_freq_index, PROBE.second_freq_index, PROBE.drift) == (3, 5, 5e-5)
    assert PROBE.train_context == 1024 and PROBE.eval_contexts == (1024, 2048, 4096, 8192)
    high = KernelProbeConfig.from_config_dict(structured_probe_high_order.get_config())
    assert high.head_dim == 96 and "jordan_exact_scaled_c010_m4" in high.methods


def _mse(rows, target, method, split, context):
    (value,) = [
        r["mse"]
        for r in rows
        if (r["task"], r["method"], r["split"], r["context"]) == (target, method, split, context)
    ]
    return value


@pytest.fixture(scope="module")
def structured_rows():
    rows, _ = kernel_probe.probe_rows(dataclasses.replace(PROBE, plot_targets=()))
    return rows


def test_jordan_bases_fit_the_distance_modulated_targets(structured_rows):
    rows = structured_rows
    for target in ("seasonal_trend", "damped_wave", "rhythm_envelope", "high_jet_r1"):
        for split, context in [("train", 1024), ("eval", 2048), ("eval", 8192)]:
            raw = _mse(rows, target, "jordan_raw_tau", split, context)
            for baseline in ("rope", "alibi", "direct_sum"):
                assert raw * 3 < _mse(rows, target, baseline, split, context), (target, context)
    # e^{-gamma d} d sin(w d) is in the exact basis with its gamma: fitted to rounding error
    assert _mse(rows, "damped_wave", "jordan_raw_tau", "eval", 8192) < 1e-6
    # the drift is a first-order phase correction: the Jordan tangent beats RoPE within L
    assert _mse(rows, "phase_drift", "jordan_raw_tau", "train", 1024) * 10 < _mse(
        rows, "phase_drift", "rope", "train", 1024
    )


def test_high_order_bases_fit_the_higher_jets():
    probe = KernelProbeConfig.from_config_dict(structured_probe_high_order.get_config())
    probe = dataclasses.replace(
        probe,
        methods=("rope", "jordan_rope", "jordan_m3", "jordan_m4"),
        targets=("high_jet_r2", "high_jet_r3"),
        plot_targets=(),
        eval_contexts=(1024,),
    )
    rows, _ = kernel_probe.probe_rows(probe)
    for target in probe.targets:
        errors = [_mse(rows, target, m, "train", 1024) for m in probe.methods]
        assert errors == sorted(errors, reverse=True), (target, errors)  # each order helps
        assert errors[-1] * 10 < errors[1], (target, errors)


def test_structured_probe_writes_a_plot_per_target(tmp_path):
    config = structured_probe.get_config()
    config.probe.methods = ("rope", "jordan_rope")
    config.probe.targets = ("phase_drift", "motif_spacing", "scaled_high_jet_r2")
    config.probe.plot_targets = ("phase_drift", "scaled_high_jet_r2")
    config.probe.train_context = config.probe.train_points = 64
    config.probe.eval_contexts = (64, 256)
    rows = kernel_probe.run(config, str(tmp_path))
    assert len(rows) == 3 * 2 * 3
    assert "### motif_spacing" in (tmp_path / "kernel_probe.md").read_text()
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["kernel_probe_phase_drift_T256.png", "kernel_probe_scaled_high_jet_r2_T256.png"]
