"""The checks before step 1 that need the machine, the workdir or the data (after the config's
own): mesh, batches, the evaluation's memory, workdir, data (one evaluation batch per
length). Every problem is raised in one ConfigError, a line each naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable

import jax
import numpy as np

from jrope import commands
from jrope.attention import choose_kernel
from jrope.data import files
from jrope.data.files import is_uri
from jrope.data.source import DataSource, build_source
from jrope.errors import ConfigError, DataError
from jrope.train import damping
from jrope.train.checkpoints import accept_changes_problems, finished_steps
from jrope.train.config import TrainConfig, first_line
from jrope.train.setup import mesh_sizes, model_io

# The plain attention path holds a [B, N, T, T] float32 logits tensor and its
# softmax at once: it must fit in half of the memory available.
PLAIN_ATTENTION_MEMORY_FRACTION = 0.5
# Kernels that never hold the whole logits tensor.
MEMORY_LINEAR_KERNELS = ("blockwise", "splash", "cudnn")
_GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class RunEnvironment:
    """What the checks know of the machine (memory_bytes None: unknown, that check is skipped):
    memory_bytes is what one attention tensor competes for: the host's available RAM on CPU (its
    devices share it), one device's limit on accelerators."""

    num_devices: int
    process_count: int
    platform: str  # 'cpu', 'gpu' or 'tpu'
    memory_bytes: int | None

    @classmethod
    def detect(cls) -> RunEnvironment:
        """This machine."""
        platform = jax.default_backend()
        if platform == "cpu":
            memory = _host_available_memory()
        else:
            memory = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
        return cls(jax.device_count(), jax.process_count(), platform, memory)


@dataclasses.dataclass(frozen=True)
class CheckedRun:
    """A run config that passed every check, and the data source built while checking it."""

    cfg: TrainConfig
    source: DataSource


def check_training_run(config, workdir: str, env: RunEnvironment | None = None) -> CheckedRun:
    """Raise ConfigError (DataError: all the data's) listing every problem that would stop or
    spoil a training run; `config`: a TrainConfig, or the ConfigDict to convert in this pass."""
    return _check_run(config, workdir, env, evaluation=False)


def check_evaluation_run(config, workdir: str, env: RunEnvironment | None = None) -> CheckedRun:
    """Raise ConfigError (DataError) listing every problem that would stop an evaluation."""
    return _check_run(config, workdir, env, evaluation=True)


def _check_run(config, workdir: str, env: RunEnvironment | None, *, evaluation: bool) -> CheckedRun:
    cfg = config if isinstance(config, TrainConfig) else TrainConfig.from_config_dict(config)
    env = env or RunEnvironment.detect()
    problems = []
    try:
        sizes = mesh_sizes(cfg.mesh, env.num_devices)
        problems += _batch_problems(cfg, env, sizes)
    except ValueError as err:
        sizes, problems = None, [str(err)]
    if not evaluation:
        problems += damping.bound_problems(cfg)
    problems += _workdir_problems(cfg, workdir, evaluation=evaluation)
    problems += accept_changes_problems(cfg)
    data_seed = getattr(cfg.data, "seed", 0)  # numpy takes no other seed
    if not (isinstance(data_seed, int) and 0 <= data_seed < 2**32):
        problems.append(f"data.seed must be an integer in 0 .. 2**32 - 1, got {data_seed}.")
        source, data_problems = None, []
    else:
        source, data_problems = _data_problems(cfg, env, evaluation)
    # The forward's size needs the data's vocabulary.
    problems += _memory_problems(cfg, env, sizes, None if source is None else model_io(source))
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


