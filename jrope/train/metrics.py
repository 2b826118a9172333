"""Training metrics: a progress line, a JSONL log and TensorBoard event files.

The device must never wait for the host to log. `MetricsLogger.push` keeps
the metrics of the step just dispatched on the device and reads those of the
previous step, which has finished (or is about to) while the new one runs:
the host reads one step late and the device queue never drains.

Every step's loss and gradient norm are checked for NaN/Inf (reading a
scalar per step costs nothing once it is one step late); a non-finite value
stops the run with the step, the metric and the last good checkpoint named,
unless the step reports that it skipped its update (opt.nonfinite = 'skip',
jrope.train.nonfinite): such steps are counted and logged instead, until
opt.max_consecutive_skips of them come in a row (the run is diverging, and
skipping would only hide it).

Every log.every_steps steps the progress line (step, loss, accuracy,
steps/s, tokens/s, MFU where the device's peak is known, time left) goes to
the console (jrope.train.console), and the step's metrics to
`metrics.jsonl` and TensorBoard. `metrics.jsonl` is valid JSON lines: NaN
and infinities are written as the strings "nan", "inf" and "-inf" (which
Python's float() reads back). A resumed run first drops the records of what
it will do again (the steps after its checkpoint, and the final evaluation
when it resumes at the last step), so every step is logged once.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
from absl import logging
from etils import epath

from jrope.errors import NonFiniteLossError, SkippedTooManySteps
from jrope.train import metric_files, nonfinite
from jrope.train.console import duration, say
from jrope.train.throughput import Throughput

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Logs every `every_steps`-th step; checks every step.

    Args:
      workdir: directory for `metrics.jsonl` and `tensorboard/` (local, or a
        bucket: jrope.train.metric_files).
      every_steps: logging interval.
      num_steps: total steps of the run (for the time left).
      tensorboard: whether to write TensorBoard event files.
      last_checkpoint: callable returning a description of the last saved
        checkpoint, quoted when the loss goes non-finite.
      is_writer: only one process writes files (all processes check finiteness).
      start_step: the step this start resumes from (0: a fresh run).
      throughput: turns the step rate into tokens/s and MFU (None: steps/s only).
      max_consecutive_skips: skipped steps in a row that stop the run.
    """

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
    ):
        self._every_steps = every_steps
        self._num_steps = num_steps
        self._last_checkpoint = last_checkpoint
        self._throughput = throughput
        self._max_consecutive_skips = max_consecutive_skips
        self._pending: tuple[int, Mapping[str, jax.Array]] | None = None
        self._interval_start: tuple[int, float] | None = None
        self._skipped_steps = 0
        self._skipped_in_a_row: list[int] = []
        self._jsonl = None
        self._tensorboard = None
        if is_writer:
            self._jsonl = metric_files.JsonLinesLog(
                epath.Path(workdir) / METRICS_FILE,
                keep=lambda line: _keeps_record(line, start_step, num_steps),
            )
            if tensorboard:
                self._tensorboard = metric_files.tensorboard_writer(
                    epath.Path(workdir) / "tensorboard"
                )

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

    def write_scalars(self, step: int, scalars: Mapping[str, float], prefix: str) -> None:
        """Log named scalars (e.g. evaluation results) at `step`."""
        self._write(step, {f"{prefix}/{name}": float(value) for name, value in scalars.items()})

    def write_hparams(self, hparams: Mapping[str, Any], metric_names: list[str]) -> None:
        """The run's settings for TensorBoard's hparams view (values other than numbers as text)."""
        if self._tensorboard is None:
            return
        from tensorboardX.summary import hparams as hparams_summary

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
        bad = nonfinite.first_nonfinite(values)
        if nonfinite.SKIPPED_METRIC in values:
            self._count_skip(step, values.pop(nonfinite.SKIPPED_METRIC) > 0, bad)
            values["skipped_steps"] = self._skipped_steps
        elif bad is not None:
            raise NonFiniteLossError(
                f"{bad[0]} is {bad[1]} at step {step}; last good checkpoint: {self._last_checkpoint()}. "
                "Lower opt.learning_rate or use float32 compute, then resume from that checkpoint "
                "(or set opt.nonfinite='skip' to drop such steps)."
            )
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

    def _count_skip(self, step: int, skipped: bool, bad: tuple[str, float] | None) -> None:
        if not skipped:
            self._skipped_in_a_row = []
            return
        self._skipped_steps += 1
        self._skipped_in_a_row.append(step)
        logging.warning(
            "Step %d: %s is %s; update skipped (%d so far).", step, *bad, self._skipped_steps
        )
        if len(self._skipped_in_a_row) >= self._max_consecutive_skips:
            first, last = self._skipped_in_a_row[0], self._skipped_in_a_row[-1]
            raise SkippedTooManySteps(
                f"Steps {first} to {last} were all skipped ({bad[0]} non-finite): "
                f"{len(self._skipped_in_a_row)} in a row, opt.max_consecutive_skips, so the run "
                f"stops instead of skipping on; it is diverging. Last good checkpoint: "
                f"{self._last_checkpoint()}. Lower opt.learning_rate or use float32 compute, then "
                "resume from that checkpoint."
            )

    def _write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._jsonl is not None:
            record = {"step": step, "time": time.time(), **scalars}
            safe = {key: _json_number(value) for key, value in record.items()}
            self._jsonl.write(json.dumps(safe, allow_nan=False))
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()


def _json_number(value: Any) -> Any:
    """NaN and infinities as the strings "nan", "inf", "-inf" (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _keeps_record(line: str, start_step: int, num_steps: int) -> bool:
    """Whether a line of an earlier start stays: whole, and not one this start writes again."""
    if not line.endswith("\n"):
        return False  # a line cut short by a kill
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False
    redone_final_evaluation = (
        record["step"] == start_step == num_steps and "train/loss" not in record
    )
    return record["step"] <= start_step and not redone_final_evaluation


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
