"""The objects every run builds from its config, built in one place: data source, mesh, state layout.

    run = set_up_run(cfg)
    state = run.init_state()      # or restored into run.layout.abstract

The trainer, the evaluation, the benchmarks and the tests all start here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jrope.data.source import DataSource, build_source
from jrope.train import sharding
from jrope.train.config import TrainConfig
from jrope.train.state import StateLayout, init_state, model_io, state_layout


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """A run's data source (this process's share), device mesh and train-state layout."""

    cfg: TrainConfig
    source: DataSource
    mesh: Mesh
    layout: StateLayout

    def init_state(self) -> dict[str, Any]:
        """A freshly initialised train state, created directly in its shards."""
        return init_state(self.cfg, model_io(self.source), self.layout, self.mesh)


def set_up_run(
    cfg: TrainConfig,
    *,
    devices: Sequence[jax.Device] | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    source: DataSource | None = None,
) -> RunSetup:
    """Builds the source, the mesh over `devices` (default: all) and the state layout.

    process_index, process_count: this process's place (default: JAX's), for
    building another process's share of the data.
    source: this process's data source when already built (by the run's checks).
    """
    if source is None:
        source = build_source(
            cfg.data,
            cfg.batch_size,
            jax.process_index() if process_index is None else process_index,
            jax.process_count() if process_count is None else process_count,
        )
    mesh = sharding.make_mesh(cfg.mesh, devices)
    return RunSetup(cfg, source, mesh, state_layout(cfg, model_io(source), mesh))