def _memory_problems(cfg: TrainConfig, env: RunEnvironment, sizes, io) -> list[str]:
    """Each evaluation length's attention kernel, its plain logits and (io: the model's sizes,
    model_io, once the data are known) its whole forward against half the memory; the first
    length that does not fit (longer ones only need more)."""
    impl_key = f"model.attention_impl = {cfg.model.attention_impl!r}"

    def kernel(length: int) -> str:
        return choose_kernel(cfg.model.attention, cfg.encoding, length=length, backend=env.platform)

    try:
        kernel(cfg.pe.train_context)
    except ValueError as err:
        return [f"{impl_key}: {first_line(err)}"]
    # The rows and heads whose logits share one pool: a process's CPU devices share its RAM.
    rows, heads = max(cfg.eval.batch_size // env.process_count, 1), cfg.model.num_heads
    if env.platform != "cpu" and sizes is not None:
        data_parallel = math.prod(sizes[axis] for axis in _batch_mesh_axes(cfg))
        rows = cfg.eval.batch_size
        rows = rows // data_parallel if rows % data_parallel == 0 else rows
        heads = heads // sizes["tensor"] if heads % sizes["tensor"] == 0 else heads
    budget = PLAIN_ATTENTION_MEMORY_FRACTION * (env.memory_bytes or math.inf)
    available = f"more than half of the {(env.memory_bytes or 0) / _GIB:.1f} GiB available"

    def needed(rows: int, length: int) -> int:
        outputs_per_position = io.get("output_channels") or io["vocab_size"]
        return forward_bytes(cfg, rows, length, outputs_per_position, kernel(length))

    forward_problem = []
    for length in sorted(set(cfg.eval.lengths)):
        try:
            impl = kernel(length)
        except ValueError as err:
            return [f"{impl_key} at eval length {length}: {first_line(err)}"]
        logits = rows * heads * length * length * 4
        if impl not in MEMORY_LINEAR_KERNELS and logits > budget:
            return [
                f"eval.lengths: the plain '{impl}' attention at length {length} needs "
                f"{logits / _GIB:.1f} GiB for one layer's float32 logits [{rows} rows, {heads} "
                f"heads, {length}, {length}], {available}; set "
                f"--config.model.attention_impl=blockwise (memory linear in length, "
                f"model.block_size={cfg.model.block_size}) or "
                f"--config.model.blockwise_min_length={length}, or lower eval.batch_size."
            ]
        if io is None or forward_problem or needed(rows, length) <= budget:
            continue
        longest = largest_fitting(lambda n: needed(rows, n) <= budget, length)
        fewer = largest_fitting(lambda n, length=length: needed(n, length) <= budget, rows)
        lower_batch = (
            f" or at most {fewer * env.process_count} rows at once (--config.eval.batch_size)"
            if fewer
            else f" (at length {length} not even one sequence at a time fits)"
        )
        forward_problem.append(
            f"eval.lengths: one evaluation forward at length {length} ({rows} rows, "
            f"eval.batch_size) needs about {needed(rows, length) / _GIB:.1f} GiB of activations, "
            f"{available}; the longest length that fits is {longest}{lower_batch}."
        )
    return forward_problem


def forward_bytes(cfg: TrainConfig, rows: int, length: int, outputs: int, kernel: str) -> int:
    """Bytes of float32 activations of one forward of `rows` sequences of `length` (an estimate);
    outputs: per position; kernel: the attention kernel at this length (its scores)."""
    model = cfg.model
    read_out = 1 if model.readout == "last" else length
    # Alive at once in a block: six [rows, length, d_model] tensors (residual stream, normalised
    # input, q, k, v, attention output) and the MLP's two of mlp_ratio * d_model; the output
    # logits and their log-softmax.
    stream = rows * length * model.d_model * (6 + 2 * model.mlp_ratio)
    logits = rows * read_out * outputs * 2
    keys = min(length, model.block_size) if kernel in MEMORY_LINEAR_KERNELS else length
    scores = 2 * rows * model.num_heads * length * keys
    batch = 3 * rows * length  # inputs, targets, weights
    return 4 * (stream + logits + scores + batch)


def largest_fitting(fits: Callable[[int], bool], largest: int) -> int:
    """The largest n in 1..largest with fits(n) (fits grows false with n), 0 when none."""
    low, high = 0, largest
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


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
    if not is_uri(workdir) and os.path.isdir(path):
        misplaced = _misplaced_entries(path)
        if misplaced:
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


def _data_problems(cfg: TrainConfig, env, evaluation: bool) -> tuple[DataSource | None, list]:
    """(the data source, the data's problems): built, then one evaluation batch per length."""
    # The local text files the run reads: an evaluation reads no training text.
    problems = _text_path_problems(cfg, ("eval_path",) if evaluation else ("path", "eval_path"))
    if problems or cfg.batch_size % env.process_count or cfg.eval.batch_size % env.process_count:
        return None, problems  # the batch problems are reported already
    try:
        source = build_source(cfg.data, cfg.batch_size, jax.process_index(), env.process_count)
    except (ValueError, OSError) as err:  # absent, unreadable or too short data
        text = str(err).strip()
        return None, [text if text.startswith("data") else f"data: {text}"]
    for length in sorted(set(cfg.eval.lengths)):
        try:
            next(iter(source.eval_batches(length, cfg.eval.num_sequences, cfg.eval.batch_size)))
        except ValueError as err:
            problems.append(f"eval.lengths: at length {length}, {first_line(err)}.")
    return source, problems


def _text_path_problems(cfg: TrainConfig, path_fields: tuple[str, ...]) -> list[str]:
    # Local-file data configs (jrope.data.text_bytes: text, audio tokens) name their files;
    # other sources (synthetic, the WikiText builders) need none or check their own.
    source = getattr(cfg.data, "source", None)
    if source not in ("text", "audio_tokens"):
        return []
    problems = []
    for field in path_fields:
        path = getattr(cfg.data, field)
        if is_uri(path):
            problem = files.uri_problem(path, f"data.{field} =", must_exist=True)
            problems += [problem] if problem else []
        elif not os.path.exists(os.path.expanduser(path)):
            fix = (
                f"point --config.data.{field} at a UTF-8 text file or a directory of them"
                if source == "text"
                else f"prepare the audio tokens first with python -m jrope.data.audio "
                f"--wav_dir=WAVS --out_dir={path} (WAVS: any folder of .wav files, e.g. MusicNet's "
                "musicnet.tar.gz from https://zenodo.org/records/5120004, unpacked), or point "
                f"--config.data.{field} at a folder that command wrote"
            )
            problems.append(f"data.{field} = {path!r} does not exist; {fix}.")
    return problems


def _host_available_memory() -> int | None:
    """MemAvailable of /proc/meminfo (Linux); None elsewhere (the memory checks are skipped)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            return next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")
            )
    except (OSError, StopIteration):
        return None


def readout_problem(local_batch: dict[str, np.ndarray], readout: str) -> str | None:
    """readout='last' (the loss sees the last position only) needs zero weights elsewhere; a NaN
    weight is left to the non-finite check (a broken batch, not a weighting)."""
    if readout == "last" and np.any(np.abs(local_batch["weights"][:, :-1]) > 0):
        return (
            "model.readout = 'last' computes logits at the last position only, but this data "
            "source weights other positions too; set --config.model.readout=all."
        )
    return None
