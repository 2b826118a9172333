"""The checks before step 1 that need the machine, the workdir or the data (after the config's
own): mesh, batches, workdir, kernels and data (one evaluation batch per length). Every problem
is raised in one ConfigError, a line each naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax
import numpy as np

from jrope import commands
from jrope.attention import choose_kernel
from jrope.data import files
from jrope.data.files import is_uri
from jrope.data.source import DataSource, build_source
from jrope.errors import ConfigError, DataError
from jrope.model import damping
from jrope.train.checkpoints import finished_steps
from jrope.train.config import TrainConfig, first_line
from jrope.train.setup import mesh_sizes


@dataclasses.dataclass(frozen=True)
class RunEnvironment:
    """What the checks know of the machine."""

    num_devices: int
    process_count: int
    platform: str  # 'cpu', 'gpu' or 'tpu'

    @classmethod
    def detect(cls) -> RunEnvironment:
        return cls(jax.device_count(), jax.process_count(), jax.default_backend())


@dataclasses.dataclass(frozen=True)
class CheckedRun:
    """A run config that passed every check, and the data source built while checking it."""

    cfg: TrainConfig
    source: DataSource


def check_run(
    config, workdir: str, env: RunEnvironment | None = None, *, evaluation: bool = False
) -> CheckedRun:
    """Raise ConfigError (DataError: all the data's) listing every problem that would stop or
    spoil a training run (or an evaluation); `config`: a TrainConfig, or the ConfigDict to convert
    in this pass."""
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_config_dict(config)
    env = env or RunEnvironment.detect()
    problems = []
    try:
        problems += _batch_problems(cfg, env, mesh_sizes(cfg.mesh, env.num_devices))
    except ValueError as err:
        problems = [str(err)]
    if not evaluation:
        problems += damping.bound_problems(cfg.model, cfg.encoding)
    problems += _workdir_problems(cfg, workdir, evaluation=evaluation)
    source, data_problems = _data_problems(cfg, env)
    problems += _kernel_problems(cfg, env.platform)
    if source is not None:
        # A source weights its positions by its task, in every batch alike: one batch settles it.
        readout = readout_problem(source.train_batch(0), cfg.model.readout)
        problems += [readout] if readout else []
    if problems:
        raise ConfigError(problems + data_problems)
    if data_problems:
        raise DataError(data_problems)
    return CheckedRun(cfg, source)


def _batch_problems(cfg: TrainConfig, env: RunEnvironment, sizes: dict[str, int]) -> list[str]:
    batch_axes = _batch_mesh_axes(cfg)
    data_parallel = math.prod(sizes[axis] for axis in batch_axes)
    where = f"the mesh axes {batch_axes} of the 'batch' rule"
    problems = []
    if cfg.batch_size % data_parallel:
        problems.append(
            f"batch_size = {cfg.batch_size} is not divisible by the data-parallel size "
            f"{data_parallel} ({where}); set --config.batch_size to a multiple of "
            f"{data_parallel}, or move devices to mesh.tensor."
        )
    batches = {"batch_size": cfg.batch_size, "eval.batch_size": cfg.eval.batch_size}
    problems += [
        f"{key} = {rows} does not split over the {env.process_count} processes (each loads its "
        f"share); set it to a multiple of {env.process_count}."
        for key, rows in batches.items()
        if rows % env.process_count
    ]
    # One process can hand its rows to a batch split over devices, or to a
    # replicated batch (it holds all rows); several processes only to a split one.
    if env.process_count > 1 and cfg.eval.batch_size % data_parallel:
        problems.append(
            f"eval.batch_size = {cfg.eval.batch_size} is not divisible by the data-parallel size "
            f"{data_parallel} ({where}), which a multi-process run needs; set it (and "
            f"eval.num_sequences) to a multiple of {data_parallel}."
        )
    return problems


def _kernel_problems(cfg: TrainConfig, platform: str) -> list[str]:
    """The refusal of an attention_impl that does not apply at the training length or at an
    evaluation length (the first one)."""
    for length in sorted({cfg.pe.train_context, *cfg.eval.lengths}):
        try:
            choose_kernel(cfg.model.attention, cfg.encoding, length=length, backend=platform)
        except ValueError as err:
            impl = cfg.model.attention_impl
            return [f"model.attention_impl = {impl!r} at length {length}: {first_line(err)}"]
    return []


def _batch_mesh_axes(cfg: TrainConfig) -> tuple[str, ...]:
    axes = dict(cfg.mesh.rules).get("batch")
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _workdir_problems(cfg: TrainConfig, workdir: str, *, evaluation: bool) -> list[str]:
    """The workdir is writable (or a bucket that answers) and holds a finished checkpoint to
    evaluate, or none beyond num_steps to train (a training run must not end before it)."""
    path = workdir if is_uri(workdir) else os.path.abspath(os.path.expanduser(workdir))
    checkpoints, existing, problem = f"{path.rstrip('/')}/checkpoints", path, None
    if is_uri(workdir):
        problem = files.uri_problem(workdir, "--workdir")
    else:
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            problem = (
                f"--workdir {path}: {existing} is a file, not a directory; choose another "
                "--workdir."
            )
        elif not os.access(existing, os.W_OK | os.X_OK):
            problem = (
                f"--workdir {path} is not writable ({existing} denies writing); choose a "
                "writable --workdir."
            )
    if problem:
        return [problem]
    if not is_uri(workdir) and os.path.isdir(path) and (misplaced := _misplaced_entries(path)):
        return misplaced
    steps = finished_steps(checkpoints)
    if evaluation and not steps:
        return [
            f"--workdir {path} holds no finished checkpoint in {checkpoints}; train first "
            f"({commands.command('train')} --config=... --workdir={path}) or point --workdir at "
            "a trained run."
        ]
    if not evaluation and steps and steps[-1] > cfg.num_steps:
        return [
            f"num_steps = {cfg.num_steps} is below step {steps[-1]} of the latest checkpoint in "
            f"{workdir}/checkpoints: that run went further. Set --config.num_steps={steps[-1]} "
            f"(or more) to see or continue it, evaluate it with {commands.command('eval')}, or "
            "choose another --workdir."
        ]
    return []


# What the run keeps in its workdir under these names: folders, and files it appends to.
_WORKDIR_FOLDERS = {"checkpoints": "checkpoints", "tensorboard": "TensorBoard"}
_WORKDIR_FILES = ("metrics.jsonl", "starts.jsonl")
_RESULTS_FOLDER = re.compile(r"eval_step\d+")


def _misplaced_entries(path: str) -> list[str]:
    """A problem per entry of the workdir that is a file where the run keeps a folder, or the
    reverse: the run would stop on it part-way (or, for results, after training)."""
    problems = []
    for name in sorted(os.listdir(path)):
        entry = os.path.join(path, name)
        if name in _WORKDIR_FOLDERS or _RESULTS_FOLDER.fullmatch(name):
            what = _WORKDIR_FOLDERS.get(name, "evaluation results")
            wrong = None if os.path.isdir(entry) else "a file"
            kept = f"its {what} folder"
        elif name in _WORKDIR_FILES:
            wrong = "a folder" if os.path.isdir(entry) else None
            kept = f"its log {name}"
        else:
            continue
        if wrong:
            problems.append(
                f"--workdir {path}: {entry} is {wrong}, where the run keeps {kept}. Move it aside "
                f"(mv {entry} {entry}.aside) or choose another --workdir."
            )
    return problems


def _data_problems(cfg: TrainConfig, env: RunEnvironment) -> tuple[DataSource | None, list]:
    """(the data source, the data's problems): built, then one evaluation batch per length."""
    if cfg.batch_size % env.process_count or cfg.eval.batch_size % env.process_count:
        return None, []  # the batch problems are reported already
    try:
        source = build_source(cfg.data, cfg.batch_size, jax.process_index(), env.process_count)
    except (ValueError, OSError) as err:  # absent, unreadable or too short data
        text = str(err).strip()
        return None, [text if text.startswith("data") else f"data: {text}"]
    problems = []
    for length in sorted(set(cfg.eval.lengths)):
        try:
            next(iter(source.eval_batches(length, cfg.eval.num_sequences, cfg.eval.batch_size)))
        except ValueError as err:
            problems.append(f"eval.lengths: at length {length}, {first_line(err)}.")
    return source, problems


def readout_problem(local_batch: dict[str, np.ndarray], readout: str) -> str | None:
    """readout='last' (the loss sees the last position only) needs zero weights elsewhere; a NaN
    weight is left to the non-finite check (a broken batch, not a weighting)."""
    if readout == "last" and np.any(np.abs(local_batch["weights"][:, :-1]) > 0):
        return (
            "model.readout = 'last' computes logits at the last position only, but this data "
            "source weights other positions too; set --config.model.readout=all."
        )
    return None
