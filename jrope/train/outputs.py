"""What a run writes and shows: console lines, metrics.jsonl and TensorBoard (with tokens/s and
MFU), the start record (starts.jsonl)."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import types
from collections.abc import Mapping
from typing import Any

import jax
from etils import epath

from jrope import flops, results
from jrope.data.files import BucketObject


def say(message: str, end: str = "\n") -> None:
    """The program's output on stdout (process 0), flushed; a line and its end in one write."""
    if jax.process_index() == 0:
        print(message + end, end="", flush=True)


def duration(seconds: float) -> str:
    """'4.2 s', '3 min 05 s' or '2 h 07 min'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {seconds:02d} s"


# Metrics whose finiteness decides a step (names of the train step's metrics).
CHECKED_METRICS = ("loss", "grad_norm")
METRICS_FILE = "metrics.jsonl"


def first_nonfinite(values: Mapping[str, float]) -> tuple[str, float] | None:
    """(name, value) of the first checked metric that is NaN or infinite, else None."""
    for name in CHECKED_METRICS:
        if name in values and not math.isfinite(values[name]):
            return name, values[name]
    return None


class MetricsLogger:
    """Writes every `every_steps`-th step and the last to the console, metrics.jsonl and TensorBoard
    (process 0, as `say`). A start at `start_step` first drops the records it will write again,
    and the evaluation records at `redo_step` (of `redo_names` alone, where given); a later
    evaluation (start_step None) keeps every step's records but those."""

    def __init__(
        self,
        workdir: str,
        *,
        every_steps: int,
        num_steps: int,
        tensorboard: bool,
        start_step: int | None = 0,
        redo_step: int | None = None,
        redo_names: set[str] | None = None,
        throughput: flops.Throughput | None = None,
    ):
        self._every_steps = every_steps
        self._num_steps = num_steps
        self._throughput = throughput
        self._interval_start = (start_step or 0, time.perf_counter())
        self._jsonl = self._tensorboard = None
        if jax.process_index() == 0:
            keep = functools.partial(
                _keeps_record, start_step=start_step, redo_step=redo_step, redo_names=redo_names
            )
            self._jsonl = results.JsonLinesLog(epath.Path(workdir) / METRICS_FILE, keep=keep)
            if tensorboard:
                self._tensorboard = _summary_writer(epath.Path(workdir) / "tensorboard")

    def write_step(self, step: int, values: Mapping[str, float]) -> None:
        """The train metrics of `step` (host floats), written when `step` is due."""
        if step % self._every_steps and step != self._num_steps:
            return
        values = dict(values)
        start_step, start_time = self._interval_start
        now = time.perf_counter()
        values["steps_per_sec"] = (step - start_step) / max(now - start_time, 1e-9)
        if self._throughput is not None:
            values.update(self._throughput.rates(values["steps_per_sec"]))
        self._interval_start = (step, now)
        say(_progress_line(step, self._num_steps, values))
        self._write(step, {f"train/{name}": value for name, value in values.items()})

    def restart_interval(self) -> None:
        """The next rate is measured from now (after a compilation, an evaluation or a save)."""
        self._interval_start = (self._interval_start[0], time.perf_counter())

    def write_scalars(self, step: int, scalars: Mapping[str, float], prefix: str) -> None:
        self._write(step, {f"{prefix}/{name}": float(value) for name, value in scalars.items()})

    def write_hparams(self, hparams: Mapping[str, Any], metric_names: list[str]) -> None:
        """The run's settings for TensorBoard's hparams view (values other than numbers as text)."""
        if self._tensorboard is None:
            return
        values = {
            k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()
        }
        from tensorboardX.summary import hparams as hparams_summary

        for summary in hparams_summary(values, dict.fromkeys(metric_names, 0.0)):
            self._tensorboard.file_writer.add_summary(summary)
        self._tensorboard.flush()

    def flush(self) -> None:
        """Everything written so far is in the files (on a bucket: uploaded)."""
        if self._jsonl is not None:
            self._jsonl.flush()

    def close(self) -> None:
        for writer in (self._jsonl, self._tensorboard):
            if writer is not None:
                writer.close()

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


def _keeps_record(line: str, start_step: int | None, redo_step: int | None, redo_names) -> bool:
    """Whether an earlier record stays: not one written again (a step after `start_step`, or an
    evaluation at `redo_step`, of `redo_names` where given); one without a step stays."""
    record = json.loads(line)
    step = record.get("step")
    if not isinstance(step, int):
        return True
    redone = step == redo_step and "train/loss" not in record
    redone = redone and (redo_names is None or any(k.split("/")[0] in redo_names for k in record))
    return (start_step is None or step <= start_step) and not redone


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


def _summary_writer(folder: epath.Path):
    """An event writer; tensorboardX (0.15 s to import, with boto3) loads only where one is made."""
    from tensorboardX import SummaryWriter, record_writer

    # gs:// event files open through epath, as BucketObjects (no folders to make).
    record_writer.register_writer_factory(
        "gs", types.SimpleNamespace(open=BucketObject, directory_check=lambda path: None)
    )
    return SummaryWriter(str(folder))


RECORD_FILE = "starts.jsonl"
_VERSIONED = ("jrope", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")


def code_commit() -> tuple[str, bool] | None:
    """(commit, whether the tracked files are as committed) of the git checkout jrope runs from;
    None in an installed package, or without git."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    asks = (["rev-parse", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])
    git = ["git", "--no-optional-locks", "-C", root]  # a status the timeout kills leaves no lock
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=10, check=True)
    try:
        commit, changes = (run(git + ask).stdout.strip() for ask in asks)
    except (OSError, subprocess.SubprocessError):
        return None
    return commit, not changes


def start_record(config_json: dict[str, Any], start_step: int) -> dict[str, Any]:
    """This start's line of starts.jsonl (never rewritten: it also shows settings changed on a
    resume): where, when and how it ran, jrope's version (and git commit), and `config_json`."""
    installed = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()}
    versions = {name: installed.get(name, "not installed") for name in _VERSIONED}
    code = {"version": versions.pop("jrope")}
    if commit := code_commit():
        code |= {"commit": commit[0], "clean": commit[1]}
    devices = jax.devices()
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "pid": os.getpid(),
        "command": [sys.executable, *sys.argv],
        "cwd": os.getcwd(),
        "start_step": start_step,
        "jrope": code,
        "versions": {"python": platform.python_version()} | versions,
        "devices": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "count": len(devices),
            "process_count": jax.process_count(),
        },
        "config": config_json,
    }


def append_start_record(workdir: str, record: dict[str, Any]) -> None:
    """Append `record` as one line of `<workdir>/starts.jsonl` (local, or a bucket)."""
    log = results.JsonLinesLog(epath.Path(workdir) / RECORD_FILE)
    log.write(json.dumps(record))
    log.close()
