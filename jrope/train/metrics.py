"""Training metrics: a progress line, a JSONL log and TensorBoard event files.

The device must never wait for the host to log. `MetricsLogger.push` keeps
the metrics of the step just dispatched on the device and reads those of the
previous step, which has finished (or is about to) while the new one runs:
the host reads one step late and the device queue never drains.

Every step's loss and gradient norm are checked for NaN/Inf (reading a
scalar per step costs nothing once it is one step late); a non-finite value
stops the run with the step, the metric and the last good checkpoint named,
unless the step reports that it skipped its update (opt.nonfinite = 'skip',
jrope.train.nonfinite): such steps are counted and logged instead.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Mapping

import jax
from absl import logging
from etils import epath

from jrope.train import metric_files, nonfinite


class NonFiniteLossError(FloatingPointError):
    """Raised when a training step produced a NaN or infinite loss or gradient norm."""


class MetricsLogger:
    """Logs every `every_steps`-th step; checks every step.

    Args:
      workdir: directory for `metrics.jsonl` and `tensorboard/` (local, or a
        bucket: jrope.train.metric_files).
      every_steps: logging interval.
      num_steps: total steps of the run (for the progress bar).
      tensorboard: whether to write TensorBoard event files.
      last_checkpoint: callable returning a description of the last saved
        checkpoint, quoted when the loss goes non-finite.
      is_writer: only one process writes files (all processes check finiteness).
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
    ):
        self._every_steps = every_steps
        self._num_steps = num_steps
        self._last_checkpoint = last_checkpoint
        self._pending: tuple[int, Mapping[str, jax.Array]] | None = None
        self._interval_start: tuple[int, float] | None = None
        self._skipped_steps = 0
        self._jsonl = None
        self._tensorboard = None
        if is_writer:
            self._jsonl = metric_files.JsonLinesLog(epath.Path(workdir) / "metrics.jsonl")
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
            skipped = values.pop(nonfinite.SKIPPED_METRIC) > 0
            self._skipped_steps += skipped
            values["skipped_steps"] = self._skipped_steps
            if skipped:
                logging.warning(
                    "Step %d: %s is %s; update skipped (%d so far).",
                    step,
                    *bad,
                    self._skipped_steps,
                )
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
        self._interval_start = (step, now)
        logging.info("%s", _progress_line(step, self._num_steps, values))
        self._write(step, {f"train/{name}": value for name, value in values.items()})

    def _write(self, step: int, scalars: Mapping[str, float]) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **scalars}))
        if self._tensorboard is not None:
            for name, value in scalars.items():
                self._tensorboard.add_scalar(name, value, step)
            self._tensorboard.flush()


def _progress_line(step: int, num_steps: int, values: Mapping[str, Any], width: int = 20) -> str:
    filled = int(width * step / max(num_steps, 1))
    bar = "#" * filled + "-" * (width - filled)
    shown = " ".join(f"{name} {value:.4g}" for name, value in values.items())
    return f"[{bar}] step {step}/{num_steps} {shown}"
