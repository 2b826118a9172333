"""`python -m jrope.check`: prove a config's attention kernels and train step where it will train.

    python -m jrope.check [--config=wikitext_scaled_exact] [--config.key=value ...] [--output_dir=DIR]

One table and a verdict line (with --output_dir also `<config>_<backend>.md` and `.json` there;
nothing else is written). Exit status 0 when every check passes, 8 (CHECK_FAILED_STATUS) naming
the first failure and the fix, 2 for a command line or config that cannot run here. Sections:

  environment  the devices (jax.print_environment_info() to stderr); JAX on the CPU beside an
               accelerator's packages fails;
  kernels      every kernel 'auto' or model.attention_impl takes at the config's lengths, against
               the float64 oracle (jrope.oracle): values and gradients at offsets 0 and 2^30,
               packed where data.pack is set; a kernel that cannot run here says why;
  precision    the raw shear's logits at the run's precision, HIGHEST and the default;
  train step   one compiled step: time, tokens/s, MFU, a finite loss, peak memory.

Shape legend: B batch, S key length, Q query length (the last Q of S), N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jrope import attention, command_line, encodings, flops, oracle, pe_config, results
from jrope.attention import selection
from jrope.errors import ConfigError, UsageError

CHECK_FAILED_STATUS = 8
OFFSETS = (0, 2**30)  # the accuracy checks' first positions
CHECK_HEADS = 2  # the random problem: one sequence of two heads of the run's head dim
INTERPRET_MAX_LENGTH = 1024  # splash runs off TPU in Pallas interpret mode up to this length
PRECISION_ROWS = 256  # the precision check's queries: the last, which see the largest lags
RAW_SHEAR = "jordan_raw_tau"  # checked for precision whatever the config's encoding
PRECISION_TOLERANCE = 1e-3
PASS, FAIL, NOT_APPLICABLE, INFO = "pass", "FAIL", "n/a", "info"
# Largest relative errors (values, gradients) against float64, by what a kernel's dots compute in
# (docs/accelerators.md): 'float32', full float32 dots (any on CPU, HIGHEST elsewhere); 'large
# shear', the same for the encodings that keep float32, whose logits cancel large products;
# 'reduced', bfloat16 inputs, float32 dots at a TPU's or GPU's default (bfloat16 passes, TF32),
# or a fused kernel at its own precision.
TOLERANCES = {"float32": (1e-3, 1e-3), "large shear": (2e-2, 2e-2), "reduced": (5e-2, 1e-1)}
# What each accelerator backend needs installed: its packages and the project's extra.
ACCELERATORS = {
    "tpu": (("libtpu",), "train,tpu,gcs"),
    "gpu": (("jax-cuda12-plugin", "jax-cuda12-pjrt"), "train,cuda12,gcs"),
}


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
    """The rows of one check, with its command, date and jax.print_environment_info()."""

    command: str
    date: str
    rows: tuple[Row, ...]
    environment: str = ""

    @property
    def exit_status(self) -> int:
        return CHECK_FAILED_STATUS if any(row.result == FAIL for row in self.rows) else 0

    @property
    def verdict(self) -> str:
        failed = [row for row in self.rows if row.result == FAIL]
        checked = sum(row.result in (PASS, FAIL) for row in self.rows)
        if not failed:
            return f"PASS: all {checked} checks passed."
        first = failed[0]
        return (
            f"FAIL ({len(failed)} of {checked} checks): first {first.section}: {first.check}: "
            f"{first.measured} (limit {first.limit}). {first.advice}"
        )

    def markdown(self) -> str:
        columns = ("section", "check", "measured", "limit", "result")
        cells = [[getattr(row, c).replace("|", "/") for c in columns] for row in self.rows]
        table = results.markdown_table(columns, cells)
        return f"`{self.command}` ({self.date})\n\n{table}\n{self.verdict}\n"

    def to_json(self) -> dict[str, Any]:
        return dict(dataclasses.asdict(self), verdict=self.verdict, exit_status=self.exit_status)


def _error(value: float) -> str:
    return f"{value:.1e}"


def _first_line(error: BaseException) -> str:
    return (str(error).strip() or type(error).__name__).splitlines()[0]


def attempt(catch, function: Callable, *args, **kwargs) -> tuple[Any, Exception | None]:
    """(function(*args, **kwargs), None), or (None, the error of kind `catch` it raised): the one
    place a check records a failure or a refusal instead of stopping."""
    try:
        return function(*args, **kwargs), None
    except catch as error:
        return None, error


def backend_problem(backend: str) -> str | None:
    """Why JAX cannot run on `backend` here, with what to install; None when it can."""
    _, error = attempt(RuntimeError, jax.devices, backend)
    if error is None:
        return None
    packages, extra = ACCELERATORS.get(backend, ((), ""))
    problem = f"--backend={backend}: {_first_line(error)}"
    if extra and not any(flops.installed_version(package) for package in packages):
        problem += f"; install: {command_line.install_command(extra)}"
    return problem + "."


def environment_rows(requested: str) -> list[Row]:
    """The backend and its devices; a FAIL where JAX runs on the CPU beside an accelerator's
    packages and no --backend asked for the CPU."""
    devices, backend = jax.devices(), jax.default_backend()
    kinds = ", ".join(sorted({device.device_kind for device in devices}))
    rows = [Row("environment", "backend", f"{backend}: {len(devices)} x {kinds}")]
    for accelerator, (packages, _) in ACCELERATORS.items():
        found = [package for package in packages if flops.installed_version(package)]
        if backend == "cpu" and found and not requested:
            advice = f"Use --backend={accelerator} or --backend=cpu."
            rows.append(Row("environment", "unused accelerator", found[0], "", FAIL, advice))
    return rows


def relative_error(got: np.ndarray, want: np.ndarray, axis=None) -> float:
    """Worst over `axis`'s slices (values: per query and head, axis -1) of max |got - want| /
    max |want|; over the whole array by default (a gradient)."""
    error, scale = np.abs(got - want).max(axis), np.abs(want).max(axis)
    return float(np.max(error / np.maximum(scale, 1e-300)))


def check_parameters(enc: encodings.Encoding) -> dict[str, jax.Array]:
    """The initial parameters perturbed (seeded), shears and jet gates at 0.9 of their bound:
    a trained model's spread, where the shear's terms are largest."""
    params = dict(enc.init_params())
    keys = jax.random.split(jax.random.PRNGKey(0), max(len(params), 1))
    for key, name in zip(keys, sorted(params), strict=False):
        params[name] = params[name] + 0.3 * jax.random.normal(key, params[name].shape)
        if name in ("eta_raw", "jet_gates_raw"):
            params[name] = jnp.full_like(params[name], math.atanh(0.9))
    return params


def kernel_rows(cfg, backend: str, say: Callable[[str], None]) -> list[Row]:
    """What 'auto' and each attention_impl run at every window of the config (training and
    evaluation lengths; the last query alone under readout 'last'), against the oracle."""
    packed = bool(getattr(cfg.data, "pack", False))
    head_dim, max_length = cfg.model.head_dim, max(cfg.pe.train_context, *cfg.eval.lengths)
    enc = encodings.make_encoding(cfg.pe, CHECK_HEADS, head_dim, max_length=max_length)
    params = check_parameters(enc)
    damping = enc.largest_damping(params)
    lengths = sorted({cfg.pe.train_context, *cfg.eval.lengths})
    windows = [(n, n) for n in lengths] + [(n, 1) for n in lengths if cfg.model.readout == "last"]
    runs, skips = {}, {}  # {(kernel, length, queries): (impls, interpret)}, {(impl, why): lengths}
    for length, queries in windows:
        for impl in selection.ATTENTION_IMPLS:
            settings = dataclasses.replace(cfg.model, attention_impl=impl).attention
            # splash runs off TPU in interpret mode, as a TPU would choose it
            interpret = impl == "splash" and backend != "tpu" and length <= INTERPRET_MAX_LENGTH
            window = dict(length=length, num_queries=queries, damping=damping, packed=packed)
            window["backend"] = "tpu" if interpret else backend
            kernel, refusal = attempt(ValueError, selection.choose_kernel, settings, enc, **window)
            if refusal:
                skips.setdefault((impl, _first_line(refusal)), []).append(length)
                continue
            runs.setdefault((kernel, length, queries), (set(), interpret))[0].add(impl)
    rows = []
    for (kernel, length, queries), (impls, interpret) in sorted(runs.items()):
        label = f"{kernel} at {length}" + (f", the last {queries}" if queries < length else "")
        label += " (auto)" if "auto" in impls else " (forced)"
        label += ", interpret mode" if interpret else ""
        say(f"  {label}")
        case = dict(kernel=kernel, length=length, queries=queries, packed=packed)
        rows.append(_kernel_row(cfg, enc, params, case, label, backend))
    for (impl, reason), at in skips.items():
        shown = ", ".join(map(str, sorted(set(at))))
        rows.append(Row("kernels", impl, f"n/a: {reason} (lengths {shown})", result=NOT_APPLICABLE))
    return rows


def _kernel_row(cfg, enc, params, case, label, backend) -> Row:
    precision = attention.attention_precision(cfg.model.attention, enc, case["kernel"])
    kind = "large shear" if enc.keeps_float32 else "float32"  # TOLERANCES's keys
    fused = case["kernel"] in ("cudnn", "splash") or cfg.model.compute_dtype == "bfloat16"
    if fused or (backend != "cpu" and precision != jax.lax.Precision.HIGHEST):
        kind = "reduced"
    values, gradients = TOLERANCES[kind]
    limit = f"{_error(values)} / {_error(gradients)} ({kind})"
    advice = f"Use a model.attention_impl that passed at {case['length']}."
    case_errors = functools.partial(_case_errors, cfg, enc, params, case, precision)
    errors, error = attempt(Exception, lambda: [case_errors(offset) for offset in OFFSETS])
    if error:  # a kernel that fails to compile or run is the finding
        return Row("kernels", label, f"error: {_first_line(error)}", limit, FAIL, advice, case)
    value, at = max((e[0], offset) for e, offset in zip(errors, OFFSETS, strict=True))
    (gradient, tensor), gradient_at = max((e[1], o) for e, o in zip(errors, OFFSETS, strict=True))
    measured = f"values {_error(value)} (offset {at}), gradients {_error(gradient)} ({tensor}, "
    measured += f"offset {gradient_at})"
    details = {**case, "value_error": value, "gradient_error": gradient, "worst": tensor}
    result, advice = (PASS, "") if value <= values and gradient <= gradients else (FAIL, advice)
    return Row("kernels", label, measured, limit, result, advice, details)


def _problem(length: int, head_dim: int, dtype: str, packed: bool = False):
    """(q, k, v in `dtype`, a float32 cotangent w), each [1, S, N, H]; positions [1, S] from 0;
    packed: segment ids [1, S] of two sequences (a third, then the rest), else None."""
    keys = jax.random.split(jax.random.PRNGKey(length), 4)
    shape = (1, length, CHECK_HEADS, head_dim)
    arrays = [jax.random.normal(key, shape).astype(dtype) for key in keys[:3]]
    arrays.append(jax.random.normal(keys[3], shape))
    positions = jnp.arange(length, dtype=jnp.int32)
    if not packed:
        return arrays, positions[None], None
    segments = (positions >= length // 3).astype(jnp.int32)
    return arrays, (positions - segments * (length // 3))[None], segments[None]


def _case_errors(cfg, enc, params, case, precision, offset):
    """(value error, (gradient error, worst tensor)) of one kernel at one offset.

    The stabilized encodings' shear reads the absolute position through the bounded time, flat
    far from 0: there their parameters' true gradient is about zero and float32 returns the
    rounding of cancelling terms, so those are compared at offset 0 only."""
    length, queries = case["length"], case["queries"]
    (q, k, v, w), positions, segments = _problem(
        length, cfg.model.head_dim, cfg.model.compute_dtype, case["packed"]
    )
    q, w, positions = q[:, length - queries :], w[:, length - queries :], positions + offset
    want, want_grads = oracle.attention_and_gradients(enc, params, q, k, v, w, positions, segments)
    block_size = selection.blockwise_block_size(cfg.model.block_size, enc.largest_damping(params))

    def loss(q, k, v, params):
        out = attention.causal_attention(
            q, k, v, enc=enc, params=params, positions=positions, kernel=case["kernel"],
            block_size=block_size, precision=precision, segment_ids=segments,
        )  # fmt: skip
        return jnp.sum(out.astype(w.dtype) * w), out

    gradient = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, out), grads = jax.jit(gradient)(q, k, v, params)
    if offset and not enc.cfg.is_translation_invariant:
        want_grads = {name: want_grads[name] for name in ("dq", "dk", "dv")}
    got_grads = oracle.named_gradients(grads)
    errors = {name: relative_error(got_grads[name], grad) for name, grad in want_grads.items()}
    worst = max(errors, key=errors.get)
    return relative_error(oracle.as_float64(out), want, -1), (errors[worst], worst)


def precision_rows(cfg, backend: str) -> list[Row]:
    """The raw shear's logits (and the config's encoding's, where it keeps float32) at the
    longest length, for the last PRECISION_ROWS queries: at the run's precision, HIGHEST and the
    backend's default, against float64."""
    rows = []
    head_dim, max_length = cfg.model.head_dim, max(cfg.pe.train_context, *cfg.eval.lengths)
    keeps_float32 = encodings.make_encoding(cfg.pe, CHECK_HEADS, head_dim).keeps_float32
    names = [cfg.pe.name] if keeps_float32 and cfg.pe.name != RAW_SHEAR else []
    for name in [*names, RAW_SHEAR]:
        settings = dict(train_context=cfg.pe.train_context, theta=cfg.pe.theta)
        pe = cfg.pe if name == cfg.pe.name else pe_config.pe_config_from_name(name, **settings)
        make = encodings.make_encoding
        enc, error = attempt(ValueError, make, pe, CHECK_HEADS, head_dim, max_length=max_length)
        if error:
            rows.append(Row("precision", name, f"n/a: {_first_line(error)}", result=NOT_APPLICABLE))
            continue
        rows.append(_precision_row(cfg, enc, max_length, backend))
    return rows


