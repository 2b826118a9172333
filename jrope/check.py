"""`python -m jrope.check`: prove the accelerator path of a config in minutes, before a long run.

Run it on the machine the run will train on, with the run's config and overrides:

    python -m jrope.check [--config=configs/wikitext_scaled_exact.py] [--config.key=value ...]

It prints one table and writes it as markdown and JSON (--output_dir), then a verdict line;
the exit status is 0 when every check passes, 8 (CHECK_FAILED_STATUS) naming the first failure
and what to do otherwise, 2 when the command line or the config is wrong or --backend names an
accelerator JAX cannot use here (the message says what to install). The checks, in order:

  environment  backend, devices, the versions of jax, jaxlib and the accelerator's packages,
               the mesh the config builds, each device's peak FLOP/s;
  kernels      every attention kernel 'auto' takes for the config at the training length and
               each evaluation length, and every kernel model.attention_impl may force
               (jrope.attention.selection's registry): values and gradients on random q, k, v
               at offsets 0 and 2^30 against a float64 evaluation of the encoding's
               exact formulas, within TOLERANCES; kernels that cannot run here say why;
  precision    the raw-shear encodings' logits at the run's attention precision, at HIGHEST
               and at the backend's default against float64: a compiler that ignores HIGHEST
               fails here, with the error it makes;
  train step   one compiled train step of the config: compile time, step time, tokens/s,
               MFU against the device's peak, the compiler's peak memory against the
               device's; the same for one evaluation forward at the longest length.

Nothing is written but the report: no workdir, no checkpoint, no data download (language-model
sources, which read files, are replaced by random tokens of the config's vocabulary).

Shape legend: B batch, S key length, Q query length (the last Q of the S positions), N heads,
H head dim, nb blocks per head, m chain order.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrope import attention, command_line, commands, encodings, flops, oracle
from jrope.attention import selection
from jrope.errors import ConfigError, UsageError

# The exit status when a check fails (0: all pass; 2: the command line, the config or the host).
CHECK_FAILED_STATUS = 8
# The far offset of the accuracy checks: the first position of the window.
LARGE_OFFSET = 2**30
OFFSETS = (0, LARGE_OFFSET)
# The random problem the kernels are checked on: one sequence of two heads of the run's width.
CHECK_BATCH, CHECK_HEADS = 1, 2
# Splash attention runs off TPU in Pallas interpret mode, checked up to this length (slow).
INTERPRET_MAX_LENGTH = 1024
# The backends that run a kernel natively, for kernels that run elsewhere in interpret mode.
INTERPRETED_KERNELS = {"splash": "tpu"}
# Query rows of the precision check: the last ones, which see the largest lags.
PRECISION_ROWS = 256


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Largest relative errors against float64 (the metrics: `output_error`, `gradient_error`)."""

    values: float
    gradients: float


# The check's tolerances by the arithmetic a kernel's dots run in (docs/accelerators.md lists
# them, with where they come from). 'float32': float32 inputs and dots at full float32 (any dot
# on CPU; HIGHEST on TPU and GPU). 'large shear': the same for the encodings that keep float32
# (Encoding.keeps_float32), whose logits cancel large products, so that float32 itself loses
# more as the window grows. 'reduced': bfloat16 inputs, or float32 dots that the backend runs
# as bfloat16 passes (TPU) or TF32 (NVIDIA) at its default precision, or a fused kernel (cuDNN,
# splash), which runs at its own precision.
TOLERANCES = {
    "float32": Tolerance(values=1e-3, gradients=1e-3),
    "large shear": Tolerance(values=2e-2, gradients=2e-2),
    "reduced": Tolerance(values=5e-2, gradients=1e-1),
}
# The kernels that run their dots at their own precision (jrope.attention.selection).
FUSED_KERNELS = ("cudnn", "splash")
# The raw-shear logits at the run's precision and at HIGHEST, against float64 (`logits_error`).
PRECISION_TOLERANCE = 1e-3
# The raw shear checked for precision whatever the config's encoding (with the config's own
# encoding where that keeps float32 too).
RAW_SHEAR = "jordan_raw_tau"

PASS, FAIL, NOT_APPLICABLE, INFO = "pass", "FAIL", "n/a", "info"


def arithmetic(kernel: str, enc, compute_dtype: str, precision, backend: str) -> str:
    """A key of TOLERANCES: what the kernel's dots compute in here, for this encoding."""
    if kernel in FUSED_KERNELS or compute_dtype == "bfloat16":
        return "reduced"
    if backend != "cpu" and precision != jax.lax.Precision.HIGHEST:
        return "reduced"
    return "large shear" if enc.keeps_float32 else "float32"


