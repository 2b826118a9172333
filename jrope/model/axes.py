"""Logical axis names of the model's parameters and activations.

Parameters carry these names as `nnx.Param` metadata (`LOGICAL_AXES_KEY`);
a run's config maps each name to mesh axes (jrope.train.setup), so the
model never names a device layout itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from absl import logging
from jax.sharding import Mesh, PartitionSpec

BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
HEADS = "heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"

# Metadata key on nnx.Param holding its tuple of logical axis names.
LOGICAL_AXES_KEY = "logical_axes"

# A mesh axis, several, or none (replicated) for one logical name; a run's rules list them.
MeshAxes = str | tuple[str, ...] | None
Rules = Sequence[tuple[str, MeshAxes]]


def logical_to_spec(
    logical_axes: Sequence[str | None], shape: Sequence[int], rules: Rules, mesh: Mesh
) -> PartitionSpec:
    """PartitionSpec of an array with the given logical axes under `rules`; a dimension that does
    not divide its mesh axes, or whose axes an earlier dimension uses, is replicated."""
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, size in zip(logical_axes, shape, strict=True):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(
                f"logical axis {name!r} has no rule in config.mesh.rules {tuple(table)}; add one."
            )
        axes = table[name]
        axes_tuple = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        # size-1 axes split nothing
        axes_tuple = tuple(axis for axis in axes_tuple if mesh.shape[axis] > 1)
        split = math.prod(mesh.shape[axis] for axis in axes_tuple)
        if not axes_tuple or size % split or used.intersection(axes_tuple):
            if axes_tuple:
                message = "Replicating dim %s (size %d) instead of splitting it %d ways."
                logging.log_first_n(logging.INFO, message, 8, name, size, split)
            spec.append(None)
            continue
        used.update(axes_tuple)
        spec.append(axes_tuple[0] if len(axes_tuple) == 1 else axes_tuple)
    return PartitionSpec(*spec)