def _precision_row(cfg, enc, length: int, backend: str) -> Row:
    params, queries = check_parameters(enc), min(PRECISION_ROWS, length)
    (q, k, _, _), positions, _ = _problem(length, cfg.model.head_dim, cfg.model.compute_dtype)
    q, q_positions, positions = q[:, length - queries :], positions[0, -queries:], positions[0]
    with oracle.float64():
        logits = jax.jit(oracle.logits, static_argnums=0)
        want = np.asarray(logits(enc, *oracle.as_float64((params, q, k)), q_positions, positions))
    visible = (q_positions[:, None] >= positions[None, :])[None, None]
    scale = np.maximum(np.where(visible, np.abs(want), 0.0).max((-2, -1)), 1e-300)

    def error_at(precision) -> float:
        logits = jax.jit(functools.partial(encodings.attention_logits, enc, precision=precision))
        got = np.asarray(logits(params, q, k, q_positions, positions), np.float64)
        return float(np.max(np.where(visible, np.abs(got - want), 0.0).max((-2, -1)) / scale))

    run = attention.attention_precision(cfg.model.attention, enc) or jax.lax.Precision.DEFAULT
    errors = {"run": error_at(run), "highest": error_at(jax.lax.Precision.HIGHEST)}
    errors["default"] = error_at(jax.lax.Precision.DEFAULT)
    advice = ""
    if errors["run"] > PRECISION_TOLERANCE:
        advice = "Set model.attention_precision=auto."
    if errors["highest"] > PRECISION_TOLERANCE:
        advice = f"This {backend.upper()} ignores HIGHEST: train {enc.name} elsewhere or use "
        advice += "pe.name=jordan_exact_scaled."
    label = f"{enc.name} logits at {length} (the last {queries}; the run's: {run.name.lower()})"
    measured = ", ".join(f"{key} {_error(value)}" for key, value in errors.items())
    limit = f"{_error(PRECISION_TOLERANCE)} (run's, highest)"
    details = {"encoding": enc.name, "length": length, **errors}
    return Row("precision", label, measured, limit, FAIL if advice else PASS, advice, details)


