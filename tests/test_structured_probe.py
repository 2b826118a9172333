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
    # The reference's high_jet_structured.yaml: its twelve methods in its order, seed 0.
    assert high.methods == (
        "rope",
        "rope_matched_m2",
        "rope_matched_m3",
        "rope_matched_m4",
        "rope_alibi",
        "direct_sum",
        "direct_sum_poly_m4",
        "jordan_rope",
        "jordan_m3",
        "jordan_m4",
        "jordan_scaled_m3_c010",
        "jordan_scaled_m4_c010",
    )
    assert (high.head_dim, high.seeds, high.jet_decay) == (96, (0,), 0.1)
    assert PROBE.solver_dtype == high.solver_dtype == "float64"


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


@pytest.mark.slow
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


def _motif_cells(solver_dtype):
    """MSE at T = 8192 of motif_spacing for rope, jordan_raw_tau and jordan_m3."""
    probe = dataclasses.replace(
        PROBE,
        methods=("rope", "jordan_raw_tau", "jordan_m3"),
        targets=("motif_spacing",),
        plot_targets=(),
        eval_contexts=(8192,),
        solver_dtype=solver_dtype,
    )
    rows, _ = kernel_probe.probe_rows(probe)
    return {m: _mse(rows, "motif_spacing", m, "eval", 8192) for m in probe.methods}


def test_float32_solver_reproduces_the_references_motif_spacing_winner():
    """The reference solves in float32: there jordan_raw_tau wins motif_spacing at 8192 (0.167),
    in float64 jordan_m3 does (0.260 against 0.271).

    The raw-time gram matrix has a condition number of about 1e7, so a float32
    solve keeps only a digit or so of the extrapolated error, and its value
    depends on the summation order of the library and compiler (XLA's CPU
    path: 0.161 optimized, 0.206 with the tests' optimizations off; numpy's
    float32 path 0.274); hence the loose band around the reference's 0.167.
    RoPE's well-conditioned fit is the same in both.
    """
    f64, f32 = _motif_cells("float64"), _motif_cells("float32")
    assert f64["jordan_raw_tau"] == pytest.approx(0.271, rel=0.01)
    assert f64["jordan_m3"] == pytest.approx(0.260, rel=0.01)
    assert f32["jordan_raw_tau"] == pytest.approx(0.167, rel=0.3)
    assert f32["jordan_raw_tau"] < f32["jordan_m3"] and f64["jordan_m3"] < f64["jordan_raw_tau"]
    assert f32["rope"] == pytest.approx(f64["rope"], rel=1e-4)
    assert f32["jordan_m3"] == pytest.approx(f64["jordan_m3"], rel=0.02)


def test_reference_probe_baselines_have_the_references_features():
    probe = KernelProbeConfig.from_config_dict(structured_probe_high_order.get_config())
    lags = np.arange(0, 3000, 7)
    L, freqs = probe.train_context, probe.num_freqs
    w = probe.theta ** (-2.0 * np.arange(freqs) / probe.head_dim)
    d = lags[:, None].astype(np.float64)
    for m in (2, 3, 4):
        matched = kernel_probe.basis_features(f"rope_matched_m{m}", lags, probe)
        k = freqs // m
        expected = np.concatenate([np.ones_like(d), np.cos(w[:k] * d), np.sin(w[:k] * d)], axis=1)
        np.testing.assert_allclose(matched, expected, atol=2e-3)  # float32 angles up to 3000 rad
    tau = lags / (1 + lags / L) / L
    poly = kernel_probe.basis_features("direct_sum_poly_m4", lags, probe)
    rope = kernel_probe.basis_features("rope", lags, probe)
    np.testing.assert_allclose(poly[:, : rope.shape[1]], rope)
    np.testing.assert_allclose(
        poly[:, rope.shape[1] :], np.stack([tau, tau**2, tau**3], 1), rtol=1e-5
    )
    for m in (3, 4):
        scaled = kernel_probe.basis_features(f"jordan_scaled_m{m}_c010", lags, probe)
        exact = kernel_probe.basis_features(f"jordan_exact_m{m}_c010", lags, probe)
        np.testing.assert_array_equal(scaled, exact)
        assert scaled.shape[1] == 1 + 2 * m * freqs


def test_scaled_jets_hold_their_targets_exactly():
    """x^r e^{-0.1 x} cos(w d) lies in jordan_scaled_m{m}_c010's span for r < m."""
    probe = KernelProbeConfig.from_config_dict(structured_probe_high_order.get_config())
    probe = dataclasses.replace(
        probe,
        methods=("rope", "rope_matched_m4", "jordan_scaled_m3_c010"),
        targets=("scaled_high_jet_r2",),
        plot_targets=(),
        eval_contexts=(8192,),
    )
    rows, _ = kernel_probe.probe_rows(probe)
    assert _mse(rows, "scaled_high_jet_r2", "jordan_scaled_m3_c010", "eval", 8192) < 1e-4
    rope = _mse(rows, "scaled_high_jet_r2", "rope", "train", 1024)
    # a subset of RoPE's features fits no better than RoPE
    assert _mse(rows, "scaled_high_jet_r2", "rope_matched_m4", "train", 1024) >= rope * (1 - 1e-9)
    assert rope > 1e-2
