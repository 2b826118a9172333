"""The train state: its model, its sharded initialisation and its layout.

The train state is a plain pytree `{'step', 'params', 'opt_state'}`:
`params` is the `nnx.State` of the model's parameters (split once; the
`graphdef` is kept apart and closed over by the jitted functions), `step`
counts completed optimizer steps and is also the data position.

Initialisation is sharded from the start: `nnx.eval_shape` gives the
abstract state, the logical-to-mesh rules turn it into shardings, and the
initialiser is jitted with those as `out_shardings`, so no device ever holds
the full unsharded state.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jrope import sharding
from jrope.checkpointing import abstract_with_shardings
from jrope.config_types import TrainConfig
from jrope.model import Transformer
from jrope.optimizer import make_optimizer


def build_source(
    cfg: TrainConfig, *, process_index: int | None = None, process_count: int | None = None
):
    """The experiment's data source for this process (the data-source contract)."""
    _, source_class = cfg.data_source_spec.load()
    return source_class(
        cfg.data,
        cfg.batch_size,
        jax.process_index() if process_index is None else process_index,
        jax.process_count() if process_count is None else process_count,
    )


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What the jitted functions need to know about the train state.

    graphdef: the model's structure (merged with `params` inside jit).
    abstract: the state as ShapeDtypeStructs carrying their shardings.
    shardings: the state's NamedShardings (same structure as the state).
    optimizer: the optax transformation the state's `opt_state` belongs to.
    """

    graphdef: Any
    abstract: Any
    shardings: Any
    optimizer: optax.GradientTransformation


def _new_state(
    cfg: TrainConfig, vocab_size: int, optimizer: optax.GradientTransformation
) -> dict[str, Any]:
    model = Transformer(
        cfg.model, cfg.pe.to_pe_config(), vocab_size, rngs=nnx.Rngs(params=cfg.seed)
    )
    params = nnx.state(model, nnx.Param)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}


def state_layout(cfg: TrainConfig, vocab_size: int, mesh: Mesh) -> StateLayout:
    """Abstract shapes, shardings and graphdef of the train state, without allocating it."""
    optimizer = make_optimizer(cfg.opt, cfg.num_steps)
    with jax.set_mesh(mesh):
        abstract_model = nnx.eval_shape(
            lambda: Transformer(
                cfg.model, cfg.pe.to_pe_config(), vocab_size, rngs=nnx.Rngs(params=cfg.seed)
            )
        )
        graphdef, _ = nnx.split(abstract_model, nnx.Param)
        abstract_state = jax.eval_shape(lambda: _new_state(cfg, vocab_size, optimizer))
    shardings = sharding.state_shardings(abstract_state, cfg.mesh.rules, mesh)
    return StateLayout(
        graphdef, abstract_with_shardings(abstract_state, shardings), shardings, optimizer
    )


def init_state(
    cfg: TrainConfig, vocab_size: int, layout: StateLayout, mesh: Mesh
) -> dict[str, Any]:
    """A freshly initialised train state, created directly in its shards."""
    with jax.set_mesh(mesh):
        return jax.jit(
            lambda: _new_state(cfg, vocab_size, layout.optimizer), out_shardings=layout.shardings
        )()


def model_from_params(graphdef: Any, params: Any) -> Transformer:
    """The model view of a params state (cheap: no copy)."""
    return nnx.merge(graphdef, params)
