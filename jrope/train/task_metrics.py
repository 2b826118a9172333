"""What a step measures, per task: the sums a batch contributes and the metrics made from them.

The train step and the evaluation both use these, so a training loss and
an evaluation loss are the same quantity. Token tasks (language modelling,
classification over the first `num_classes` logits, which the synthetic
task reads its label from) sum a weighted cross-entropy and the correct
predictions; the regression task sums squared errors and what R^2 needs.
Sums, not means, so that batches and processes add up exactly.

Shape legend: B batch, T length, V vocabulary, C channels.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def weighted_sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, num_classes: int | None
) -> dict[str, jax.Array]:
    """Weighted sums of cross-entropy and correct predictions.

    Args:
      logits: float32 [B, T', V] for the last T' <= T positions (T' = 1 with
        the model's readout='last'); targets: int32 [B, T]; weights: float32 [B, T].
      num_classes: when set, only logits[..., :num_classes] compete.
    Returns:
      float32 scalars 'loss_sum', 'correct_sum', 'weight_sum'.
    """
    first = targets.shape[1] - logits.shape[1]
    targets, weights = targets[:, first:], weights[:, first:]
    if num_classes is not None:
        logits = logits[..., :num_classes]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "loss_sum": jnp.sum(nll * weights),
        "correct_sum": jnp.sum(correct * weights),
        "weight_sum": jnp.sum(weights),
    }


def squared_error_sums(
    predictions: jax.Array, targets: jax.Array, weights: jax.Array
) -> dict[str, jax.Array]:
    """Weighted sums of squared errors and of the targets (for R^2).

    Args:
      predictions: float32 [B, T', C] for the last T' <= T positions;
        targets: float32 [B, T, C]; weights: float32 [B, T].
    Returns:
      float32 scalars 'loss_sum' (w (p - y)^2 summed over positions and
      channels), 'weight_sum' (w summed, times C: the loss is per element),
      'target_sum' and 'target_square_sum' (w y and w y^2 summed).
    """
    first = targets.shape[1] - predictions.shape[1]
    targets, weights = targets[:, first:].astype(jnp.float32), weights[:, first:, None]
    channels = targets.shape[-1]
    return {
        "loss_sum": jnp.sum(jnp.square(predictions - targets) * weights),
        "weight_sum": jnp.sum(weights) * channels,
        "target_sum": jnp.sum(targets * weights),
        "target_square_sum": jnp.sum(jnp.square(targets) * weights),
    }


def task_sums(
    outputs: jax.Array, batch: dict[str, jax.Array], task: str, num_classes: int | None
) -> dict[str, jax.Array]:
    """The sums of `task` (a data source's, jrope.data.source.TASKS) for a batch's model outputs."""
    if task == "regression":
        return squared_error_sums(outputs, batch["targets"], batch["weights"])
    return weighted_sums(outputs, batch["targets"], batch["weights"], num_classes)


def metrics_from_sums(sums: dict[str, Any], task: str) -> dict[str, Any]:
    """'loss' and 'accuracy' (token tasks) or 'loss' (MSE) and 'r2' (regression), from task_sums."""
    loss = sums["loss_sum"] / sums["weight_sum"]
    if task != "regression":
        return {"loss": loss, "accuracy": sums["correct_sum"] / sums["weight_sum"]}
    mean = sums["target_sum"] / sums["weight_sum"]
    variance = sums["target_square_sum"] / sums["weight_sum"] - mean * mean
    return {"loss": loss, "r2": 1.0 - loss / variance}


def readout_problem(local_batch: dict[str, np.ndarray], readout: str) -> str | None:
    """The config's problem with this batch, if any: readout='last' needs zero weights elsewhere.

    With readout='last' the loss sees the last position only.
    (A NaN weight is left to the non-finite check: it is a broken batch, not a weighting.)
    """
    if readout == "last" and np.any(np.abs(local_batch["weights"][:, :-1]) > 0):
        return (
            "model.readout = 'last' computes logits at the last position only, but this data "
            "source weights other positions too; set --config.model.readout=all."
        )
    return None
