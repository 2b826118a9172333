"""What every run builds from its config, once: data source, device mesh, train-state layout,
checkpointer and the settings its loop and evaluations read. `run = set_up_run(cfg)`, then
`run.init_state()` (or restore into `run.layout.abstract`) and `run.plan_kernels(params)`.

The mesh always has the axes (data, fsdp, tensor), size 1 when unused, so one set of rules (logical
axis names of jrope.model.axes to mesh axes) serves every device count; a dimension that does not
divide its mesh axes is replicated. The state {'step', 'params', 'opt_state'} is created sharded;
`step` counts completed optimizer steps (also the data position). Each process of a multi-host run
loads only its share of every batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrope import flops
from jrope.data.source import DataSource, build_source
from jrope.encodings import Encoding, make_encoding
from jrope.model import Transformer, damping
from jrope.model.axes import BATCH, LOGICAL_AXES_KEY, Rules, logical_to_spec
from jrope.model.config import ModelConfig
from jrope.train import config as run_config
from jrope.train import runtime
from jrope.train.checkpoints import Checkpointer
from jrope.train.config import MeshConfig, OptimConfig, TrainConfig
from jrope.train.outputs import say

MESH_AXES = ("data", "fsdp", "tensor")


def mesh_sizes(mesh_cfg: MeshConfig, num_devices: int) -> dict[str, int] | None:
    """Sizes of the mesh axes over `num_devices`, the first -1 axis filled in; None if they do not
    fit (a size 0 or a second -1 never does)."""
    sizes = dict(zip(MESH_AXES, (mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor), strict=True))
    known = math.prod(size for size in sizes.values() if size != -1)
    for axis in [axis for axis, size in sizes.items() if size == -1][:1]:
        sizes[axis] = num_devices // known if known else 0
    return sizes if math.prod(sizes.values()) == num_devices else None


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all), with -1 filled in."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes(mesh_cfg, len(devices))
    if sizes is None:
        raise ValueError(f"The mesh {mesh_cfg} does not fit {len(devices)} devices.")
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(
        tuple(sizes[axis] for axis in MESH_AXES), MESH_AXES, axis_types=axis_types, devices=devices
    )


def state_shardings(abstract_tree: Any, rules: Rules, mesh: Mesh) -> Any:
    """NamedShardings for a pytree of nnx Variables (same structure): a Variable with
    `logical_axes` metadata is split by the rules, any other leaf replicated."""

    def sharding_of(leaf):
        if not isinstance(leaf, nnx.Variable):
            return NamedSharding(mesh, PartitionSpec())
        axes = leaf.get_metadata().get(LOGICAL_AXES_KEY)
        spec = PartitionSpec() if axes is None else logical_to_spec(axes, leaf.shape, rules, mesh)
        return leaf.replace(NamedSharding(mesh, spec))

    return jax.tree.map(sharding_of, abstract_tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def global_batch(
    local_batch: Mapping[str, np.ndarray], rules: Rules, mesh: Mesh
) -> dict[str, jax.Array]:
    """This process's rows -> global arrays sharded over the batch axis. Every process passes its
    own contiguous share, rows in process order: [B / process_count, ...] -> [B, ...]."""
    arrays = {}
    for name, local in local_batch.items():
        global_shape = (local.shape[0] * jax.process_count(),) + tuple(local.shape[1:])
        sharding = NamedSharding(
            mesh, logical_to_spec((BATCH,) + (None,) * (local.ndim - 1), global_shape, rules, mesh)
        )
        arrays[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return arrays


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
    """AdamW (weight decay on every parameter, as in the paper's code), after global-norm clipping
    unless opt.clip_norm is 0; with opt.nonfinite = 'skip', inside optax.apply_if_finite, whose
    state counts the updates skipped (in all and in a row) and so checkpoints them."""
    schedule = learning_rate_schedule(cfg, num_steps)
    optimizer = optax.adamw(
        schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.clip_norm != 0:
        optimizer = optax.chain(optax.clip_by_global_norm(cfg.clip_norm), optimizer)
    if cfg.nonfinite == "skip":
        # The host stops the run at max_consecutive_skips in a row, before optax would apply one.
        optimizer = optax.apply_if_finite(optimizer, cfg.max_consecutive_skips)
    return optimizer


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What the jitted functions need to know about the train state."""

    graphdef: Any  # the model's structure, merged with `params` inside jit
    abstract: Any  # the state as ShapeDtypeStructs carrying their shardings
    shardings: Any  # the state's NamedShardings (same structure as the state)
    optimizer: optax.GradientTransformation  # the transformation `opt_state` belongs to
    new_state: Callable[[], dict[str, Any]]  # a fresh state, for jit to create in its shards


def model_io(source: DataSource) -> dict[str, int | None]:
    """The Transformer's input and output sizes as the data source declares them: a vocabulary,
    or a regression source's real-valued input and output channels."""
    if source.task == "regression":
        return dict(
            vocab_size=None,
            input_channels=source.input_channels,
            output_channels=source.output_channels,
        )
    return dict(vocab_size=source.vocab_size)


def run_encoding(cfg: TrainConfig) -> Encoding:
    """The model's Encoding, for the longest window it trains or evaluates on."""
    return make_encoding(
        cfg.pe,
        num_heads=cfg.model.num_heads,
        head_dim=cfg.model.head_dim,
        max_length=max(cfg.pe.train_context, *cfg.eval.lengths),
    )


def model_from_params(graphdef: Any, params: Any) -> Transformer:
    """The model view of a params state (cheap: no copy)."""
    return nnx.merge(graphdef, params)


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """What a run computes with, built from its config once (`set_up_run`): the data source (this
    process's share), the encoding, the device mesh, the state layout and its initialiser, the
    kernel plan, the checkpointer, and the values its steps, loop and evaluations read. Of the
    config it holds the evaluation's settings and what checkpoints and start records save."""

    encoding: Encoding
    source: DataSource
    mesh: Mesh
    layout: StateLayout
    plan: damping.KernelPlan  # the kernels planned for model.max_damping alone
    schedule: optax.Schedule  # step -> the learning rate of the optimizer's update
    throughput: flops.Throughput  # what turns a step rate into tokens/s and MFU
    rules: Rules  # logical axis names -> mesh axes
    batch_sharding: NamedSharding  # of a global train batch [B, T]
    seed: int  # the parameters' and the dropout's
    dropout_rate: float
    compute_dtype: str
    train_length: int  # pe.train_context
    batch_size: int  # rows of a global train batch
    num_steps: int
    max_skips: int  # opt.max_consecutive_skips: non-finite updates skipped in a row at most
    method: str  # pe.name, which labels the result rows
    eval: run_config.EvalConfig
    log_every_steps: int
    tensorboard: bool
    profile_steps: range  # the train steps the profiler traces
    config_json: dict[str, Any]  # the config as checkpoints and start records save it
    checkpointer: Checkpointer | None = None  # of the workdir set_up_run was given

    def init_state(self) -> dict[str, Any]:
        """A freshly initialised train state, created directly in its shards."""
        with jax.set_mesh(self.mesh):
            return jax.jit(self.layout.new_state, out_shardings=self.layout.shardings)()

    def global_batch(self, local_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        return global_batch(local_batch, self.rules, self.mesh)

    def plan_kernels(self, params: Any) -> damping.KernelPlan:
        """The kernels of the train step and the evaluations for the damping of `params`."""
        plan = self.plan.for_params(params)
        if plan.measured.passed:
            kernel, length = plan.kernel(self.train_length), self.train_length
            say(f"{plan.measured.describe()}: kernel {kernel!r} at length {length}, blockwise "
                f"blocks of {plan.measured.block_size}.")  # fmt: skip
        return plan


def _new_model(model: ModelConfig, seed: int, encoding, io, mesh) -> Transformer:
    projection = runtime.model_projection(mesh.devices.flat[0].platform)
    return Transformer(model, encoding, **io, rngs=nnx.Rngs(params=seed), projection=projection)


def _new_state(new_model: Callable[[], Transformer], optimizer) -> dict[str, Any]:
    params = nnx.state(new_model(), nnx.Param)
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}


def state_layout(cfg: TrainConfig, encoding: Encoding, io: dict, mesh: Mesh) -> StateLayout:
    """Abstract shapes, shardings and graphdef of the train state, without allocating it.
    io: the model's input and output sizes (model_io)."""
    optimizer = make_optimizer(cfg.opt, cfg.num_steps)
    new_model = functools.partial(_new_model, cfg.model, cfg.seed, encoding, io, mesh)
    with jax.set_mesh(mesh):
        graphdef, params = nnx.split(nnx.eval_shape(new_model), nnx.Param)
        opt_state = jax.eval_shape(optimizer.init, params)
    step = jax.ShapeDtypeStruct((), jnp.int32)
    abstract_state = {"step": step, "params": params, "opt_state": opt_state}
    shardings = state_shardings(abstract_state, cfg.mesh.rules, mesh)
    abstract = jax.tree.map(
        lambda leaf, sharding: leaf.update(sharding=sharding), abstract_state, shardings
    )
    new_state = functools.partial(_new_state, new_model, optimizer)
    return StateLayout(graphdef, abstract, shardings, optimizer, new_state)


def set_up_run(
    cfg: TrainConfig,
    workdir: str | None = None,
    source: DataSource | None = None,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> RunSetup:
    """Builds the source (unless given: this process's, built by the checks), the mesh over
    `devices` (default: all), the state layout and, for a `workdir`, its checkpointer
    (`<workdir>/checkpoints`)."""
    if source is None:
        source = build_source(cfg.data, cfg.batch_size, jax.process_index(), jax.process_count())
    mesh, encoding, rules = make_mesh(cfg.mesh, devices), run_encoding(cfg), cfg.mesh.rules
    io, schedule = model_io(source), learning_rate_schedule(cfg.opt, cfg.num_steps)
    layout, devices = state_layout(cfg, encoding, io, mesh), list(mesh.devices.flat)
    rows, length, model = cfg.batch_size, cfg.pe.train_context, cfg.model
    batch_sharding = NamedSharding(mesh, logical_to_spec((BATCH, None), (rows, 1), rules, mesh))
    lengths, config_json, saves = (length, *cfg.eval.lengths), cfg.to_json_dict(), cfg.checkpoint
    plan = damping.KernelPlan(model, encoding, devices[0].platform, lengths, layout.graphdef)
    throughput = flops.Throughput.for_model(model, rows, length, devices, **io)
    checkpointer = None if workdir is None else Checkpointer(
        epath.Path(workdir) / "checkpoints", every_steps=saves.every_steps,
        max_to_keep=saves.max_to_keep, config_json=config_json,
        accept_missing_digests=saves.accept_missing_digests,
    )  # fmt: skip
    return RunSetup(
        encoding, source, mesh, layout, plan, schedule, throughput, rules, batch_sharding,
        cfg.seed, model.dropout_rate, model.compute_dtype, length, rows, cfg.num_steps,
        cfg.opt.max_consecutive_skips, cfg.pe.name, cfg.eval, cfg.log.every_steps,
        cfg.log.tensorboard, range(cfg.runtime.profile_from_step, cfg.runtime.profile_to_step),
        config_json, checkpointer,
    )  # fmt: skip
