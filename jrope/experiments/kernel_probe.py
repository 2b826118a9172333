"""The kernel probe: which lag kernels can an encoding represent?

For fixed q and k, every encoding's attention logit between query i and key j is a linear
combination of a few functions of the lag d = i - j: its relative lag features. The probe fits a
target kernel y(d) by ridge regression on a method's features over the lags d in [0, L) and
measures the squared error on [0, T) for T up to 8L: how well the method can express, and then
extrapolate, that kernel; no training, no model. A method's basis (its PEConfig's) and 1:

    rotary layout         cos(w_k d), sin(w_k d)
    Jordan layout         c_r(d) D(d) cos(w_k d), c_r(d) D(d) sin(w_k d)   for r < m
                          (real blocks, rotate=False: c_r(d) D(d), the carrier being 1)
    direct sum            the rotary features, an order-2 real Jordan block with the
                          config's damping and shear time, and the ramp d/L (the paper's basis)
    ALiBi bias            the ramp d/L

The reference code's probe baselines (`jrope.pe_config.ProbeBaseline`; no encoding behind them):

    rope_matched_m{m}     cos(w_k d), sin(w_k d) for k < max(1, num_freqs // m) (an order-m
                          Jordan head's count of frequencies)
    direct_sum_poly_m{m}  the rotary features and (tau(d)/L)^r, r = 1 .. m-1
    jordan_scaled_m{m}_c{100c}  the features of jordan_exact_m{m}_c{100c}

with D(d) = e^{-gamma d} (gamma = the config's initial gamma when learned, 0 otherwise),
c_r(d) = (s(d)/L)^r / r! for the shear time s(d) = tau(d) = d/(1 + d/L) ('bounded') or d ('raw'),
and only c_0 = 1 without shear. Constant factors of a feature (eta, jet gates, 1/L) are absorbed by
its regression weight. Every method uses the same frequencies w_k = theta^(-2k/head_dim),
k < num_freqs, so that the comparison is about the lag functions, not the frequencies kept.

The features come from jrope.pe_math (the encodings' code) in float32, the targets in float64. The
regression (a ridge penalty on every weight, constant included), predictions and errors run in
`solver_dtype`: 'float64' solves the ill-conditioned normal equations accurately, 'float32' as the
reference code does, reproducing its tables (docs/reference.md, "Probe solver precision").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from jrope import encodings, pe_math, results
from jrope.data import synthetic
from jrope.encodings import make_encoding, unsupported_features
from jrope.errors import ConfigError, UsageError
from jrope.experiments.probe_targets import check_target, target_values
from jrope.fields import Declared, setting
from jrope.pe_config import PEConfig, ProbeBaseline, pe_config_from_name, probe_baseline_from_name

CSV_COLUMNS = ("seed", "task", "method", "context", "split", "mse")
# The encoding features whose closed-form lag features the probe builds (basis_features).
FEATURES = frozenset(
    {encodings.MAPS, encodings.DAMPING, encodings.SHEAR, encodings.BIAS, encodings.FLOAT32_DOTS}
)
SOLVER_DTYPES = {"float64": np.float64, "float32": np.float32}


@dataclasses.dataclass(frozen=True)
class KernelProbeConfig(Declared):
    """The probe's settings (the `probe` section of configs/kernel_probe*.py)."""

    section = "probe"

    # Encoding names (jrope.pe_config_from_name) or the reference's probe baselines
    # (rope_matched_m{m}, direct_sum_poly_m{m}, jordan_scaled_m{m}[_c{100c}]).
    methods: tuple[str, ...] = setting(nonempty=True)
    targets: tuple[str, ...]  # jrope.experiments.probe_targets names (e.g. 'high_jet_r2')
    # One fit each; they matter only when train_points < train_context.
    seeds: tuple[int, ...] = setting(nonempty=True)
    train_context: int = setting(ge=1)  # L: the fit uses lags in [0, L), and L is the unit of time
    # How many of those lags the fit sees (a seeded subset when fewer than L).
    train_points: int = setting(ge=1, le="train_context")
    # T values: the error is measured on all lags in [0, T).
    eval_contexts: tuple[int, ...] = setting(ge=1, nonempty=True)
    head_dim: int = setting(ge=2)  # the frequencies theta^(-2k/head_dim), k < num_freqs
    num_freqs: int = setting(ge=1)
    # The targets' frequencies (the second: rhythm_envelope's and motif_spacing's), which must
    # be basis frequencies.
    target_freq_index: int = setting(ge=0, lt="num_freqs")
    second_freq_index: int = setting(ge=0, lt="num_freqs")
    theta: float  # rotary base
    gamma: float = setting(ge=0)  # damping of learned-gamma variants whose name sets none
    drift: float  # phase_drift's relative frequency error
    jet_decay: float  # c of the scaled_high_jet targets
    ridge: float = setting(ge=0)  # lambda of (X^T X + lambda I) w = X^T y
    plot_targets: tuple[str, ...]  # targets whose fits a PNG each shows at the longest context
    # The precision of the normal equations, predictions and errors; float32 reproduces the
    # reference's tables.
    solver_dtype: str = setting("float64", choices=SOLVER_DTYPES)

    def __post_init__(self):
        super().__post_init__()
        for target in self.targets:
            check_target(target)
        if not set(self.plot_targets) <= set(self.targets):
            raise ValueError(f"probe.plot_targets {self.plot_targets} must be among probe.targets "
                             f"{self.targets}.")  # fmt: skip
        for method in self.methods:
            if probe_baseline_from_name(method) is None:  # a bad baseline order fails there
                method_pe_config(method, self)  # an unknown name fails here, listing the forms

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> KernelProbeConfig:
        """From the whole experiment ConfigDict: its one section, `probe`; ConfigError (a
        ValueError) naming every problem."""
        section = dict(config.get("probe", {}))
        names = {f.name for f in dataclasses.fields(cls)}
        if set(config.keys()) != {"probe"} or set(section) != names:
            raise ConfigError([
                f"a kernel-probe config has exactly one section, probe; got {sorted(config.keys())}, "
                f"unknown keys {sorted(set(section) - names)}, missing {sorted(names - set(section))}."
            ])  # fmt: skip
        try:
            return cls(
                **{k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in section.items()}
            )
        except ValueError as error:
            raise ConfigError(str(error).splitlines()) from error

    @property
    def target_omega(self) -> float:
        return synthetic.rotary_frequency(self.theta, self.target_freq_index, self.head_dim)