class RandomTokens:
    """Random tokens in a language-model source's batches (jrope.data.source's contract): the
    check's stand-in for sources that read (and would download) files."""

    task, num_classes = "language_model", None

    def __init__(self, vocab_size: int, seq_len: int, global_batch_size: int):
        self.vocab_size = vocab_size
        self.shape = (global_batch_size // jax.process_count(), seq_len + 1)

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        tokens = np.random.default_rng(step).integers(0, self.vocab_size, self.shape, np.int32)
        weights = np.ones((self.shape[0], self.shape[1] - 1), np.float32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": weights}


def step_rows(cfg, timed_steps: int, say: Callable[[str], None]) -> list[Row]:
    """One train step through the harness's own set-up: compile time, median step time,
    tokens/s, MFU, a finite loss, and the compiler's peak memory against the device's (the
    count the harness refuses a run by before step 1)."""
    from jrope.data.source import SOURCES
    from jrope.train.setup import set_up_run
    from jrope.train.trainer import make_train_step

    source = None  # set_up_run builds the config's own
    if SOURCES[cfg.data.source].load()[1].task == "language_model":
        source = RandomTokens(cfg.data.vocab_size, cfg.pe.train_context, cfg.batch_size)
    run = set_up_run(cfg, source=source)
    say("  the train step")
    with jax.set_mesh(run.mesh):
        started, batch = time.perf_counter(), run.source.train_batch(0)
        compiled = make_train_step(run).lower(run.layout.abstract, batch).compile()
        compile_seconds, state = time.perf_counter() - started, [run.init_state()]

        def step():
            state[0], metrics = compiled(state[0], batch)
            return metrics["loss"]

        seconds = flops.median_seconds(step, timed_steps)
        loss = float(step())
    rates = run.throughput.rates(1 / seconds)
    rate = f"{seconds:.3g} s, {rates['tokens_per_sec']:,.0f} tokens/s, MFU "
    rate += f"{100 * rates['mfu']:.1f} %" if "mfu" in rates else "unknown"
    memory, kind = flops.device_memory()
    shortfall = flops.memory_shortfall(compiled)
    reads = ", random tokens" if isinstance(source, RandomTokens) else ""
    shape = f"compile ({cfg.batch_size} x {cfg.pe.train_context}{reads})"
    rows = [Row("train step", shape, f"{compile_seconds:.1f} s")]
    finite = (PASS, "") if math.isfinite(loss) else (FAIL, "Not finite.")
    details = {"seconds": seconds, "loss": loss}
    rows.append(Row("train step", "step time (median)", rate, "finite loss", *finite, details))
    used = f"{flops.peak_memory(compiled) / 2**30:.3g} GiB"
    limit = f"{memory / 2**30:.3g} GiB {kind}" if memory else "unknown"
    advice = f"It {shortfall}: lower the batch or set model.remat=full."
    result, advice = (FAIL, advice) if shortfall else (PASS, "")
    return [*rows, Row("train step", "peak memory (compiler)", used, limit, result, advice)]


DEFAULT_CONFIG = "wikitext_scaled_exact"
PLATFORMS = {"cpu": "cpu", "gpu": "cuda,cpu", "tpu": "tpu,cpu"}  # the CPU beside runs float64


def run_check(cfg, *, command: str, requested_backend="", timed_steps=3, say=print) -> Report:
    """Every section for the run config `cfg` (jrope.train.config.TrainConfig) here."""
    backend = jax.default_backend()
    steps, kernels = step_rows(cfg, timed_steps, say), kernel_rows(cfg, backend, say)
    rows = (*environment_rows(requested_backend), *kernels, *precision_rows(cfg, backend), *steps)
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return Report(command, date, rows, jax.print_environment_info(return_string=True))


def main(argv: Sequence[str], name: str) -> None:
    """The check of config `name` (as the command line gives it) under the parsed flags."""
    from absl import flags

    from jrope.train import setup
    from jrope.train.config import convert_config
    from jrope.train.setup import run_encoding

    del argv  # command_line.run refuses arguments
    values = flags.FLAGS
    if values.backend:
        jax.config.update("jax_platforms", PLATFORMS[values.backend])
    if problem := backend_problem(values.backend or jax.default_backend()):
        raise UsageError(problem)
    if "probe" in values.config:
        cfg, problems = None, [f"--config={name} is a probe: give a run config."]
    else:
        cfg, problems = convert_config(values.config)
    if cfg:  # refused here as train.py refuses it
        problems = setup.kernel_problems(cfg, run_encoding(cfg), jax.default_backend())
    if values.output_dir:
        _, error = attempt(OSError, os.makedirs, values.output_dir, exist_ok=True)
        problems += [f"--output_dir={values.output_dir}: {error.strerror}."] if error else []
    if problems:
        raise ConfigError(problems)
    shown = [f"--config={name}", *(a for a in sys.argv[1:] if not a.startswith("--config="))]
    print(f"Checking {name} on {jax.default_backend()}:", flush=True)
    command = " ".join(["python -m jrope.check", *shown])
    options = dict(requested_backend=values.backend, timed_steps=values.timed_steps)
    report = run_check(cfg, command=command, **options, say=lambda line: print(line, flush=True))
    print(report.environment, file=sys.stderr)
    print(f"\n{report.markdown()}", flush=True)
    if values.output_dir:
        stem = f"{os.path.basename(name).removesuffix('.py')}_{jax.default_backend()}"
        stem = pathlib.Path(values.output_dir, stem)
        stem.with_suffix(".md").write_text(report.markdown(), encoding="utf-8")
        stem.with_suffix(".json").write_text(json.dumps(report.to_json(), indent=1) + "\n")
        print(f"Written: {stem}.md, {stem}.json")
    sys.exit(report.exit_status)


def run_main() -> None:
    """The command line (flags defined here: importing this module defines none)."""
    from absl import flags

    if (name := command_line.flag_argument(sys.argv, "config")) is None:
        sys.argv.insert(1, f"--config={(name := DEFAULT_CONFIG)}")

    def define_flags(argv: Sequence[str]) -> None:
        from ml_collections import config_flags

        config_flags.DEFINE_config_file("config", None, "Run config.", lock_config=True)
        flags.DEFINE_string("output_dir", "", "Report folder.")
        flags.DEFINE_enum("backend", "", ["", *PLATFORMS], "Backend (default: JAX's).")
        flags.DEFINE_integer("timed_steps", 3, "Timed steps.", lower_bound=1)

    command_line.run(functools.partial(main, name=name), define_flags)


if __name__ == "__main__":
    run_main()
