"""Steps whose loss or gradient norm is NaN or infinite: stop the run, or skip the update.

`opt.nonfinite` chooses:

  'stop'  (default) the host reads every step's metrics (one step late, see
          jrope.train.outputs) and raises NonFiniteLossError naming the
          step, the metric and the last good checkpoint. The trainer reads
          the pending step before every save, so no checkpoint ever holds a
          state produced by a non-finite step.
  'skip'  the jitted step itself keeps the previous parameters and optimizer
          state when the step is not finite (a select on a device-side flag:
          no host round trip, no recompilation). The step counter still
          advances, so the data move on to the next batch, exactly as the
          uninterrupted run of the same config would. The metric 'skipped'
          (1.0 or 0.0) marks such steps; the logger counts them, and stops
          the run after opt.max_consecutive_skips of them in a row
          (jrope.train.outputs).

Either way an evaluation whose loss is NaN or infinite is a failure, not a
result: `check_evaluation` raises NonFiniteEvaluationError before anything
is written (skipped steps can leave a model that trains on but evaluates to
NaN).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jrope.errors import NonFiniteEvaluationError

# Metrics whose finiteness decides a step (names of the train step's metrics).
CHECKED_METRICS = ("loss", "grad_norm")
SKIPPED_METRIC = "skipped"


def keep_previous_if_nonfinite(
    previous: dict[str, Any], updated: dict[str, Any], metrics: dict[str, jax.Array]
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Inside jit: `updated` if the step is finite, else `previous` with the step counter advanced.

    Args:
      previous, updated: train states {'step', 'params', 'opt_state'} before and after the update.
      metrics: the step's scalar metrics, holding CHECKED_METRICS.
    Returns:
      (state, metrics with SKIPPED_METRIC = 1.0 when the update was dropped).
    """
    finite = jnp.all(jnp.stack([jnp.isfinite(metrics[name]) for name in CHECKED_METRICS]))

    def select(new: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(finite, new, old)

    state = {
        "step": updated["step"],
        "params": jax.tree.map(select, updated["params"], previous["params"]),
        "opt_state": jax.tree.map(select, updated["opt_state"], previous["opt_state"]),
    }
    return state, {**metrics, SKIPPED_METRIC: 1.0 - finite.astype(jnp.float32)}


def first_nonfinite(values: Mapping[str, float]) -> tuple[str, float] | None:
    """(name, value) of the first checked metric that is NaN or infinite, else None."""
    for name in CHECKED_METRICS:
        if name in values and not math.isfinite(values[name]):
            return name, values[name]
    return None


def check_evaluation(rows: Sequence[Mapping[str, Any]], step: int, checkpoint: str) -> None:
    """NonFiniteEvaluationError naming the lengths whose loss is NaN or infinite, if any.

    rows: evaluation rows ('length', 'loss'); checkpoint: where the evaluated model is.
    """
    bad = [f"{row['length']} ({row['loss']})" for row in rows if not math.isfinite(row["loss"])]
    if bad:
        raise NonFiniteEvaluationError(
            f"The evaluation of step {step} ({checkpoint}) gave a non-finite loss at length "
            f"{', '.join(bad)}; no results were written. The model has diverged: train again "
            "from an earlier checkpoint with a lower opt.learning_rate."
        )