# ---------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table; `advice` says what to do when `result` is FAIL."""

    section: str
    check: str
    measured: str
    limit: str = ""
    result: str = INFO
    advice: str = ""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Report:
    """The rows of one check, with the command and the date they were measured with."""

    command: str
    date: str
    rows: tuple[Row, ...]

    @property
    def first_failure(self) -> Row | None:
        return next((row for row in self.rows if row.result == FAIL), None)

    @property
    def exit_status(self) -> int:
        return 0 if self.first_failure is None else CHECK_FAILED_STATUS

    @property
    def verdict(self) -> str:
        failed = [row for row in self.rows if row.result == FAIL]
        if not failed:
            checked = sum(row.result == PASS for row in self.rows)
            return f"PASS: all {checked} checks passed."
        row = failed[0]
        return (
            f"FAIL ({len(failed)} of {sum(r.result in (PASS, FAIL) for r in self.rows)} checks): "
            f"first {row.section}: {row.check}: {row.measured} (limit {row.limit}). {row.advice}"
        )

    def markdown(self) -> str:
        lines = [
            f"`{self.command}` ({self.date})",
            "",
            "| section | check | measured | limit | result |",
            "|---|---|---|---|---|",
        ]
        for row in self.rows:
            cells = (row.section, row.check, row.measured, row.limit, row.result)
            lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
        return "\n".join([*lines, "", self.verdict, ""])

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "date": self.date,
            "verdict": self.verdict,
            "exit_status": self.exit_status,
            "rows": [dataclasses.asdict(row) for row in self.rows],
        }


def write_report(report: Report, output_dir: str, stem: str) -> tuple[str, str]:
    """`<output_dir>/<stem>.md` and `.json` (the folder made); their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = tuple(os.path.join(output_dir, f"{stem}.{ext}") for ext in ("md", "json"))
    with open(paths[0], "w", encoding="utf-8") as file:
        file.write(report.markdown())
    with open(paths[1], "w", encoding="utf-8") as file:
        json.dump(report.to_json(), file, indent=1)
        file.write("\n")
    return paths


def _error(value: float) -> str:
    return f"{value:.1e}"


def _bytes(size: float) -> str:
    for factor, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if size >= factor:
            return f"{size / factor:.3g} {unit}"
    return f"{size / 2**10:.3g} KiB"


# ---------------------------------------------------------------------------------------------
# 1. The environment.
# ---------------------------------------------------------------------------------------------

# What each backend needs installed, and the packages whose versions the report shows.
ACCELERATOR_PACKAGES = {
    "tpu": ("libtpu", "libtpu-nightly"),
    "gpu": (
        "jax-cuda12-plugin",
        "jax-cuda12-pjrt",
        "nvidia-cudnn-cu12",
        "nvidia-cuda-runtime-cu12",
    ),
}
INSTALL_HINTS = {
    "tpu": 'pip install -e ".[train,tpu,gcs]" on a Cloud TPU VM (jax[tpu] with libtpu)',
    "gpu": 'pip install -e ".[train,cuda12,gcs]" on a host with an NVIDIA driver for CUDA 12 '
    "(jax[cuda12]: CUDA and cuDNN from pip)",
}


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def backend_problem(backend: str) -> str | None:
    """Why JAX cannot run on `backend` ('cpu', 'gpu', 'tpu') here, naming what to install; None
    when it can."""
    try:
        jax.devices(backend)
        return None
    except RuntimeError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    installed = [p for p in ACCELERATOR_PACKAGES.get(backend, ()) if installed_version(p)]
    if backend in INSTALL_HINTS and not installed:
        return (
            f"--backend={backend}: JAX has no {backend.upper()} support installed here "
            f"({reason}). Install it: {INSTALL_HINTS[backend]}."
        )
    found = ", ".join(f"{p} {installed_version(p)}" for p in installed) or "nothing"
    return (
        f"--backend={backend}: JAX cannot start the {backend.upper()} backend ({reason}); "
        f"installed: {found}. Run on a machine with the accelerator, and check that no other "
        "process holds it."
    )


def environment_rows(mesh_shape: dict[str, int], compute_dtype: str, requested: str) -> list[Row]:
    """Backend, devices, versions, mesh and peak FLOP/s (INFO), and a FAIL where JAX runs on the
    CPU although an accelerator's packages are installed and no backend was asked for."""
    devices = jax.devices()
    backend = jax.default_backend()
    kinds = sorted({device.device_kind for device in devices})
    client = devices[0].client
    rows = [
        Row(
            "environment",
            "backend",
            f"{backend}: {len(devices)} x {', '.join(kinds)}, {jax.process_count()} process(es); "
            f"{client.platform_version.strip().splitlines()[0]}",
        ),
    ]
    packages = ["jax", "jaxlib", *ACCELERATOR_PACKAGES.get(backend, ())]
    versions = {name: installed_version(name) for name in packages}
    rows.append(
        Row(
            "environment",
            "versions",
            ", ".join(f"{name} {version}" for name, version in versions.items() if version),
            details=versions,
        )
    )
    rows.append(
        Row(
            "environment",
            "mesh",
            " x ".join(f"{axis} {size}" for axis, size in mesh_shape.items()),
            details=dict(mesh_shape),
        )
    )
    peaks = []
    for kind in kinds:
        bf16, fp32 = flops.PEAK_FLOPS.get(kind, (None, None))
        if bf16 is None and fp32 is None:
            peaks.append(f"{kind}: unknown (no MFU; add it to jrope.flops.PEAK_FLOPS)")
        else:
            shown = [
                f"{name} {value / 1e12:g} TFLOP/s"
                for name, value in (("bfloat16", bf16), ("float32", fp32))
                if value
            ]
            peaks.append(f"{kind}: {', '.join(shown)} per device")
    rows.append(Row("environment", f"peak FLOP/s ({compute_dtype} runs)", "; ".join(peaks)))
    if backend == "cpu" and not requested:
        for accelerator, packages in ACCELERATOR_PACKAGES.items():
            found = [p for p in packages if installed_version(p)]
            if found:
                rows.append(
                    Row(
                        "environment",
                        "accelerator in use",
                        f"JAX runs on the CPU although {', '.join(found)} is installed",
                        f"the {accelerator.upper()}",
                        FAIL,
                        f"JAX did not start the {accelerator.upper()}: run with "
                        f"--backend={accelerator} to see why, or --backend=cpu to check the CPU.",
                    )
                )
    return rows


