"""What a run writes and shows: console lines, metrics.jsonl and TensorBoard, tokens/s, FLOPs and
MFU, the start record (starts.jsonl), result files (CSV, markdown, PNG), next commands, bucket checks.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from etils import epath
from tensorboardX import SummaryWriter, record_writer
from tensorboardX.summary import hparams as hparams_summary

from jrope.data.files import BucketObject, is_uri, write_atomically
from jrope.data.source import source_spec
from jrope.errors import NonFiniteLossError, SkippedTooManySteps
from jrope.train.config import TrainConfig


def say(message: str, end: str = "\n") -> None:
    """The program's output (not a log record): stdout, process 0 only, flushed at once."""
    if jax.process_index() == 0:
        print(message, end=end, flush=True)


def duration(seconds: float) -> str:
    """'4.2 s', '3 min 05 s' or '2 h 07 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {seconds:02d} s"


# Metrics whose finiteness decides a step (names of the train step's metrics).
CHECKED_METRICS = ("loss", "grad_norm")
SKIPPED_METRIC = "skipped"
METRICS_FILE = "metrics.jsonl"


def first_nonfinite(values: Mapping[str, float]) -> tuple[str, float] | None:
    """(name, value) of the first checked metric that is NaN or infinite, else None."""
    for name in CHECKED_METRICS:
        if name in values and not math.isfinite(values[name]):
            return name, values[name]
    return None


class MetricsLogger:
    """Checks every step's metrics (a non-finite one stops the run naming `last_checkpoint()`,
    unless the step skipped its update and fewer than `max_consecutive_skips` came in a row); logs
    every `every_steps`-th step and the last to the console, metrics.jsonl and TensorBoard. `push`
    reads the previous step's metrics, so the device queue never drains. A start resumed at
    `start_step` first drops the records it will write again, so every step is logged once."""

    def __init__(
        self,
        workdir: str,
        *,
        every_steps: int,
        num_steps: int,
        tensorboard: bool,
        last_checkpoint: Callable[[], str],
        is_writer: bool = True,
        start_step: int = 0,
        throughput: Throughput | None = None,
        max_consecutive_skips: int = 10,
        skip_progress: Mapping[str, int] | None = None,
    ):
        self._every_steps = every_steps
        self._num_steps = num_steps
        self._last_checkpoint = last_checkpoint
        self._throughput = throughput
        self._max_consecutive_skips = max_consecutive_skips
        self._pending: tuple[int, Mapping[str, jax.Array]] | None = None
        self._interval_start: tuple[int, float] | None = None
        progress = skip_progress or {}  # the resumed checkpoint's: a streak goes on counting
        self._skipped_steps = progress.get("skipped_steps", 0)
        in_a_row = progress.get("skipped_in_a_row", 0)
        # The steps of the updates skipped in a row up to the last step read.
        self._streak = list(range(start_step - in_a_row + 1, start_step + 1))
        self._jsonl = self._tensorboard = None
        if is_writer:
            self._jsonl = JsonLinesLog(
                epath.Path(workdir) / METRICS_FILE,
                keep=lambda line: _keeps_record(line, start_step, num_steps),
            )
            if tensorboard:
                self._tensorboard = SummaryWriter(str(epath.Path(workdir) / "tensorboard"))

    def push(self, step: int, metrics: Mapping[str, jax.Array]) -> None:
        """Record the (still computing) metrics of `step`; read and log the previous step's."""
        previous, self._pending = self._pending, (step, metrics)
        if self._interval_start is None:
            self._interval_start = (step - 1, time.perf_counter())
        if previous is not None:
            self._read(*previous)

    def flush(self) -> None:
        """Read the pending step now (before a checkpoint, an evaluation or the end)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._read(*pending)
        if self._jsonl is not None:
            self._jsonl.flush()  # on a bucket: the log catches up with the checkpoint

    @property
    def skip_streak_start(self) -> int | None:
        """The first step of the updates being skipped in a row now, None when none is."""
        return self._streak[0] if self._streak else None

    @property
    def skip_progress(self) -> dict[str, int]:
        """Updates skipped so far and in a row up to the last step read (checkpoints record it)."""
        return {"skipped_steps": self._skipped_steps, "skipped_in_a_row": len(self._streak)}

    def write_scalars(self, step: int, scalars: Mapping[str, float], prefix: str) -> None:
        """Log named scalars (e.g. evaluation results) at `step`."""
        self._write(step, {f"{prefix}/{name}": float(value) for name, value in scalars.items()})

    def write_hparams(self, hparams: Mapping[str, Any], metric_names: list[str]) -> None:
        """The run's settings for TensorBoard's hparams view (values other than numbers as text)."""
        if self._tensorboard is None:
            return
        values = {
            key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in hparams.items()
        }
        for summary in hparams_summary(values, dict.fromkeys(metric_names, 0.0)):
            self._tensorboard.file_writer.add_summary(summary)
        self._tensorboard.flush()

    def close(self) -> None:
        self.flush()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()

    def _read(self, step: int, metrics: Mapping[str, jax.Array]) -> None:
        values = {name: float(value) for name, value in jax.device_get(dict(metrics)).items()}
        bad = first_nonfinite(values)
        fix = "Lower opt.learning_rate or use float32 compute, then resume from that checkpoint"
        skipped = values.pop(SKIPPED_METRIC, None)  # None: opt.nonfinite = 'stop'
        if skipped is None and bad is not None:
            raise NonFiniteLossError(
                f"{bad[0]} is {bad[1]} at step {step}; last good checkpoint: "
                f"{self._last_checkpoint()}. {fix} (or set opt.nonfinite='skip' to drop such steps)."
            )
        if skipped == 0:
            self._streak = []
        elif skipped is not None:
            self._skipped_steps += 1
            self._streak.append(step)
            logging.warning(
                "Step %d: %s is %s; update skipped (%d so far).", step, *bad, self._skipped_steps
            )
            if len(self._streak) >= self._max_consecutive_skips:
                raise SkippedTooManySteps(
                    f"Steps {self._streak[0]} to {step} were all skipped ({bad[0]} "
                    f"non-finite): {len(self._streak)} in a row, "
                    "opt.max_consecutive_skips, so the run stops instead of skipping on; it is "
                    f"diverging. Last good checkpoint: {self._last_checkpoint()}. {fix}."
                )
        if skipped is not None:
            values["skipped_steps"] = self._skipped_steps
        if step % self._every_steps and step != self._num_steps:
            return
        start_step, start_time = self._interval_start
        now = time.perf_counter()
        values["steps_per_sec"] = (step - start_step) / max(now - start_time, 1e-9)
        if self._throughput is not None:
            values.update(self._throughput.rates(values["steps_per_sec"]))
        self._interval_start = (step, now)
        say(_progress_line(step, self._num_steps, values))
        self._write(step, {f"train/{name}": value for name, value in values.items()})

    def _write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._jsonl is not None:
            record = {"step": step, "time": time.time(), **scalars}
            # JSON has no NaN or infinities: "nan", "inf", "-inf" instead, which float() reads back.
            record = {key: x if math.isfinite(x) else str(x) for key, x in record.items()}
            self._jsonl.write(json.dumps(record, allow_nan=False))
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()


def _keeps_record(line: str, start_step: int, num_steps: int) -> bool:
    """Whether a line of an earlier start stays: whole (not cut short by a kill), and not one this
    start writes again (a later step, or the final evaluation of a run resumed at its last step)."""
    if not line.endswith("\n"):
        return False
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    redone = record["step"] == start_step == num_steps and "train/loss" not in record
    return record["step"] <= start_step and not redone


def _progress_line(step: int, num_steps: int, values: Mapping[str, float]) -> str:
    """E.g. 'step 100/250  loss 0.41  accuracy 0.81  12.1 steps/s  31k tokens/s  12.4 s left'."""
    parts = [f"step {step}/{num_steps}"]
    parts += [f"{name} {values[name]:.4g}" for name in ("loss", "accuracy") if name in values]
    if values.get("skipped_steps"):
        parts.append(f"skipped {values['skipped_steps']:.0f}")
    parts.append(f"{values['steps_per_sec']:.3g} steps/s")
    if "tokens_per_sec" in values:
        parts.append(f"{_si(values['tokens_per_sec'])} tokens/s")
    if "mfu" in values:
        parts.append(f"MFU {100 * values['mfu']:.1f} %")
    if step < num_steps:
        parts.append(f"{duration((num_steps - step) / values['steps_per_sec'])} left")
    return "  ".join(parts)


def _si(value: float) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


# tensorboardX opens its gs:// event files through epath, as BucketObjects (no folders to make).
record_writer.register_writer_factory(
    "gs", types.SimpleNamespace(open=BucketObject, directory_check=lambda path: None)
)


class JsonLinesLog:
    """A log of one line per record at `path` (its folder made), continued when it exists;
    `keep` chooses which of the lines already there stay (None: all)."""

    def __init__(self, path: epath.PathLike, keep: Callable[[str], bool] | None = None):
        self._path = epath.Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        history = self._path.read_text() if self._path.exists() else ""
        kept = "".join(line for line in history.splitlines(True) if keep is None or keep(line))
        if is_uri(self._path):  # uploaded an interval after the first line, not line by line
            self._file = BucketObject(self._path, kept.encode(), uploaded_at=time.monotonic())
            return
        if kept != history:
            write_atomically(str(self._path), [kept.encode()])
        self._file = self._path.open("ab")

    def write(self, line: str) -> None:
        """Appends `line` (no newline) to the log."""
        try:
            self._file.write(f"{line}\n".encode())
            self._file.flush()
        except OSError as error:  # a file object's errors do not name the file
            raise OSError(error.errno, error.strerror or str(error), str(self._path)) from error

    def flush(self) -> None:
        """Everything written so far is in the file (a local file is flushed at every line)."""
        if isinstance(self._file, BucketObject):
            self._file.upload()

    def close(self) -> None:
        self.flush()
        self._file.close()


# device_kind -> (bfloat16 peak, float32 peak at XLA's default precision), published dense matmul
# FLOP/s per device: float32 runs as bfloat16 passes on TPUs, as TF32 on NVIDIA since Ampere.
_T = 1e12
PEAK_FLOPS = {
    "TPU v2": (22.5 * _T, 22.5 * _T),  # 45 TFLOP/s per chip, 2 devices per chip
    "TPU v3": (61.5 * _T, 61.5 * _T),  # 123 per chip, 2 devices per chip
    "TPU v4": (275 * _T, 275 * _T),
    "TPU v5 lite": (197 * _T, 197 * _T),  # v5e
    **dict.fromkeys(["TPU v5", "TPU v5p"], (459 * _T, 459 * _T)),
    "TPU v6 lite": (918 * _T, 918 * _T),  # v6e (Trillium)
    # V100s: no bfloat16, no TF32.
    **dict.fromkeys(["Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"], (None, 15.7 * _T)),
    **dict.fromkeys(["Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"], (None, 14 * _T)),
    **dict.fromkeys(
        ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB"],
        (312 * _T, 156 * _T),
    ),
    "NVIDIA A100 80GB PCIe": (312 * _T, 156 * _T),
    "NVIDIA L4": (121 * _T, 60 * _T),
    # The H100 SXM, and the H200 with its compute.
    **dict.fromkeys(["NVIDIA H100 80GB HBM3", "NVIDIA H200"], (989.4 * _T, 494.7 * _T)),
    "NVIDIA H100 PCIe": (756.5 * _T, 378 * _T),
    "NVIDIA B200": (2250 * _T, 1100 * _T),  # HGX B200, dense: half the sparse figures published
}


def peak_flops_per_sec(devices: Sequence[jax.Device], compute_dtype: str) -> float | None:
    """The summed peak of `devices` for `compute_dtype` matmuls; None when any is unknown."""
    column = 0 if compute_dtype == "bfloat16" else 1
    peaks = [PEAK_FLOPS.get(device.device_kind, (None, None))[column] for device in devices]
    return None if None in peaks else sum(peaks)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a step rate into tokens/s and MFU (model FLOPs x steps/s / the peak)."""

    tokens_per_step: int  # global batch x training length
    model_flops_per_step: float  # model_flops_per_step(cfg)["total"]
    peak_flops_per_sec: float | None  # all devices together; None when unknown (no MFU)

    @classmethod
    def for_run(
        cls, cfg: TrainConfig, io: dict[str, int | None], devices: Sequence[jax.Device]
    ) -> Throughput:
        """io: the model's input and output sizes (jrope.train.setup.model_io)."""
        return cls(
            tokens_per_step=cfg.batch_size * cfg.pe.train_context,
            model_flops_per_step=model_flops_per_step(cfg, **io)["total"],
            peak_flops_per_sec=peak_flops_per_sec(devices, cfg.model.compute_dtype),
        )

    def rates(self, steps_per_sec: float) -> dict[str, float]:
        """{'tokens_per_sec': ..., and 'mfu' (a fraction) when the peak is known}."""
        rates = {"tokens_per_sec": steps_per_sec * self.tokens_per_step}
        if self.peak_flops_per_sec:
            rates["mfu"] = steps_per_sec * self.model_flops_per_step / self.peak_flops_per_sec
        return rates


