"""Checks of a run's config against itself and the machine, before anything compiles.

A mistake found after minutes of compilation (or hours of training, for the
final long-length evaluation) costs that time; these checks cost
milliseconds. Every check runs, and all problems are reported together in
one ConfigError, one line each, naming the config key and the fix.

Checked: the encoding (a known name, valid settings, a head dimension the
encoding's blocks divide), the mesh against the devices present, the batch
against the data-parallel size and the process count, the attention memory
of the longest evaluation, the workdir (writable; holding checkpoints, for
evaluation) and the dataset files. Single-section checks (choices, positive
sizes, d_model divisible by num_heads) run earlier, when the ConfigDict is
converted (jrope.train.config).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax

from jrope.attention import choose_kernel
from jrope.pe_config import PAPER_METHODS, UnknownEncodingName
from jrope.train.config import ConfigError, TrainConfig
from jrope.train.resume import finished_steps
from jrope.train.sharding import mesh_sizes

# The plain attention path holds a [B, N, T, T] float32 logits tensor and its
# softmax at once: it must fit in half of the memory available.
PLAIN_ATTENTION_MEMORY_FRACTION = 0.5
_GIB = 2.0**30


@dataclasses.dataclass(frozen=True)
class RunEnvironment:
    """What the checks need to know about the machine.

    num_devices: devices of all processes together.
    process_count: JAX processes of the run.
    platform: 'cpu', 'gpu' or 'tpu'.
    memory_bytes: memory one attention tensor competes for: the host's
      available RAM on CPU (all CPU devices share it), one device's memory
      limit on accelerators; None when unknown (the memory check is skipped).
    """

    num_devices: int
    process_count: int
    platform: str
    memory_bytes: int | None

    @classmethod
    def detect(cls) -> RunEnvironment:
        platform = jax.default_backend()
        if platform == "cpu":
            memory = _host_available_memory()
        else:
            memory = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
        return cls(jax.device_count(), jax.process_count(), platform, memory)


def check_training_run(cfg: TrainConfig, workdir: str, env: RunEnvironment | None = None) -> None:
    """Raise ConfigError listing every problem that would stop or spoil a training run."""
    env = RunEnvironment.detect() if env is None else env
    problems = _model_and_machine_problems(cfg, env)
    problems += _workdir_problems(workdir, needs_checkpoint=False)
    problems += _dataset_problems(cfg, ("path", "eval_path"))
    if problems:
        raise ConfigError(problems)


def check_evaluation_run(cfg: TrainConfig, workdir: str, env: RunEnvironment | None = None) -> None:
    """Raise ConfigError listing every problem that would stop an evaluation of a trained run."""
    env = RunEnvironment.detect() if env is None else env
    problems = _model_and_machine_problems(cfg, env)
    problems += _workdir_problems(workdir, needs_checkpoint=True)
    problems += _dataset_problems(cfg, ("eval_path",))
    if problems:
        raise ConfigError(problems)


def _model_and_machine_problems(cfg: TrainConfig, env: RunEnvironment) -> list[str]:
    encoding, problems = _encoding_problems(cfg)
    mesh_sizes, mesh_problems = _mesh_problems(cfg, env)
    problems += mesh_problems
    if mesh_sizes is not None:
        problems += _batch_problems(cfg, env, mesh_sizes)
    problems += _attention_problems(cfg, env, encoding, mesh_sizes)
    return problems


def _encoding_problems(cfg: TrainConfig):
    """(the run's Encoding or None, problems)."""
    try:
        cfg.pe_config
    except UnknownEncodingName as err:
        examples = ", ".join(PAPER_METHODS[:7])
        return None, [
            (
                f"pe.name = {cfg.pe.name!r} is not a known encoding ({_first_line(err)}); "
                f"use e.g. {examples} (all forms: jrope.ACCEPTED_NAMES)."
            )
        ]
    except ValueError as err:
        return None, [f"pe settings: {_first_line(err)}; fix that pe.* value."]
    try:
        return cfg.encoding, []
    except ValueError as err:
        return None, [
            f"model.d_model / model.num_heads (head dim {cfg.model.head_dim}): {_first_line(err)}."
        ]


def _mesh_problems(cfg: TrainConfig, env: RunEnvironment):
    """(mesh sizes by axis name with -1 filled in, or None; problems)."""
    try:
        return mesh_sizes(cfg.mesh, env.num_devices), []
    except ValueError as err:
        return None, [str(err)]


def _batch_problems(cfg: TrainConfig, env: RunEnvironment, mesh_sizes: dict[str, int]) -> list[str]:
    batch_axes = _batch_mesh_axes(cfg)
    data_parallel = math.prod(mesh_sizes[axis] for axis in batch_axes)
    where = f"the mesh axes {batch_axes} of the 'batch' rule"
    problems = []
    if cfg.batch_size % data_parallel:
        problems.append(
            f"batch_size = {cfg.batch_size} is not divisible by the data-parallel size {data_parallel} ({where}); "
            f"set --config.batch_size to a multiple of {data_parallel}, or move devices to mesh.tensor."
        )
    for key, rows in (("batch_size", cfg.batch_size), ("eval.batch_size", cfg.eval.batch_size)):
        if rows % env.process_count:
            problems.append(
                f"{key} = {rows} does not split over the {env.process_count} processes (each loads its share); "
                f"set it to a multiple of {env.process_count}."
            )
    # One process can hand its rows to a batch split over devices, or to a
    # replicated batch (it holds all rows); several processes only to a split one.
    if env.process_count > 1 and cfg.eval.batch_size % data_parallel:
        problems.append(
            f"eval.batch_size = {cfg.eval.batch_size} is not divisible by the data-parallel size {data_parallel} "
            f"({where}), which a multi-process run needs; set it (and eval.num_sequences) to a multiple of "
            f"{data_parallel}."
        )
    return problems


def _attention_problems(cfg: TrainConfig, env: RunEnvironment, encoding, mesh_sizes) -> list[str]:
    """The attention path at each evaluation length: valid, and its logits fit in memory."""
    problems = []
    has_bias = encoding is not None and encoding.has_bias
    for length in sorted(set(cfg.eval.lengths)):
        try:
            impl = choose_kernel(cfg.model, has_bias=has_bias, length=length, backend=env.platform)
        except ValueError as err:
            problems.append(
                f"model.attention_impl = {cfg.model.attention_impl!r}: {_first_line(err)}"
            )
            break
        if impl == "blockwise" or env.memory_bytes is None:
            continue
        rows, heads = _rows_and_heads_per_memory(cfg, env, mesh_sizes)
        needed = rows * heads * length * length * 4
        if needed > PLAIN_ATTENTION_MEMORY_FRACTION * env.memory_bytes:
            problems.append(
                f"eval.lengths: the plain '{impl}' attention at length {length} needs {needed / _GIB:.1f} GiB for "
                f"one layer's float32 logits [{rows} rows, {heads} heads, {length}, {length}], more than half of "
                f"the {env.memory_bytes / _GIB:.1f} GiB available; set --config.model.attention_impl=blockwise "
                f"(memory linear in length, model.block_size={cfg.model.block_size}) or "
                f"--config.model.blockwise_min_length={length}, or lower eval.batch_size."
            )
            break  # longer lengths only need more
    return problems


def _rows_and_heads_per_memory(
    cfg: TrainConfig, env: RunEnvironment, mesh_sizes
) -> tuple[int, int]:
    """Evaluation rows and heads whose logits share one memory pool (see RunEnvironment.memory_bytes)."""
    if env.platform == "cpu" or mesh_sizes is None:
        # All of a process's CPU devices share the host's RAM.
        return max(cfg.eval.batch_size // env.process_count, 1), cfg.model.num_heads
    data_parallel = math.prod(mesh_sizes[axis] for axis in _batch_mesh_axes(cfg))
    rows = (
        cfg.eval.batch_size // data_parallel
        if cfg.eval.batch_size % data_parallel == 0
        else cfg.eval.batch_size
    )
    tensor = mesh_sizes["tensor"]
    heads = (
        cfg.model.num_heads // tensor if cfg.model.num_heads % tensor == 0 else cfg.model.num_heads
    )
    return rows, heads


def _batch_mesh_axes(cfg: TrainConfig) -> tuple[str, ...]:
    axes = dict(cfg.mesh.rules).get("batch")
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _workdir_problems(workdir: str, *, needs_checkpoint: bool) -> list[str]:
    if "://" in workdir:
        return []  # a cloud bucket (gs://...): orbax and the loggers check it themselves
    path = os.path.abspath(os.path.expanduser(workdir))
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return [
            f"--workdir {path}: {existing} is a file, not a directory; choose another --workdir."
        ]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [
            f"--workdir {path} is not writable ({existing} denies writing); choose a writable --workdir."
        ]
    if needs_checkpoint:
        checkpoints = os.path.join(path, "checkpoints")
        if not finished_steps(checkpoints):
            return [
                (
                    f"--workdir {path} holds no finished checkpoint in {checkpoints}; train first "
                    f"(python train.py --config=... --workdir={path}) or point --workdir at a trained run."
                )
            ]
    return []


def _dataset_problems(cfg: TrainConfig, path_fields: tuple[str, ...]) -> list[str]:
    # Local-file data configs (jrope.data.text_bytes: text, audio tokens) name their files;
    # other sources (synthetic, the WikiText builders) need none or check their own.
    source = getattr(cfg.data, "source", None)
    if source not in ("text", "audio_tokens"):
        return []
    problems = []
    for field in path_fields:
        path = os.path.expanduser(getattr(cfg.data, field))
        if os.path.exists(path):
            continue
        if source == "text":
            problems.append(
                f"data.{field} = {path!r} does not exist; point --config.data.{field} at a UTF-8 "
                "text file or a directory of them."
            )
        else:
            problems.append(
                f"data.{field} = {path!r} does not exist; prepare the audio tokens first with "
                f"python -m jrope.data.audio --wav_dir=WAVS --out_dir={path} (WAVS: any folder "
                "of .wav files, e.g. MusicNet's musicnet.tar.gz from "
                "https://zenodo.org/records/5120004, unpacked), or point "
                f"--config.data.{field} at a folder that command wrote."
            )
    return problems


def _host_available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _first_line(err: Exception) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")
