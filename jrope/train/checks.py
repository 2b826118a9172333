"""The checks before step 1 that need the machine, the workdir or the data (after the config's
own): mesh, batches, workdir, kernels, and the data (one evaluation batch per length). Every
problem is raised in one ConfigError, a line each naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax
import numpy as np
from flax import nnx

from jrope import command_line, flops, saved_run_config
from jrope.attention import choose_kernel
from jrope.data import files
from jrope.data.source import DataSource, build_source
from jrope.errors import ConfigError, DataError
from jrope.model import damping
from jrope.model.transformer import TransformerBlock
from jrope.train.checkpoints import finished_steps
from jrope.train.config import TrainConfig, first_line
from jrope.train.setup import make_optimizer, mesh_sizes, run_encoding


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
    optimizer, encoding = make_optimizer(cfg.opt, cfg.num_steps), run_encoding(cfg)
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
    batches += [] if evaluation else [("batch_size", cfg.batch_size, "pe.train_context", cfg.pe.train_context)]  # fmt: skip
    rows_key, rows, length_key, length = max(batches, key=lambda batch: batch[1] * batch[3])
    activation = rows * length * model.d_model * np.dtype(model.compute_dtype).itemsize
    needs = model.num_layers * sum(sizes) + activation
    if shortfall := flops.memory_shortfall(needs // env.num_devices, "a lower bound"):
        sizes = {"model.d_model": model.d_model, "model.num_layers": model.num_layers,
                 "model.mlp_ratio": model.mlp_ratio, rows_key: rows, length_key: length}  # fmt: skip
        return [", ".join(f"{key} = {value}" for key, value in sizes.items())
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
