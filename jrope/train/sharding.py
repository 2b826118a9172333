"""Device mesh and the mapping of logical axis names onto it.

Parameters carry *logical* axis names (jrope.model.axes) as `nnx.Param`
metadata `logical_axes`; the config's rules say which mesh axis, if any, each
logical name is split over. The mesh always has the three axes
`data`, `fsdp`, `tensor` (size 1 when unused), so one set of rules serves
every device count.

A dimension whose size does not divide its mesh axes is replicated instead
(e.g. the 3-token vocabulary of the synthetic task on a 4-way axis): the
alternative, an error, would forbid tiny vocabularies and evaluation batches
of one sequence on a multi-device mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrope.model.axes import BATCH, LOGICAL_AXES_KEY, Rules, logical_to_spec
from jrope.train.config import MeshConfig

# Mesh axes.
DATA = "data"
FSDP = "fsdp"
TENSOR = "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)


def mesh_sizes(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Sizes of the (data, fsdp, tensor) axes over `num_devices`, with the -1 axis filled in.

    Raises ValueError, naming the mesh keys and the fix, when the sizes do not
    fit the devices.
    """
    sizes = dict(zip(MESH_AXES, (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor), strict=False))
    shown = " x ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())
    known = math.prod(size for size in sizes.values() if size != -1)
    if -1 in sizes.values():
        if num_devices % known:
            raise ValueError(
                f"{shown}: the fixed axes need a multiple of {known} devices, but there are "
                f"{num_devices}; make the product of the fixed mesh sizes divide {num_devices}."
            )
        free_axis = next(axis for axis, size in sizes.items() if size == -1)
        sizes[free_axis] = num_devices // known
    elif known != num_devices:
        raise ValueError(
            f"{shown} needs {known} devices, but there are {num_devices}; set one mesh size to -1 "
            f"(all remaining devices) or make their product {num_devices}."
        )
    return sizes


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all), with -1 filled in."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(mesh_cfg, len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(
        tuple(sizes[axis] for axis in MESH_AXES), MESH_AXES, axis_types=axis_types, devices=devices
    )


def state_shardings(abstract_tree: Any, rules: Rules, mesh: Mesh) -> Any:
    """NamedShardings for a pytree holding nnx Variables (params, optimizer state, ...).

    Variables with `logical_axes` metadata are split by the rules; every other
    leaf (step counters, scalars) is replicated. Returns a tree of the same
    structure with NamedSharding leaves, as `jax.jit(out_shardings=...)` takes.
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def sharding_of(leaf):
        if isinstance(leaf, nnx.Variable):
            metadata = leaf.get_metadata()
            if LOGICAL_AXES_KEY in metadata:
                spec = logical_to_spec(metadata[LOGICAL_AXES_KEY], leaf.shape, rules, mesh)
                return leaf.replace(NamedSharding(mesh, spec))
            return leaf.replace(replicated)
        return replicated

    return jax.tree.map(sharding_of, abstract_tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(global_batch_size: int, rules: Rules, mesh: Mesh) -> NamedSharding:
    """Sharding of a [batch, length] array: batch split by the rule for BATCH."""
    return NamedSharding(mesh, logical_to_spec((BATCH, None), (global_batch_size, 1), rules, mesh))


def global_batch(
    local_batch: Mapping[str, np.ndarray], rules: Rules, mesh: Mesh
) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over the batch axis.

    Every process passes its own contiguous share of the global batch, rows
    in process order (the data-source contract); the global batch size is the
    local one times the process count.
    """
    arrays = {}
    for name, local in local_batch.items():
        global_shape = (local.shape[0] * jax.process_count(),) + tuple(local.shape[1:])
        sharding = NamedSharding(
            mesh, logical_to_spec((BATCH,) + (None,) * (local.ndim - 1), global_shape, rules, mesh)
        )
        arrays[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return arrays