# ---------------------------------------------------------------------------------------------
# 2. The kernels against float64.
# ---------------------------------------------------------------------------------------------


def output_error(got: np.ndarray, want: np.ndarray) -> float:
    """Worst over rows (query, head) of max |got - want| / max |want| over the head dim."""
    error = np.abs(got - want).max(-1)
    return float(np.max(error / np.maximum(np.abs(want).max(-1), 1e-300)))


def gradient_error(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> tuple[float, str]:
    """(worst over tensors of max |got - want| / max |want|, the worst tensor's name)."""
    errors = {
        name: float(np.abs(got[name] - want[name]).max() / max(np.abs(want[name]).max(), 1e-300))
        for name in want
    }
    worst = max(errors, key=errors.get)
    return errors[worst], worst


def check_parameters(enc: encodings.Encoding) -> dict[str, jax.Array]:
    """The initial parameters perturbed (seeded), shear and jet gates at 0.9 of their bound:
    a trained model's spread, where the shear's terms are largest."""
    params = dict(enc.init_params())
    keys = jax.random.split(jax.random.PRNGKey(0), max(len(params), 1))
    for key, name in zip(keys, sorted(params), strict=False):
        params[name] = params[name] + 0.3 * jax.random.normal(key, params[name].shape)
    for name in ("eta_raw", "jet_gates_raw"):
        if name in params:
            params[name] = jnp.full_like(params[name], math.atanh(0.9))
    return params


@dataclasses.dataclass(frozen=True)
class Problem:
    """One random window: q, k, v [B, S, N, H] in the compute dtype and a float32 cotangent w
    [B, S, N, H] (the loss is sum(out * w) over the rows of the queries)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    w: jax.Array

    @classmethod
    def random(cls, length: int, heads: int, head_dim: int, dtype: str) -> Problem:
        shape = (CHECK_BATCH, length, heads, head_dim)
        keys = jax.random.split(jax.random.PRNGKey(length), 4)
        q, k, v = (jax.random.normal(key, shape).astype(dtype) for key in keys[:3])
        return cls(q, k, v, jax.random.normal(keys[3], shape))

    def rows(self, num_queries: int) -> tuple[jax.Array, jax.Array]:
        """(q, w) of the last `num_queries` rows."""
        first = self.k.shape[1] - num_queries
        return self.q[:, first:], self.w[:, first:]


def _attention_loss(attend: Callable) -> Callable:
    """jit of value_and_grad of sum(attend(...) w): ((loss, out), (dq, dk, dv, dparams))."""

    def loss(q, k, v, params, w, positions):
        out = attend(q, k, v, params, positions)
        return jnp.sum(out.astype(w.dtype) * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@dataclasses.dataclass(frozen=True)
class KernelCase:
    """One kernel at one window: the attention of the last Q of S positions, or why not (skip)."""

    kernel: str
    length: int  # S
    num_queries: int  # Q
    auto: bool = False  # 'auto' takes this kernel here
    forced: bool = False  # an explicit attention_impl runs it here
    interpret: bool = False  # Pallas interpret mode (off the kernel's own backend)
    skip: str | None = None
    translation_invariant: bool = True  # the encoding's (see _case_errors)

    @property
    def label(self) -> str:
        queries = "" if self.num_queries == self.length else f", last {self.num_queries} of them"
        who = " and ".join(
            name for name, on in (("auto", self.auto), ("forced", self.forced)) if on
        )
        mode = ", interpret mode" if self.interpret else ""
        return f"{self.kernel} at {self.length}{queries} ({who}{mode})"


def kernel_cases(cfg, enc, params, backend: str) -> list[KernelCase]:
    """What 'auto' and each attention_impl of jrope.attention.selection run at every window of
    the config (training and evaluation lengths; the last query too under readout 'last'),
    then one skip per kernel and reason."""
    lengths = sorted({cfg.pe.train_context, *cfg.eval.lengths})
    windows = [(length, length) for length in lengths]
    if cfg.model.readout == "last":
        windows += [(length, 1) for length in lengths]
    damping = enc.largest_damping(params)
    cases: dict[tuple[str, int, int], KernelCase] = {}
    skipped: dict[tuple[str, str], list[int]] = {}
    for length, num_queries in windows:
        for impl in selection.ATTENTION_IMPLS:
            model_cfg = dataclasses.replace(cfg.model, attention_impl=impl)

            def choose(on: str, model_cfg=model_cfg, length=length, num_queries=num_queries):
                return selection.choose_kernel(
                    model_cfg.attention,
                    enc,
                    length=length,
                    num_queries=num_queries,
                    backend=on,
                    damping=damping,
                )

            interpret = False
            try:
                kernel = choose(backend)
            except ValueError as refusal:
                native = INTERPRETED_KERNELS.get(impl)
                reason = _first_line(refusal)
                if native is not None and native != backend:
                    try:
                        kernel, interpret = choose(native), True
                    except ValueError as native_refusal:
                        reason = _first_line(native_refusal)
                    if interpret and length > INTERPRET_MAX_LENGTH:
                        reason = (
                            f"it runs on {native.upper()}; here in Pallas interpret mode up to "
                            f"{INTERPRET_MAX_LENGTH} tokens (slow)"
                        )
                        interpret = False
                if not interpret:
                    skipped.setdefault((impl, reason), []).append(length)
                    continue
            key = (kernel, length, num_queries)
            case = cases.get(key) or KernelCase(
                kernel,
                length,
                num_queries,
                interpret=interpret,
                translation_invariant=enc.cfg.is_translation_invariant,
            )
            cases[key] = dataclasses.replace(
                case, auto=case.auto or impl == "auto", forced=case.forced or impl != "auto"
            )
    ordered = sorted(cases.values(), key=lambda c: (c.kernel, c.length, -c.num_queries))
    for (impl, reason), at in skipped.items():
        shown = ", ".join(map(str, sorted(set(at))))
        ordered.append(KernelCase(impl, min(at), 0, skip=f"{reason} (lengths {shown})"))
    return ordered


def kernel_rows(cfg, backend: str, say: Callable[[str], None]) -> list[Row]:
    """Section 2: every kernel case against float64 at offsets 0 and LARGE_OFFSET."""
    dtype = cfg.model.compute_dtype
    enc = encodings.make_encoding(
        cfg.pe,
        CHECK_HEADS,
        cfg.model.head_dim,
        max_length=max(cfg.pe.train_context, *cfg.eval.lengths),
    )
    params = check_parameters(enc)
    block_size = selection.blockwise_block_size(cfg.model.block_size, enc.largest_damping(params))
    problems: dict[int, Problem] = {}
    rows = []
    for case in kernel_cases(cfg, enc, params, backend):
        if case.skip:
            rows.append(Row("kernels", case.kernel, f"n/a: {case.skip}", result=NOT_APPLICABLE))
            continue
        say(f"  {case.label}")
        started = time.perf_counter()
        if case.length not in problems:
            problems[case.length] = Problem.random(
                case.length, CHECK_HEADS, cfg.model.head_dim, dtype
            )
        precision = attention.attention_precision(cfg.model.attention, enc, case.kernel)
        kind = arithmetic(case.kernel, enc, dtype, precision, backend)
        promised = TOLERANCES[kind]
        limit = f"{_error(promised.values)} / {_error(promised.gradients)} ({kind})"
        attend = _kernel_loss(enc, case.kernel, block_size, precision)
        try:
            errors = [
                _case_errors(attend, enc, problems[case.length], params, offset, case)
                for offset in OFFSETS
            ]
        except Exception as error:  # a kernel that fails to compile or run is the finding
            measured = f"error: {type(error).__name__}: {_first_line(error)}"
            rows.append(Row("kernels", case.label, measured, limit, FAIL, _kernel_advice(case)))
            continue
        value, value_offset = max((e[0], o) for e, o in zip(errors, OFFSETS, strict=True))
        (gradient, tensor), gradient_offset = max(
            (e[1], o) for e, o in zip(errors, OFFSETS, strict=True)
        )
        passed = value <= promised.values and gradient <= promised.gradients
        rows.append(
            Row(
                "kernels",
                case.label,
                f"values {_error(value)} (offset {_offset(value_offset)}), gradients "
                f"{_error(gradient)} ({tensor}, offset {_offset(gradient_offset)})",
                limit,
                PASS if passed else FAIL,
                "" if passed else _kernel_advice(case),
                details={
                    **dataclasses.asdict(case),
                    "value_error": value,
                    "gradient_error": gradient,
                    "worst_gradient": tensor,
                    "seconds": round(time.perf_counter() - started, 1),
                },
            )
        )
    return rows


def _kernel_loss(enc, kernel: str, block_size: int, precision) -> Callable:
    """The loss and gradients of jrope.attention.causal_attention with `kernel` (splash
    interprets itself off TPU)."""
    return _attention_loss(
        lambda q, k, v, params, positions: attention.causal_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            positions=positions,
            kernel=kernel,
            block_size=block_size,
            precision=precision,
        )
    )


def _case_errors(attend, enc, problem: Problem, params, offset: int, case: KernelCase):
    """(value error, (gradient error, worst tensor)) of one case at one offset.

    The stabilized encodings' shear reads the absolute position through the bounded time,
    whose slope vanishes far from 0: there the true gradient of the shear parameters is
    about zero and float32 returns the rounding of the cancelling terms, so their parameter
    gradients are compared at offset 0 only (training positions start at 0).
    """
    q, w = problem.rows(case.num_queries)
    positions = jnp.arange(case.length, dtype=jnp.int32) + jnp.int32(offset)
    want_out, want_grads = oracle.attention_and_gradients(
        enc, params, q, problem.k, problem.v, w, positions
    )
    (_, out), grads = attend(q, problem.k, problem.v, params, w, positions)
    got_grads = oracle.named_gradients(grads)
    if offset and not case.translation_invariant:
        want_grads = {name: want_grads[name] for name in ("dq", "dk", "dv")}
    return output_error(oracle.as_float64(out), want_out), gradient_error(got_grads, want_grads)


def _offset(offset: int) -> str:
    return "2^30" if offset == LARGE_OFFSET else str(offset)


def _kernel_advice(case: KernelCase) -> str:
    return (
        f"Do not run the {case.kernel} kernel at length {case.length} here: set "
        "--config.model.attention_impl to a kernel that passed at this length (the table lists "
        "them), or leave this length out of --config.eval.lengths."
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---------------------------------------------------------------------------------------------
# 3. Precision: the raw shear's logits.
# ---------------------------------------------------------------------------------------------


def logits_error(got: np.ndarray, want: np.ndarray, visible: np.ndarray) -> float:
    """Worst over heads of max |got - want| / max |want| over the visible (causal) logits."""
    error = np.where(visible, np.abs(got - want), 0.0).max((-2, -1))
    scale = np.where(visible, np.abs(want), 0.0).max((-2, -1))
    return float(np.max(error / np.maximum(scale, 1e-300)))


def precision_rows(cfg, backend: str) -> list[Row]:
    """Section 3: the raw-shear encodings' logits at the longest length, at the run's precision,
    at HIGHEST and at the backend's default, against float64 (the last PRECISION_ROWS queries)."""
    length = max(cfg.pe.train_context, *cfg.eval.lengths)
    names = [RAW_SHEAR]
    if (
        encodings.make_encoding(
            cfg.pe, CHECK_HEADS, cfg.model.head_dim, max_length=length
        ).keeps_float32
        and cfg.pe.name != RAW_SHEAR
    ):
        names.insert(0, cfg.pe.name)
    rows = []
    for name in names:
        pe = cfg.pe if name == cfg.pe.name else _pe_named(name, cfg)
        try:
            enc = encodings.make_encoding(pe, CHECK_HEADS, cfg.model.head_dim, max_length=length)
        except ValueError as error:
            rows.append(Row("precision", name, f"n/a: {_first_line(error)}", result=NOT_APPLICABLE))
            continue
        rows.append(_precision_row(cfg, enc, length, backend))
    return rows


def _pe_named(name: str, cfg):
    import jrope

    return jrope.pe_config_from_name(name, train_context=cfg.pe.train_context, theta=cfg.pe.theta)


def _precision_row(cfg, enc, length: int, backend: str) -> Row:
    params = check_parameters(enc)
    num_queries = min(PRECISION_ROWS, length)
    problem = Problem.random(length, CHECK_HEADS, cfg.model.head_dim, cfg.model.compute_dtype)
    q, _ = problem.rows(num_queries)
    positions = jnp.arange(length, dtype=jnp.int32)
    with oracle.float64():
        want = np.asarray(
            jax.jit(oracle.logits, static_argnums=0)(
                enc,
                *oracle.as_float64((params, q, problem.k)),
                positions[length - num_queries :],
                positions,
            )
        )
    visible = np.arange(length - num_queries, length)[:, None] >= np.arange(length)[None, :]

    def error_at(precision) -> float:
        logits = jax.jit(
            lambda params, q, k: encodings.attention_logits(
                enc,
                params,
                q,
                k,
                positions[length - num_queries :],
                positions,
                precision=precision,
            )
        )(params, q, problem.k)
        return logits_error(np.asarray(logits, np.float64), want, visible[None, None])

    run_precision = (
        attention.attention_precision(cfg.model.attention, enc) or jax.lax.Precision.DEFAULT
    )
    errors = {
        "run": error_at(run_precision),
        "highest": error_at(jax.lax.Precision.HIGHEST),
        "default": error_at(jax.lax.Precision.DEFAULT),
    }
    run_name = run_precision.name.lower()
    measured = (
        f"run's ({run_name}) {_error(errors['run'])}, highest {_error(errors['highest'])}, "
        f"default {_error(errors['default'])}"
    )
    label = f"{enc.cfg.name} logits at {length} (last {num_queries} queries)"
    advice = ""
    if errors["highest"] > PRECISION_TOLERANCE:
        advice = (
            f"The compiler on this {backend.upper()} does not honour HIGHEST: the raw shear "
            f"loses its lag term. Train {enc.cfg.name} elsewhere, or an encoding that needs no "
            "HIGHEST (pe.name=jordan_exact_scaled), and report it to JAX with this table."
        )
    elif errors["run"] > PRECISION_TOLERANCE:
        advice = (
            f"model.attention_precision={cfg.model.attention_precision!r} runs these dots at "
            f"{run_name}: set --config.model.attention_precision=auto (highest for {enc.cfg.name})."
        )
    return Row(
        "precision",
        label,
        measured,
        f"{_error(PRECISION_TOLERANCE)} (run's, highest)",
        FAIL if advice else PASS,
        advice,
        details={"encoding": enc.cfg.name, "length": length, **errors},
    )


# ---------------------------------------------------------------------------------------------
# 4. One train step and one evaluation forward of the config.
# ---------------------------------------------------------------------------------------------


class RandomTokens:
    """Random tokens of a vocabulary, in the batches of a language-model source
    (jrope.data.source's contract): the check's stand-in for sources that read files."""

    task = "language_model"
    num_classes = None

    def __init__(self, vocab_size: int, seq_len: int, global_batch_size: int):
        self.vocab_size = vocab_size
        self._seq_len = seq_len
        self._rows = global_batch_size // jax.process_count()

    def _batch(self, rows: int, length: int, seed: int) -> dict[str, np.ndarray]:
        tokens = np.random.default_rng(seed).integers(0, self.vocab_size, (rows, length + 1))
        tokens = tokens.astype(np.int32)
        weights = np.ones((rows, length), np.float32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        return self._batch(self._rows, self._seq_len, step)

    def eval_batches(self, length, num_sequences, batch_size, seed=0):
        for index in range(num_sequences // batch_size):
            yield self._batch(batch_size // jax.process_count(), length, seed + index)


def check_source(cfg):
    """The config's data source where it generates its data; random tokens for language-model
    sources, which read (and would first download or prepare) files."""
    from jrope.data.source import build_source, source_spec

    _, source_class = source_spec(cfg.data.source).load()
    if source_class.task == "language_model":
        return RandomTokens(cfg.data.vocab_size, cfg.pe.train_context, cfg.batch_size)
    return build_source(cfg.data, cfg.batch_size, jax.process_index(), jax.process_count())


def _timed(call: Callable[[], Any], repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up (each call blocks on its result)."""
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def step_rows(cfg, timed_steps: int, say: Callable[[str], None]) -> tuple[list[Row], dict]:
    """Section 4: the train step and the evaluation forward at the longest length; also the
    mesh's shape (for section 1)."""
    from flax import nnx

    from jrope.train.setup import set_up_run
    from jrope.train.trainer import make_train_step

    source = check_source(cfg)
    run = set_up_run(cfg, source=source)
    rows: list[Row] = []
    if isinstance(source, RandomTokens):
        rows.append(
            Row(
                "train step",
                "data",
                f"random tokens of the vocabulary ({source.vocab_size}): data.source="
                f"{cfg.data.source!r} reads files, which the check leaves alone",
            )
        )
    memory, memory_kind = flops.device_memory()
    devices = run.mesh.devices.flatten().tolist()
    peak_flops = flops.peak_flops_per_sec(devices, cfg.model.compute_dtype)
    io = (
        {"vocab_size": source.vocab_size}
        if source.task != "regression"
        else {
            "vocab_size": None,
            "input_channels": source.input_channels,
            "output_channels": source.output_channels,
        }
    )
    with jax.set_mesh(run.mesh):
        say("  the train step")
        state = run.init_state()
        batch = run.source.train_batch(0)
        step = make_train_step(run)
        started = time.perf_counter()
        compiled = step.lower(run.layout.abstract, batch).compile()
        compile_seconds = time.perf_counter() - started
        holder = {"state": state}

        def train_once():
            holder["state"], metrics = compiled(holder["state"], batch)
            return metrics

        step_seconds = _timed(train_once, timed_steps)
        loss = float(train_once()["loss"])
        tokens = cfg.batch_size * cfg.pe.train_context
        train_flops = flops.model_flops_per_step(
            cfg.model, cfg.batch_size, cfg.pe.train_context, **io
        )
        rows += _step_rows(
            "train step",
            cfg.pe.train_context,
            cfg.batch_size,
            compile_seconds,
            step_seconds,
            tokens,
            train_flops["total"],
            peak_flops,
            flops.peak_memory(compiled),
            memory,
            memory_kind,
            loss,
            "lower --config.batch_size (the global batch), set --config.model.remat=full, or "
            "run on more devices",
        )

        length = max(cfg.eval.lengths)
        say(f"  the evaluation forward at {length}")
        rows_per_batch = cfg.eval.batch_size
        eval_batch = next(iter(run.source.eval_batches(length, rows_per_batch, rows_per_batch)))
        params = holder["state"]["params"]
        graphdef = run.layout.graphdef

        def forward(params, inputs):
            model = nnx.merge(graphdef, params)
            outputs_ = model(inputs, jnp.arange(inputs.shape[1], dtype=jnp.int32))
            return jnp.mean(outputs_.astype(jnp.float32))

        started = time.perf_counter()
        compiled_eval = jax.jit(forward).lower(params, eval_batch["inputs"]).compile()
        eval_compile = time.perf_counter() - started
        eval_seconds = _timed(lambda: compiled_eval(params, eval_batch["inputs"]), timed_steps)
        eval_value = float(compiled_eval(params, eval_batch["inputs"]))
        eval_flops = flops.model_flops_per_step(cfg.model, rows_per_batch, length, **io)
        rows += _step_rows(
            f"eval forward at {length}",
            length,
            rows_per_batch,
            eval_compile,
            eval_seconds,
            rows_per_batch * length,
            eval_flops["total"] / 3.0,
            peak_flops,
            flops.peak_memory(compiled_eval),
            memory,
            memory_kind,
            eval_value,
            f"lower --config.eval.batch_size, or leave {length} out of --config.eval.lengths "
            "(fewer lengths)",
        )
    return rows, dict(run.mesh.shape)


def _step_rows(
    section,
    length,
    rows_per_batch,
    compile_seconds,
    step_seconds,
    tokens,
    flops,
    peak_flops,
    peak,
    memory,
    memory_kind,
    value,
    memory_advice,
) -> list[Row]:
    rate = f"{step_seconds:.3g} s, {tokens / step_seconds:,.0f} tokens/s"
    if peak_flops:
        rate += f", MFU {100 * flops / step_seconds / peak_flops:.1f} %"
    else:
        rate += ", MFU unknown (no peak for this device kind)"
    fits = memory is None or peak <= memory
    finite = math.isfinite(value)
    return [
        Row(section, f"compile ({rows_per_batch} x {length} tokens)", f"{compile_seconds:.1f} s"),
        Row(
            section,
            "step time (median)",
            rate,
            "finite output",
            PASS if finite else FAIL,
            ""
            if finite
            else "The step's output is not finite at the initial parameters: "
            "check the table's kernels and precision rows, and lower the learning rate.",
            details={
                "seconds": step_seconds,
                "tokens_per_second": tokens / step_seconds,
                "model_flops": flops,
                "peak_flops_per_second": peak_flops,
                "output": value,
            },
        ),
        Row(
            section,
            "peak memory (compiler)",
            _bytes(peak),
            f"{_bytes(memory)} {memory_kind}" if memory else "unknown",
            PASS if fits else FAIL,
            "" if fits else f"It does not fit: {memory_advice}.",
            details={"peak_bytes": peak, "memory_bytes": memory},
        ),
    ]


# ---------------------------------------------------------------------------------------------
# The whole check, and the command.
# ---------------------------------------------------------------------------------------------


def run_check(
    cfg,
    *,
    command: str,
    requested_backend: str = "",
    timed_steps: int = 3,
    say: Callable[[str], None] = print,
) -> Report:
    """Every section for the run config `cfg` (jrope.train.config.TrainConfig) on JAX's default
    backend; `requested_backend` is --backend ('' when JAX chose)."""
    backend = jax.default_backend()
    say("Train and evaluation steps:")
    step_section, mesh_shape = step_rows(cfg, timed_steps, say)
    say("Kernels against float64:")
    kernel_section = kernel_rows(cfg, backend, say)
    say("Precision of the raw shear:")
    precision_section = precision_rows(cfg, backend)
    rows = [
        *environment_rows(mesh_shape, cfg.model.compute_dtype, requested_backend),
        *kernel_section,
        *precision_section,
        *step_section,
    ]
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return Report(command, date, tuple(rows))


# The config checked when --config is not given: the paper's WikiText setting (the clone's file,
# or an installed package's copy).
DEFAULT_CONFIG = commands.config_path("wikitext_scaled_exact")
# --backend's names, as JAX's platform list (the CPU beside an accelerator runs float64).
PLATFORMS = {"cpu": "cpu", "gpu": "cuda,cpu", "tpu": "tpu,cpu"}


def main(argv: Sequence[str]) -> None:
    from absl import flags

    from jrope.train.config import convert_config

    if len(argv) > 1:
        raise UsageError(f"Unexpected arguments: {list(argv[1:])}; give the config with --config.")
    values = flags.FLAGS
    backend = values.backend
    if backend:
        jax.config.update("jax_platforms", PLATFORMS[backend])
    problem = backend_problem(backend or jax.default_backend())
    if problem:
        raise UsageError(problem)
    cfg, problems = convert_config(values.config)
    if problems:
        raise ConfigError(problems)
    config_path = command_line.flag_argument(sys.argv, "config") or DEFAULT_CONFIG
    command = " ".join(["python -m jrope.check", *sys.argv[1:]])
    print(f"Checking {config_path} on {jax.default_backend()}:", flush=True)
    report = run_check(
        cfg,
        command=command,
        requested_backend=backend,
        timed_steps=values.timed_steps,
        say=lambda line: print(line, flush=True),
    )
    print()
    print(report.markdown(), flush=True)
    stem = f"{os.path.splitext(os.path.basename(config_path))[0]}_{jax.default_backend()}"
    paths = write_report(report, values.output_dir, stem)
    print(f"Written: {paths[0]}, {paths[1]}")
    sys.exit(report.exit_status)


def run_main() -> None:
    """The command line (flags defined here: importing this module defines none)."""
    from absl import flags

    if command_line.flag_argument(sys.argv, "config") is None:
        sys.argv.insert(1, f"--config={DEFAULT_CONFIG}")

    def define_flags(argv: Sequence[str]) -> None:
        from ml_collections import config_flags

        config_flags.DEFINE_config_file(
            "config",
            None,
            "The run's config file (default: configs/wikitext_scaled_exact.py).",
            lock_config=True,
        )
        flags.DEFINE_string(
            "output_dir",
            "runs/check",
            "Where the report goes (<config>_<backend>.md and .json): beside the runs, under the "
            "git-ignored runs/ of the working directory.",
        )
        flags.DEFINE_enum(
            "backend",
            "",
            ["", *PLATFORMS],
            "Check this backend (default: the one JAX picks); asked for and absent, the check says "
            "what to install.",
        )
        flags.DEFINE_integer(
            "timed_steps", 3, "Steps timed after the warm-up (the median counts).", lower_bound=1
        )

    command_line.run(main, define_flags)


if __name__ == "__main__":
    run_main()
