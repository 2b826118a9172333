"""The kernel probe: bases read off the registry, the paper's qualitative results, the outputs."""

import csv
import dataclasses
import math
import os

import numpy as np
import pytest

import jrope
from configs import kernel_probe as kernel_probe_config
from configs import kernel_probe_high_order as high_order_config
from jrope.experiments import kernel_probe
from jrope.experiments.kernel_probe import KernelProbeConfig


def _mean_mse(rows, task, method, split, context):
    values = [
        r["mse"]
        for r in rows
        if (r["task"], r["method"], r["split"], r["context"]) == (task, method, split, context)
    ]
    assert values, (task, method, split, context)
    return float(np.mean(values))


@pytest.fixture(scope="module")
def paper_probe():
    """The full paper probe (L = 1024, T up to 8192), plus the paper's method list."""
    probe = KernelProbeConfig.from_config_dict(kernel_probe_config.get_config())
    probe = dataclasses.replace(
        probe, methods=tuple(dict.fromkeys(probe.methods + jrope.PAPER_METHODS))
    )
    rows, _ = kernel_probe.probe_rows(probe)
    return probe, rows


def _splits(probe):
    return [("train", probe.train_context)] + [("eval", c) for c in probe.eval_contexts]


def test_exact_raw_jordan_is_best_on_mixed_among_paper_methods(paper_probe):
    probe, rows = paper_probe
    exact_family = {"jordan_raw_tau", "jordan_exact_scaled"}
    for split, context in _splits(probe):
        errors = {m: _mean_mse(rows, "mixed", m, split, context) for m in jrope.PAPER_METHODS}
        assert min(errors, key=errors.get) in exact_family, (split, context, errors)
        # "Clearly below" RoPE, ALiBi and the direct sum: at least 4x at every length.
        for baseline in ("rope", "alibi", "direct_sum"):
            assert errors["jordan_raw_tau"] * 4 < errors[baseline], (split, context, baseline)


def test_rope_is_exact_on_phase_and_alibi_types_on_linear(paper_probe):
    probe, rows = paper_probe
    assert _mean_mse(rows, "phase", "rope", "train", probe.train_context) < 1e-10
    for split, context in _splits(probe):
        # Exact up to the float32 features (angles of up to 8192 rad in float32).
        assert _mean_mse(rows, "phase", "rope", split, context) < 1e-8
        assert _mean_mse(rows, "phase", "nope", split, context) > 0.4
        for method in ("alibi", "rope_alibi"):
            assert _mean_mse(rows, "linear", method, split, context) < 1e-10
        assert _mean_mse(rows, "linear", "rope", split, context) > 0.05


def test_high_order_probe_shows_the_finite_jet_hierarchy():
    probe = KernelProbeConfig.from_config_dict(high_order_config.get_config())
    methods = {2: "jordan_exact_c000", 3: "jordan_exact_c000_m3", 4: "jordan_exact_c000_m4"}
    probe = dataclasses.replace(probe, methods=tuple(methods.values()), eval_contexts=(2048,))
    rows, _ = kernel_probe.probe_rows(probe)
    for r in (1, 2, 3):
        for m, method in methods.items():
            train = _mean_mse(rows, f"high_jet_r{r}", method, "train", probe.train_context)
            if r < m:
                assert train < 1e-6, (r, m, train)
            else:
                assert train > 1e-5, (r, m, train)


def test_basis_columns_follow_the_registry():
    probe = KernelProbeConfig.from_config_dict(kernel_probe_config.get_config())
    lags = np.arange(0, 3000, 7)
    F = probe.num_freqs
    expected_widths = {
        "nope": 1,
        "alibi": 2,
        "rope": 1 + 2 * F,
        "rope_alibi": 2 + 2 * F,
        "damped_rope": 1 + 2 * F,
        "real_jordan": 3,
        "direct_sum": 1 + 2 * F + 3,
        "jordan_rope": 1 + 4 * F,
        "jordan_m3": 1 + 6 * F,
        "jordan_exact_scaled": 1 + 4 * F,
        "jordan_exact_c150_eta010_alibi": 2 + 4 * F,
    }
    for method, width in expected_widths.items():
        assert kernel_probe.basis_features(method, lags, probe).shape == (lags.size, width), method

    L, k = probe.train_context, 3
    w = probe.theta ** (-2 * k / probe.head_dim)
    cases = {
        # method: (column of the shear-1 cosine feature at frequency k, expected values)
        "jordan_rope": (
            1 + 2 * F + k,
            (lags / (1 + lags / L)) / L * np.exp(-1e-4 * lags) * np.cos(w * lags),
        ),
        "jordan_no_gamma": (1 + 2 * F + k, (lags / (1 + lags / L)) / L * np.cos(w * lags)),
        "jordan_raw_tau": (1 + 2 * F + k, lags / L * np.exp(-1e-4 * lags) * np.cos(w * lags)),
        "jordan_exact_scaled": (1 + 2 * F + k, lags / L * np.exp(-lags / L) * np.cos(w * lags)),
        "jordan_m3": (
            1 + 4 * F + k,
            0.5 * ((lags / (1 + lags / L)) / L) ** 2 * np.exp(-1e-4 * lags) * np.cos(w * lags),
        ),
        "real_jordan": (2, (lags / (1 + lags / L)) / L * np.exp(-1e-4 * lags)),
        "alibi": (1, lags / L),
    }
    for method, (column, expected) in cases.items():
        features = kernel_probe.basis_features(method, lags, probe)
        np.testing.assert_allclose(
            features[:, column], expected, rtol=2e-5, atol=2e-4, err_msg=method
        )
    np.testing.assert_array_equal(kernel_probe.basis_features("rope", lags, probe)[:, 0], 1.0)