def model_flops_per_step(
    cfg: TrainConfig,
    vocab_size: int | None = None,
    *,
    input_channels: int | None = None,
    output_channels: int | None = None,
    length: int | None = None,
    rows: int | None = None,
) -> dict[str, float]:
    """Model FLOPs of one train step of `cfg`'s Transformer: {'dense', 'attention', 'total'}.

    Matmuls only (standard MFU accounting), a multiply-add as 2 FLOPs, backward = 2 x forward.
    With B = rows or batch_size, T = length or pe.train_context, D = d_model, F = mlp_ratio D, a
    block whose Q queries are the last Q of T key positions does, forward:

      dense      2 B D^2 (Q + 2 T) + 2 B Q D^2 + 4 B Q D F  (q, k, v, out projections, MLP)
      attention  4 B D P  (scores, weighted values on P = Q T - Q (Q - 1) / 2 visible pairs)

    Q = T except in the last block under readout 'last' (Q = 1). The tied readout adds 2 B Q D V
    (the embedding is a gather); a signal model (input_channels, output_channels) has instead an
    input projection, 2 B T C_in D, and a regression head, 2 B Q D C_out. vocab_size V defaults
    to the data config's, else its source's.
    """
    signal = input_channels is not None
    if vocab_size is None and not signal:
        vocab_size = getattr(cfg.data, "vocab_size", None)
        if vocab_size is None:
            vocab_size = source_spec(cfg.data.source).load()[1].vocab_size
    m = cfg.model
    b, t, d, v = rows or cfg.batch_size, length or cfg.pe.train_context, m.d_model, vocab_size
    f = m.mlp_ratio * d
    last_queries = 1 if m.readout == "last" else t
    dense = attention = 0
    for index in range(m.num_layers):
        q = last_queries if index == m.num_layers - 1 else t
        pairs = q * t - q * (q - 1) // 2
        dense += 2 * b * d * d * (q + 2 * t) + 2 * b * q * d * d + 4 * b * q * d * f
        attention += 4 * b * d * pairs
    if signal:
        dense += 2 * b * t * input_channels * d + 2 * b * last_queries * d * output_channels
    else:
        dense += 2 * b * last_queries * d * v  # tied readout on the last block's rows
    return {"dense": 3.0 * dense, "attention": 3.0 * attention, "total": 3.0 * (dense + attention)}


