"""What every run builds from its config, once, after checking it: `open_run` checks the run
(check_run: mesh, batches, workdir, kernels, memory and the data, every problem in one ConfigError),
holds the workdir's lock and builds the data source, device mesh, train-state layout, checkpointer
and the settings its loop and evaluations read (set_up_run). Then `run.init_state()` (or restore
into `run.layout.abstract`) and `run.plan_kernels(params)`.

The mesh always has the axes (data, fsdp, tensor), size 1 when unused, so one set of rules (logical
axis names of jrope.model.axes to mesh axes) serves every device count; a dimension that does not
divide its mesh axes is replicated. The state {'step', 'params', 'opt_state'} is created sharded;
`step` counts completed optimizer steps (also the data position). Each process of a multi-host run
loads only its share of every batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jrope import command_line, flops, saved_run_config
from jrope.attention import choose_kernel
from jrope.data import files
from jrope.data.source import DataSource, build_source
from jrope.encodings import Encoding, make_encoding
from jrope.errors import ConfigError, DataError
from jrope.model import Transformer, damping
from jrope.model.axes import BATCH, LOGICAL_AXES_KEY, Rules, logical_to_spec
from jrope.model.config import ModelConfig
from jrope.model.transformer import TransformerBlock
from jrope.train import config as run_config
from jrope.train import runtime
from jrope.train.checkpoints import Checkpointer, WorkdirLock, finished_steps
from jrope.train.config import MeshConfig, OptimConfig, TrainConfig, first_line
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


def make_optimizer(cfg: OptimConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """AdamW at the learning rates of `schedule` (weight decay on every parameter, as in the
    paper's code), after global-norm clipping unless opt.clip_norm is 0; with opt.nonfinite =
    'skip', inside optax.apply_if_finite, whose state counts the updates skipped (in all and in a
    row) and so checkpoints them."""
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


def state_layout(
    cfg: TrainConfig, encoding: Encoding, io: dict, mesh: Mesh, optimizer
) -> StateLayout:
    """Abstract shapes, shardings and graphdef of the train state of `optimizer`, without
    allocating it. io: the model's input and output sizes (model_io)."""
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
    optimizer, devices = make_optimizer(cfg.opt, schedule), list(mesh.devices.flat)
    layout = state_layout(cfg, encoding, io, mesh, optimizer)
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


def open_run(cfg: TrainConfig, workdir: str, held: contextlib.ExitStack, *, role: str) -> RunSetup:
    """The checks (check_run), then `workdir`'s lock held for `role` and the run's parts
    (set_up_run) until `held` closes, which closes the checkpointer (an in-flight save finishes,
    also on errors). role: 'training' or 'evaluation'."""
    source = check_run(cfg, workdir, evaluation=role == "evaluation")
    runtime.enable_compilation_cache(cfg.runtime.compilation_cache_dir)  # before anything compiles
    held.enter_context(WorkdirLock(workdir, enabled=jax.process_index() == 0, role=role))
    run = set_up_run(cfg, workdir, source)
    held.callback(run.checkpointer.close)
    return run


@dataclasses.dataclass(frozen=True)
class RunEnvironment:
    """What the checks know of the machine."""

    num_devices: int
    process_count: int
    platform: str  # 'cpu', 'gpu' or 'tpu'


def check_run(
    cfg: TrainConfig, workdir: str, env: RunEnvironment | None = None, *, evaluation: bool = False
) -> DataSource:
    """The data source, built while checking; ConfigError (DataError: all the data's) listing
    every problem that would stop or spoil a training run (or an evaluation)."""
    env = env or RunEnvironment(jax.device_count(), jax.process_count(), jax.default_backend())
    problems = _batch_problems(cfg, env)
    optimizer = make_optimizer(cfg.opt, learning_rate_schedule(cfg.opt, cfg.num_steps))
    encoding = run_encoding(cfg)
    if not evaluation:
        problems += damping.bound_problems(cfg.model, encoding)
    problems += _workdir_problems(cfg, workdir, evaluation=evaluation)
    problems += kernel_problems(cfg, encoding, env.platform)
    memory = _memory_problems(cfg, env, encoding, optimizer, evaluation=evaluation)
    source, data_problems = (None, []) if memory else _data_problems(cfg, env)  # too big to try
    problems += memory
    if source is not None and (
        readout := readout_problem(source.train_batch(0), cfg.model.readout)
    ):
        problems.append(readout)  # every batch of a source weights its positions alike
    if problems or data_problems:
        raise (ConfigError if problems else DataError)(problems + data_problems)
    return source


def kernel_problems(cfg: TrainConfig, encoding, backend: str) -> list[str]:
    """The first length of the run whose model.attention_impl does not apply on `backend`."""
    for length in sorted({cfg.pe.train_context, *cfg.eval.lengths}):
        try:
            choose_kernel(cfg.model.attention, encoding, length=length, backend=backend)
        except ValueError as err:
            impl = cfg.model.attention_impl
            return [f"model.attention_impl = {impl!r} at length {length}: {first_line(err)}"]
    return []


def _batch_problems(cfg: TrainConfig, env: RunEnvironment) -> list[str]:
    sizes = mesh_sizes(cfg.mesh, env.num_devices)
    if sizes is None:
        mesh, n = cfg.mesh, env.num_devices
        shown = f"mesh.data, fsdp, tensor = {mesh.data}, {mesh.fsdp}, {mesh.tensor} do not fit {n}"
        return [f"{shown} devices; set sizes >= 1 that multiply to {n}, or one to -1."]
    axes = dict(cfg.mesh.rules).get("batch")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    data_parallel = math.prod(sizes[axis] for axis in axes)
    # Each process loads its share of a batch; one process can also hand a replicated one its
    # rows, but several only a batch split over the devices.
    batches = (("batch_size", cfg.batch_size), ("eval.batch_size", cfg.eval.batch_size))
    splits = [(*batch, data_parallel, "data-parallel devices")
              for batch in batches[: 1 + (env.process_count > 1)]]  # fmt: skip
    splits += [(*batch, env.process_count, "processes") for batch in batches]
    return [
        f"{key} = {rows} does not split over the {parts} {what}; set a multiple of {parts}."
        for key, rows, parts, what in splits
        if rows % parts
    ]


def _memory_problems(cfg: TrainConfig, env, encoding, optimizer, *, evaluation: bool) -> list:
    """What a device holds at the least, before anything is built: the train state (one block's
    parameters and optimizer state, num_layers times) and one [rows, length, d_model] activation
    of the largest batch, all spread evenly over the devices."""
    model, block = cfg.model, lambda: TransformerBlock(cfg.model, encoding, rngs=nnx.Rngs(0))
    params = nnx.state(nnx.eval_shape(block), nnx.Param)
    state = (params, jax.eval_shape(optimizer.init, params))
    sizes = [math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state) if x.shape]
    batches = [("eval.batch_size", cfg.eval.batch_size, "max(eval.lengths)", max(cfg.eval.lengths))]
    if not evaluation:
        batches.append(("batch_size", cfg.batch_size, "pe.train_context", cfg.pe.train_context))
    rows_key, rows, length_key, length = max(batches, key=lambda batch: batch[1] * batch[3])
    activation = rows * length * model.d_model * np.dtype(model.compute_dtype).itemsize
    needs = model.num_layers * sum(sizes) + activation
    if shortfall := flops.memory_shortfall(needs // env.num_devices, "a lower bound"):
        shown = {"model.d_model": model.d_model, "model.num_layers": model.num_layers}
        shown |= {"model.mlp_ratio": model.mlp_ratio, rows_key: rows, length_key: length}
        return [", ".join(f"{key} = {value}" for key, value in shown.items())
                + f": a device {shortfall}; lower them, or add devices."]  # fmt: skip
    return []


def _workdir_problems(cfg: TrainConfig, workdir: str, *, evaluation: bool) -> list[str]:
    """The workdir is writable (or a bucket that answers) and holds a finished checkpoint to
    evaluate, or none beyond num_steps to train (a training run must not end before it)."""
    if files.is_uri(workdir):
        if problem := files.uri_problem(workdir, "--workdir"):
            return [problem]
    else:
        path = existing = os.path.abspath(os.path.expanduser(workdir))
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
            return [f"--workdir {path}: {existing} is no folder you can write to."]
        if os.path.isdir(path) and (misplaced := _misplaced_entries(path, evaluation)):
            return misplaced
    steps = finished_steps(f"{workdir.rstrip('/')}/checkpoints")
    if evaluation and not steps:
        raise saved_run_config.no_checkpoint(workdir)
    if not evaluation and steps and steps[-1] > cfg.num_steps:
        return [
            f"num_steps = {cfg.num_steps} is below {workdir}'s latest checkpoint, step "
            f"{steps[-1]}; set num_steps >= {steps[-1]}, or use {command_line.command('eval')}."
        ]
    return []


# What the run keeps in its workdir: folders, and files it appends to.
_WORKDIR_FOLDERS = re.compile(r"checkpoints|tensorboard|eval_step\d+")
_WORKDIR_FILES = ("metrics.jsonl", "starts.jsonl")


def _misplaced_entries(path: str, evaluation: bool) -> list[str]:
    """A problem per entry of the workdir that is a file where the run keeps a folder, or the
    reverse, or one it writes (an evaluation reads the checkpoints only) but cannot: the run
    would stop on it part-way (or, for results, after the work)."""
    problems = []
    for name in sorted(os.listdir(path)):
        entry = os.path.join(path, name)
        folder = os.path.isdir(entry)
        if _WORKDIR_FOLDERS.fullmatch(name) and not folder or name in _WORKDIR_FILES and folder:
            kind = ("a folder", "a file")[:: 1 if folder else -1]
            problems.append(f"{entry} is {kind[0]} where the run keeps {kind[1]}; move it "
                            f"aside: mv {entry} {entry}.aside")  # fmt: skip
        elif _WORKDIR_FOLDERS.fullmatch(name) or name in _WORKDIR_FILES:
            if evaluation and name == "checkpoints":
                continue
            if not os.access(entry, os.W_OK | (os.X_OK if folder else 0)):
                problems.append(f"{entry} is not writable; chmod -R u+w {entry}, or use another "
                                "--workdir.")  # fmt: skip
    return problems


def _data_problems(cfg: TrainConfig, env: RunEnvironment) -> tuple[DataSource | None, list]:
    """(the data source, the data's problems): built, then one evaluation batch per length."""
    if cfg.batch_size % env.process_count or cfg.eval.batch_size % env.process_count:
        return None, []  # the batch problems say so
    length = None
    try:  # absent, unreadable or too short data
        source = build_source(cfg.data, cfg.batch_size, jax.process_index(), env.process_count)
        for length in sorted(set(cfg.eval.lengths)):
            next(iter(source.eval_batches(length, cfg.eval.num_sequences, cfg.eval.batch_size)))
    except (ValueError, OSError) as err:
        where = "data" if length is None else f"eval.lengths: at length {length}"
        text = str(err).strip()
        return None, [text if text.startswith("data") else f"{where}: {text}"]
    return source, []


def readout_problem(local_batch: dict[str, np.ndarray], readout: str) -> str | None:
    """readout='last' (the loss sees the last position only) needs zero weights elsewhere; a NaN
    weight is left to the non-finite check (a broken batch, not a weighting)."""
    if readout == "last" and np.any(np.abs(local_batch["weights"][:, :-1]) > 0):
        return "model.readout = 'last' ignores weighted positions; set 'all'."
    return None
