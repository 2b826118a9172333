"""Pallas kernels under a device mesh: each device attends its own batch rows.

A Pallas kernel (Mosaic on TPU, Triton on GPU) lowers to one custom call,
which XLA cannot partition automatically. Under a mesh of more than one
device the kernels (jrope.attention.splash, jrope.attention.shear_flash) run
inside `jax.shard_map`: the batch split over as many mesh axes as divide it,
everything else (the other axes, and per-head parameters) replicated. Rows
attend independently, so the split changes no number; the replicated
parameters' gradients are summed over the devices by shard_map's transpose.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec


def split_over_batch(attend: Callable, batch: int, batched: Sequence[bool]) -> Callable:
    """`attend`, run per device on its batch rows when a mesh of more than one device is set.

    attend takes len(batched) arguments (pytrees), those marked True with the
    batch leading, the others replicated whole, and returns arrays with the
    batch leading. Without such a mesh, attend itself.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return attend
    # The batch is split over each mesh axis in turn while the product divides it.
    axes, size = [], 1
    for name in mesh.axis_names:
        if mesh.shape[name] > 1 and batch % (size * mesh.shape[name]) == 0:
            axes.append(name)
            size *= mesh.shape[name]
    rows = PartitionSpec(tuple(axes) or None)
    in_specs = tuple(rows if split else PartitionSpec() for split in batched)
    return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=rows, check_vma=False)