RECORD_FILE = "starts.jsonl"
_VERSIONED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def start_record(cfg: TrainConfig, start_step: int) -> dict[str, Any]:
    """This start's line of starts.jsonl (never rewritten: it also shows settings changed on a
    resume): time, host, command line, step, jrope's version (from a git checkout also its commit
    and whether tracked files had no uncommitted change), library versions, devices, config."""
    code: dict[str, Any] = {"version": _version("jrope")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        commit, changes = [
            subprocess.run(
                ["git", "-C", root, *ask], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
            for ask in (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
        ]
        code |= {"commit": commit, "clean": not changes}
    except (OSError, subprocess.SubprocessError):
        pass  # not a checkout, or no git
    devices = jax.devices()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "pid": os.getpid(),
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "start_step": start_step,
        "jrope": code,
        "versions": {
            "python": platform.python_version(),
            **{name: _version(name) for name in _VERSIONED},
        },
        "devices": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "count": len(devices),
            "process_count": jax.process_count(),
        },
        "config": cfg.to_json_dict(),
    }


def append_start_record(workdir: str, record: dict[str, Any]) -> None:
    """Append `record` as one line of `<workdir>/starts.jsonl` (local, or a bucket)."""
    log = JsonLinesLog(epath.Path(workdir) / RECORD_FILE)
    log.write(json.dumps(record))
    log.close()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def write_csv(path: epath.PathLike, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]):
    """Rows (dicts holding `columns`) as a CSV file with a header line."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, buffer.getvalue())


def read_csv(path: epath.PathLike) -> list[dict[str, str]]:
    """The rows of a CSV file written by write_csv, as dicts of strings."""
    return list(csv.DictReader(io.StringIO(epath.Path(path).read_text())))


def write_text(path: epath.PathLike, text: str | bytes) -> None:
    """`text` (str, or bytes) as the whole file at `path` (parent folders created)."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def format_cell(value: Any) -> str:
    """Floats with 4 decimals, anything else as str."""
    return f"{value:.4f}" if isinstance(value, (float, np.floating)) else str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    importlib.import_module("matplotlib").use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_figure(fig, path: epath.PathLike, *, dpi: int = 120) -> None:
    """A matplotlib figure as a PNG file at `path`; the figure is closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    pyplot().close(fig)
    write_text(path, buffer.getvalue())


# A curve against evaluation length: (lengths, values, spreads as error bars or None).
Curve = tuple[Sequence[int], Sequence[float], Sequence[float] | None]


def plot_against_length(
    path: epath.PathLike, curves: Mapping[str, Curve], *, ylabel: str, size=(6, 4)
) -> None:
    """One curve per label against evaluation length, on a log2 axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=size)
    all_lengths = sorted({length for lengths, _, _ in curves.values() for length in lengths})
    for label, (lengths, values, spreads) in curves.items():
        ax.errorbar(lengths, values, yerr=spreads, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_lengths, [str(length) for length in all_lengths])
    ax.set(xlabel="evaluation length", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def tensorboard_command(workdir: str) -> str:
    """The command that shows the run's curves, and what to install where TensorBoard is missing."""
    command = f"tensorboard --logdir={shlex.quote(workdir)}"
    if importlib.util.find_spec("tensorboard") is None:
        command += "  (TensorBoard is not installed here: pip install tensorboard)"
    return command


def next_commands(argv: Sequence[str], workdir: str, method: str, lengths: Sequence[int]) -> str:
    """Commands to paste after a training run (argv, of pe.name `method`, evaluated at `lengths`):
    an evaluation at one more, longer length (the config comes from the checkpoint), and a
    comparison over seeds with the config file and every override but pe.name and seed. Both keep
    the run's other flags, each once (the last one given)."""
    latest: dict[str, str] = {}  # name -> its last argument, in the order of last occurrence
    waiting = False  # the last argument was a flag without `=value`
    for arg in argv[1:]:
        # `--name value` (absl accepts it): the value joins its flag. Flags take no positionals.
        if waiting and not arg.startswith("-"):
            arg = f"{latest.popitem()[1]}={arg}"
        waiting = arg.startswith("-") and "=" not in arg
        name = arg.lstrip("-").split("=", 1)[0]
        if name.startswith("noconfig."):  # absl's negated boolean: the override of config.x
            name = name.removeprefix("no")
        latest.pop(name, None)
        latest[name] = arg
    flags, overrides = [], []  # overrides: those the comparison keeps
    for name, arg in latest.items():
        if name.split(".")[0] not in ("config", "workdir", "methods", "seeds"):  # set below
            flags.append(arg)
        elif name.startswith("config.") and name not in ("config.pe.name", "config.seed"):
            overrides.append(arg)
    longer = ",".join(str(length) for length in [*lengths, 2 * max(lengths)])
    evaluate = ["python", "eval.py", f"--workdir={workdir}", *flags]
    evaluate.append(f"--config.eval.lengths=({longer})")
    compare = ["python", "-m", "jrope.compare", *([latest["config"]] if "config" in latest else [])]
    other = method if method != "rope" else "jordan_rope"
    compare += [*overrides, *flags, f"--methods=rope,{other}", "--seeds=0,1"]
    compare.append(f"--workdir={workdir.rstrip('/') or workdir}_compare")
    return (
        f"Next, evaluate at more lengths:\n  {shlex.join(evaluate)}\n"
        f"or compare encodings over seeds:\n  {shlex.join(compare)}"
    )