def test_ridge_fit_recovers_weights_and_shrinks():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5))
    weights = np.array([1.0, -2.0, 0.5, 0.0, 3.0])
    np.testing.assert_allclose(
        kernel_probe.ridge_fit(x, x @ weights, 0.0), weights, rtol=1e-10, atol=1e-12
    )
    shrunk = kernel_probe.ridge_fit(x, x @ weights, 1e3)
    assert np.linalg.norm(shrunk) < 0.5 * np.linalg.norm(weights)


def test_run_writes_csv_markdown_and_plot(tmp_path, capsys):
    config = kernel_probe_config.get_config()
    config.probe.methods = ("rope", "jordan_raw_tau")
    config.probe.seeds = (0, 1)
    config.probe.train_context = 64
    config.probe.train_points = 48
    config.probe.eval_contexts = (64, 128)
    rows = kernel_probe.run(config, str(tmp_path))
    with open(tmp_path / "kernel_probe.csv") as f:
        reader = csv.reader(f)
        header = next(reader)
        body = list(reader)
    assert header == ["seed", "task", "method", "context", "split", "mse"]
    assert len(body) == len(rows) == 2 * 3 * 2 * (1 + 2)
    assert {row[4] for row in body} == {"train", "eval"}
    assert all(math.isfinite(float(row[5])) for row in body)
    # A subset of the lags: the two seeds fit different points.
    train = {(r["seed"], r["task"], r["method"]): r["mse"] for r in rows if r["split"] == "train"}
    assert train[0, "mixed", "rope"] != train[1, "mixed", "rope"]
    table = (tmp_path / "kernel_probe.md").read_text()
    for text in ("### phase", "### linear", "### mixed", "| jordan_raw_tau |", "T=128"):
        assert text in table
    assert (tmp_path / "kernel_probe_mixed_T128.png").stat().st_size > 10_000
    # The console names every file written, each of which exists.
    printed = capsys.readouterr().out.split("Probe files:\n")[-1].split()
    assert str(tmp_path / "kernel_probe.csv") in printed
    assert str(tmp_path / "kernel_probe_mixed_T128.png") in printed
    assert all(os.path.exists(path) for path in printed)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(targets=("phase", "cubic")), "Unknown probe target"),
        (dict(plot_targets=("high_jet_r2",)), "plot_targets"),
        (dict(second_freq_index=16), "second_freq_index"),
        (dict(train_points=2048), "train_points"),
        (dict(target_freq_index=16), "target_freq_index"),
        (dict(methods=("jordan_wobble",)), "unknown position-encoding name"),
        (dict(methods=("direct_sum_poly_m1",)), "m >= 2"),
        (
            dict(solver_dtype="float16"),
            r"probe.solver_dtype = 'float16' is not one of \('float64', 'float32'\)",
        ),
    ],
)
def test_bad_probe_config_raises(change, message):
    config = kernel_probe_config.get_config()
    for key, value in change.items():
        config.probe[key] = value
    with pytest.raises(ValueError, match=message):
        KernelProbeConfig.from_config_dict(config)


def test_unknown_probe_key_raises():
    config = kernel_probe_config.get_config()
    config.probe.ridge_penalty = 1.0
    with pytest.raises(ValueError, match="unknown keys"):
        KernelProbeConfig.from_config_dict(config)


def test_ridge_fit_in_float32_matches_float64_on_a_well_conditioned_problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 5))
    y = x @ np.array([1.0, -2.0, 0.5, 0.0, 3.0])
    w64 = kernel_probe.ridge_fit(x, y, 1e-6, "float64")
    w32 = kernel_probe.ridge_fit(x, y, 1e-6, "float32")
    assert w32.dtype == np.float32
    np.testing.assert_allclose(w32, w64, rtol=1e-4, atol=1e-5)
