"""The tasks' losses and metrics as weighted sums, which add up exactly over batches and
processes: cross-entropy and accuracy for token tasks, squared error and R^2 for regression. The
train step takes its loss from them, the evaluation its rows.

Shape legend: B batch, T length, V vocabulary, C channels.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def weighted_sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, num_classes: int | None
) -> dict[str, jax.Array]:
    """Float32 scalars 'loss_sum' (weighted cross-entropy), 'correct_sum' and 'weight_sum' of
    logits float32 [B, T', V] for the last T' <= T of targets int32 [B, T] with weights float32
    [B, T]; with num_classes, only logits[..., :num_classes] compete."""
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


# A sequence whose targets are constant has no variance to explain: its R^2 divides by this.
VARIANCE_FLOOR = 1e-12


def squared_error_sums(
    predictions: jax.Array, targets: jax.Array, weights: jax.Array
) -> dict[str, jax.Array]:
    """Float32 weighted sums of predictions [B, T', C] for the last T' <= T of targets [B, T, C]
    with weights [B, T]: 'loss_sum' (w (p - y)^2), 'weight_sum' (w times C: the loss is per
    element), 'target_sum', 'target_square_sum' (w y, w y^2), 'sequence_r2_sum' (each sequence's
    1 - weighted MSE / weighted variance about its mean, floored at VARIANCE_FLOOR) and
    'sequence_count' (sequences of nonzero weight)."""
    first = targets.shape[1] - predictions.shape[1]
    targets, weights = targets[:, first:].astype(jnp.float32), weights[:, first:, None]
    channels = targets.shape[-1]
    squared_errors = jnp.square(predictions - targets) * weights
    # Per sequence [B]: weight, mean squared error and variance over positions and channels.
    sequence_weight = jnp.sum(weights, axis=(1, 2)) * channels
    counted = sequence_weight > 0
    safe_weight = jnp.where(counted, sequence_weight, 1.0)
    sequence_mse = jnp.sum(squared_errors, axis=(1, 2)) / safe_weight
    sequence_mean = jnp.sum(targets * weights, axis=(1, 2)) / safe_weight
    centred = jnp.square(targets - sequence_mean[:, None, None]) * weights
    sequence_variance = jnp.sum(centred, axis=(1, 2)) / safe_weight
    sequence_r2 = 1.0 - sequence_mse / jnp.maximum(sequence_variance, VARIANCE_FLOOR)
    return {
        "loss_sum": jnp.sum(squared_errors),
        "weight_sum": jnp.sum(weights) * channels,
        "target_sum": jnp.sum(targets * weights),
        "target_square_sum": jnp.sum(jnp.square(targets) * weights),
        "sequence_r2_sum": jnp.sum(jnp.where(counted, sequence_r2, 0.0)),
        "sequence_count": jnp.sum(counted.astype(jnp.float32)),
    }


def task_sums(
    outputs: jax.Array, batch: dict[str, jax.Array], task: str, num_classes: int | None
) -> dict[str, jax.Array]:
    """The sums of `task` (a data source's, jrope.data.source.TASKS) for a batch's model outputs."""
    if task == "regression":
        return squared_error_sums(outputs, batch["targets"], batch["weights"])
    return weighted_sums(outputs, batch["targets"], batch["weights"], num_classes)


def metrics_from_sums(sums: dict[str, Any], task: str) -> dict[str, Any]:
    """From task_sums: 'loss' and 'accuracy' (token tasks), or 'loss' (MSE), 'r2' (the mean of
    the sequences' own R^2, as the paper's reference reports) and 'r2_pooled' (one R^2 over
    every sequence, which rewards the spread between sequences) for regression."""
    loss = sums["loss_sum"] / sums["weight_sum"]
    if task != "regression":
        return {"loss": loss, "accuracy": sums["correct_sum"] / sums["weight_sum"]}
    mean = sums["target_sum"] / sums["weight_sum"]
    variance = sums["target_square_sum"] / sums["weight_sum"] - mean * mean
    return {
        "loss": loss,
        "r2": sums["sequence_r2_sum"] / sums["sequence_count"],
        "r2_pooled": 1.0 - loss / variance,
    }