def method_pe_config(method: str, probe: KernelProbeConfig) -> PEConfig:
    """The method's PEConfig, the probe's gamma its base damping (its name may override it);
    ValueError for an encoding with a feature the probe's closed-form features lack."""
    settings = dict(train_context=probe.train_context, theta=probe.theta, gamma_min=0.0)
    cfg = pe_config_from_name(method, init_gamma=probe.gamma, **settings)
    if missing := unsupported_features(make_encoding(cfg, 1, 8 * cfg.order), FEATURES):
        raise ValueError(f"{method}: the kernel probe has no closed-form features of its "
                         f"{missing[0]}.")  # fmt: skip
    return cfg


def _jordan_features(cfg: PEConfig, order: int, rotate: bool, lags, omegas) -> list[np.ndarray]:
    """c_r(d) D(d) (cos, sin)(w d) for r < order (c_r(d) D(d) when not rotating), each [n, F] or [n, 1]."""
    gamma = cfg.init_gamma if cfg.learn_gamma else 0.0
    d = jnp.asarray(lags, jnp.float32)[:, None]
    if rotate:
        carriers = pe_math.damped_phase(d, gamma, omegas[None, :])
    else:
        carriers = pe_math.damped_phase(d, gamma, 0.0)[:1]  # sin(0 d) = 0 carries nothing
    coefficients = [1.0]
    if cfg.clock is not None:
        coefficients = pe_math.shear_series(cfg.clock.unscaled(d) / cfg.train_context, order)
    return [np.asarray(c * carrier, np.float64) for c in coefficients for carrier in carriers]


