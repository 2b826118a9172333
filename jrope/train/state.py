"""The train state: its model, its optimizer, its sharded initialisation and its layout.

The train state is a plain pytree `{'step', 'params', 'opt_state'}`:
`params` is the `nnx.State` of the model's parameters (split once; the
`graphdef` is kept apart and closed over by the jitted functions), `step`
counts completed optimizer steps and is also the data position.

Initialisation is sharded from the start: `nnx.eval_shape` gives the
abstract state, the logical-to-mesh rules turn it into shardings, and the
initialiser is jitted with those as `out_shardings`, so no device ever holds
the full unsharded state.

The optimizer is AdamW with global-norm clipping: the paper trains with a
constant learning rate and clipping at 1.0; warm-up and cosine decay are
there for longer runs. Weight decay applies to every parameter, as in the
paper's code (PyTorch AdamW over all parameters).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jrope.data.source import DataSource
from jrope.model import Transformer
from jrope.train import sharding
from jrope.train.checkpoints import abstract_with_shardings
from jrope.train.config import OptimConfig, TrainConfig


def learning_rate_schedule(cfg: OptimConfig, num_steps: int) -> optax.Schedule:
    """Step -> learning rate: linear warm-up from 0, then constant or cosine decay."""
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.learning_rate)
    else:
        decay_steps = max(num_steps - cfg.warmup_steps, 1)
        main = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, alpha=cfg.final_lr_ratio)
    if cfg.warmup_steps == 0:
        return main
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return optax.join_schedules([warmup, main], boundaries=[cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig, num_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(cfg, num_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
    if cfg.clip_norm == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)


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


def model_io(source: DataSource) -> dict[str, int | None]:
    """The Transformer's input and output sizes, as the data source declares them.

    Token sources give a vocabulary; regression sources real-valued input and
    output channels instead (jrope.data.source).
    """
    if source.task == "regression":
        return dict(
            vocab_size=None,
            input_channels=source.input_channels,
            output_channels=source.output_channels,
        )
    return dict(vocab_size=source.vocab_size)


def _new_model(cfg: TrainConfig, io: dict[str, int | None]) -> Transformer:
    return Transformer(cfg.model, cfg.encoding, **io, rngs=nnx.Rngs(params=cfg.seed))


def _new_state(
    cfg: TrainConfig, io: dict[str, int | None], optimizer: optax.GradientTransformation
) -> dict[str, Any]:
    params = nnx.state(_new_model(cfg, io), nnx.Param)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}


def state_layout(cfg: TrainConfig, io: dict[str, int | None], mesh: Mesh) -> StateLayout:
    """Abstract shapes, shardings and graphdef of the train state, without allocating it.

    io: the model's input and output sizes (model_io).
    """
    optimizer = make_optimizer(cfg.opt, cfg.num_steps)
    with jax.set_mesh(mesh):
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: _new_model(cfg, io)), nnx.Param)
        abstract_state = jax.eval_shape(lambda: _new_state(cfg, io, optimizer))
    shardings = sharding.state_shardings(abstract_state, cfg.mesh.rules, mesh)
    return StateLayout(
        graphdef, abstract_with_shardings(abstract_state, shardings), shardings, optimizer
    )


def init_state(
    cfg: TrainConfig, io: dict[str, int | None], layout: StateLayout, mesh: Mesh
) -> dict[str, Any]:
    """A freshly initialised train state, created directly in its shards (io: model_io)."""
    with jax.set_mesh(mesh):
        return jax.jit(
            lambda: _new_state(cfg, io, layout.optimizer), out_shardings=layout.shardings
        )()


def model_from_params(graphdef: Any, params: Any) -> Transformer:
    """The model view of a params state (cheap: no copy)."""
    return nnx.merge(graphdef, params)