def _rotary_features(lags: np.ndarray, omegas: jnp.ndarray) -> list[np.ndarray]:
    """cos(w_k d), sin(w_k d), each float64 [n, len(omegas)] (float32 values)."""
    d = jnp.asarray(lags, jnp.float32)[:, None]
    return [np.asarray(c, np.float64) for c in pe_math.damped_phase(d, 0.0, omegas[None, :])]


def _baseline_features(baseline: ProbeBaseline, lags, probe: KernelProbeConfig, omegas) -> list:
    """The reference's probe-baseline features (the constant excluded)."""
    if baseline.kind == "rope_matched":
        return _rotary_features(lags, omegas[: max(1, probe.num_freqs // baseline.order)])
    if baseline.kind == "direct_sum_poly":
        d = jnp.asarray(lags, jnp.float32)
        clock = pe_math.ShearTime(bounded=True, scale=1.0, train_context=probe.train_context)
        tau = clock.unscaled(d) / probe.train_context
        powers = [np.asarray(tau**r, np.float64)[:, None] for r in range(1, baseline.order)]
        return _rotary_features(lags, omegas) + powers
    name = f"jordan_exact_m{baseline.order}_c{round(100 * baseline.c):03d}"
    exact = pe_config_from_name(name, train_context=probe.train_context, theta=probe.theta)
    return _jordan_features(exact, exact.order, True, lags, omegas)


def basis_features(method: str, lags: np.ndarray, probe: KernelProbeConfig) -> np.ndarray:
    """The method's relative lag features at integer lags [n], float64 [n, F] (column 0 is the constant)."""
    lags = np.asarray(lags)
    omegas = pe_math.rotary_frequencies(probe.num_freqs, probe.head_dim, probe.theta)
    columns = [np.ones((lags.size, 1))]
    baseline = probe_baseline_from_name(method)
    if baseline is not None:
        columns += _baseline_features(baseline, lags, probe, omegas)
        return np.concatenate([c.reshape(lags.size, -1) for c in columns], axis=1)
    cfg = method_pe_config(method, probe)
    ramp = (lags / probe.train_context)[:, None].astype(np.float64)
    if cfg.layout in ("rope", "direct_sum"):
        columns += _rotary_features(lags, omegas)
    if cfg.layout == "jordan":
        columns += _jordan_features(cfg, cfg.order, cfg.rotate, lags, omegas)
    if cfg.layout == "direct_sum":
        columns += _jordan_features(cfg, 2, False, lags, omegas) + [ramp]
    if cfg.alibi:
        columns.append(ramp)
    return np.concatenate([c.reshape(lags.size, -1) for c in columns], axis=1)


def ridge_fit(features: np.ndarray, targets: np.ndarray, ridge: float, solver_dtype="float64"):
    """Weights w [F] solving (X^T X + ridge I) w = X^T y; X [n, F], y [n].

    'float64': numpy in float64. 'float32': XLA on the CPU with full-precision
    dots on any host. At the probe's condition numbers (about 1e7) a float32
    solve depends on the summation order: XLA's is the closest to the
    reference's (docs/reference.md, section 3).
    """
    if solver_dtype == "float64":
        x = np.asarray(features, np.float64)
        gram = x.T @ x + ridge * np.eye(x.shape[1])
        return np.linalg.solve(gram, x.T @ np.asarray(targets, np.float64))
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(np.asarray(features, np.float32), cpu)
    y = jax.device_put(np.asarray(targets, np.float32), cpu)
    return np.asarray(_ridge_fit_float32(x, y, np.float32(ridge)))


@jax.jit
def _ridge_fit_float32(x: jax.Array, y: jax.Array, ridge: jax.Array) -> jax.Array:
    """ridge_fit's float32 solve (one compilation per feature count)."""
    highest = jax.lax.Precision.HIGHEST
    gram = jnp.matmul(x.T, x, precision=highest) + ridge * jnp.eye(x.shape[1], dtype=x.dtype)
    return jnp.linalg.solve(gram, jnp.matmul(x.T, y, precision=highest))


def probe_rows(probe: KernelProbeConfig) -> tuple[list[dict], dict[str, np.ndarray]]:
    """(CSV_COLUMNS rows of every (seed, target, method) fit: 'train' and 'eval' per eval context;
    plot target -> method -> the first seed's fit on [0, max(eval_contexts)), float64)."""
    longest = max(probe.eval_contexts)
    dtype = SOLVER_DTYPES[probe.solver_dtype]
    # One feature matrix per method covers the fit lags and every evaluation window.
    lags = np.arange(max(longest, probe.train_context))
    eval_features = {m: basis_features(m, lags, probe).astype(dtype) for m in probe.methods}
    rows, plot_curves = [], {target: {} for target in probe.plot_targets}
    for seed in probe.seeds:
        fit_lags = lags[: probe.train_context]  # all lags of [0, L), or a seeded subset
        if probe.train_points < probe.train_context:
            rng = np.random.default_rng(seed)
            fit_lags = np.sort(rng.choice(probe.train_context, probe.train_points, replace=False))
        for target in probe.targets:
            y_fit = target_values(target, fit_lags, probe).astype(dtype)
            y_all = target_values(target, lags, probe).astype(dtype)
            for method in probe.methods:
                x_all = eval_features[method]
                x_fit = x_all[fit_lags]
                weights = ridge_fit(x_fit, y_fit, probe.ridge, probe.solver_dtype)
                common = dict(seed=seed, task=target, method=method)
                fit_error = float(np.mean((x_fit @ weights - y_fit) ** 2))
                rows.append(dict(common, context=probe.train_context, split="train", mse=fit_error))
                prediction = x_all @ weights
                for context in probe.eval_contexts:
                    error = np.mean((prediction[:context] - y_all[:context]) ** 2)
                    rows.append(dict(common, context=context, split="eval", mse=float(error)))
                if seed == probe.seeds[0] and target in plot_curves:
                    plot_curves[target][method] = prediction[:longest].astype(np.float64)
    return rows, plot_curves


def markdown_table(rows: list[dict], probe: KernelProbeConfig) -> str:
    """One table per target: MSE (mean over seeds) per method, train and each context; best in bold."""
    columns = [("train", probe.train_context)] + [("eval", c) for c in probe.eval_contexts]
    header = ["method", f"train (L={probe.train_context})"]
    header += [f"T={c}" for c in probe.eval_contexts]
    lines = [
        f"Kernel probe: ridge {probe.ridge:g}, head_dim {probe.head_dim}, {probe.num_freqs} frequencies, "
        f"target frequency index {probe.target_freq_index}, gamma {probe.gamma:g}, "
        f"seeds {list(probe.seeds)}, {probe.solver_dtype} solver. Mean squared error."
    ]
    for target in probe.targets:
        by_column = [
            _bold_best([_mean_mse(rows, target, m, c) for m in probe.methods]) for c in columns
        ]
        cells = [[method, *shown] for method, *shown in zip(probe.methods, *by_column, strict=True)]
        lines += ["", f"### {target}", "", results.markdown_table(header, cells).rstrip("\n")]
    if len(probe.targets) > 1:  # targets as rows, at one column each
        for title, column in (
            (f"every target at T={max(probe.eval_contexts)}", ("eval", max(probe.eval_contexts))),
            (f"every target on the fit window (train, L={probe.train_context})", columns[0]),
        ):
            cells = [
                [target, *_bold_best([_mean_mse(rows, target, m, column) for m in probe.methods])]
                for target in probe.targets
            ]
            table = results.markdown_table(["target", *probe.methods], cells).rstrip("\n")
            lines += ["", f"### {title}", "", table]
    return "\n".join(lines) + "\n"


def _mean_mse(rows: list[dict], target: str, method: str, column: tuple[str, int]) -> float:
    """The MSE of one target, method and (split, context), averaged over seeds."""
    key = (target, method, column)
    mses = [r["mse"] for r in rows if (r["task"], r["method"], (r["split"], r["context"])) == key]
    return np.mean(mses)


def _bold_best(values: list[float]) -> list[str]:
    """Each value to 3 digits, the smallest in bold."""
    return [f"**{v:.3g}**" if v == min(values) else f"{v:.3g}" for v in values]


def plot_fits(path: epath.PathLike, target: str, curves: dict, probe: KernelProbeConfig) -> None:
    """Every method's fit (curves: method -> fit) of `target` over [0, T_max): the RMS error
    per window of lags (the raw curves of a few lags' period would be a solid band), and the
    curves over the last 96 lags, where extrapolation is hardest."""
    import matplotlib  # loaded with the first figure, not with the module

    longest = max(probe.eval_contexts)
    window = max(1, longest // 128)
    lags = np.arange(longest)
    values = target_values(target, lags, probe)
    tail = lags[-96:]
    fig = results.new_figure((11, 9))
    top, bottom = fig.subplots(2, 1)
    colors = matplotlib.colormaps["tab20"].colors  # distinct colours for up to 20 methods
    for index, (method, prediction) in enumerate(curves.items()):
        windows = (prediction - values)[: longest // window * window].reshape(-1, window)
        rms = np.sqrt(np.mean(windows**2, axis=1))
        color = colors[index % len(colors)]
        centres = np.arange(rms.size) * window + window / 2
        top.semilogy(centres, rms, linewidth=1.0, color=color, label=method)
        bottom.plot(tail, prediction[tail], linewidth=0.9, color=color, label=method)
    bottom.plot(tail, values[tail], color="black", linewidth=2.0, label="target")
    top.axvline(probe.train_context, color="gray", linestyle="--", linewidth=1.0)
    top.set(
        xlabel=f"lag d (fit on d < L = {probe.train_context}, dashed)",
        ylabel=f"RMS error per {window} lags",
    )
    top.set_title(f"Kernel probe: fits of the {target} target, extrapolated to T={longest}")
    top.legend(ncol=4, fontsize=7)
    span = np.abs(values[tail]).max()  # fits that blow up leave the frame, not squash the rest
    bottom.set(ylim=(-1.5 * span, 1.5 * span), xlabel="lag d", ylabel="kernel value")
    bottom.set_title(f"the last {tail.size} lags")
    fig.tight_layout()
    results.save_figure(fig, path, dpi=130)


def run(config: Mapping[str, Any], workdir: str) -> list[dict]:
    """Runs the probe of `config`; writes kernel_probe.{csv,md} and a PNG per plot target into
    workdir; returns the CSV rows. UsageError for the workdir of a run or a comparison."""
    probe, workdir = KernelProbeConfig.from_config_dict(config), epath.Path(workdir)
    run_files = ("checkpoints", "starts.jsonl", "comparison.csv")
    if found := [name for name in run_files if (workdir / name).exists()]:
        raise UsageError(f"--workdir {workdir} holds a run ({found[0]}): a probe writes its "
                         "tables into a folder of its own; give it another --workdir.")  # fmt: skip
    rows, plot_curves = probe_rows(probe)
    results.write_csv(workdir / "kernel_probe.csv", rows, CSV_COLUMNS)
    table = markdown_table(rows, probe)
    results.write_text(workdir / "kernel_probe.md", table)
    plots = []
    for target, curves in plot_curves.items():
        plots.append(workdir / f"kernel_probe_{target}_T{max(probe.eval_contexts)}.png")
        plot_fits(plots[-1], target, curves, probe)
    print(table)
    written = [workdir / "kernel_probe.csv", workdir / "kernel_probe.md", *plots]
    print("Probe files:\n" + "\n".join(f"  {path}" for path in written))
    return rows
