"""The run config: a frozen dataclass per section whose fields declare their rules (jrope.fields),
and `convert_config`, which builds them from a ConfigDict (or the JSON form that checkpoints save)
and reports every problem at once, each naming its key, its value and what it may be."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any

from absl import logging
from ml_collections import config_dict
from ml_collections.config_flags import config_flags

from jrope import command_line, fields
from jrope.attention.selection import PACKING_KERNELS
from jrope.data.source import DEFAULT_EVAL_SEED, SOURCES
from jrope.errors import ConfigError
from jrope.fields import RESULT, Declared, did_you_mean, flat_keys, setting
from jrope.model.config import ModelConfig
from jrope.pe_config import PEConfig, UnknownEncodingName, pe_config_from_name
from jrope.saved_run_config import with_tuples

LR_SCHEDULES = ("constant", "cosine")
# What a NaN/Inf loss or gradient norm does (jrope.train.trainer): stop the run or skip the update.
NONFINITE_POLICIES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class OptimConfig(Declared):
    """AdamW after global-norm clipping, on a learning-rate schedule (jrope.train.setup)."""

    section = "opt"

    learning_rate: float = setting(gt=0)  # peak learning rate
    weight_decay: float = setting(ge=0)  # decoupled AdamW weight decay
    b1: float = setting(ge=0, lt=1)  # Adam's first-moment decay
    b2: float = setting(ge=0, lt=1)  # Adam's second-moment decay
    eps: float = setting(gt=0)  # Adam's epsilon
    clip_norm: float = setting(ge=0)  # global gradient norm clip; 0 disables
    schedule: str = setting(choices=LR_SCHEDULES)
    warmup_steps: int = setting(ge=0)  # linear warm-up from 0 (0 = none)
    final_lr_ratio: float = setting(ge=0, le=1)  # cosine: final lr = learning_rate * this
    nonfinite: str = setting("stop", choices=NONFINITE_POLICIES)
    # 'skip' stops after this many in a row (a divergence).
    max_consecutive_skips: int = setting(10, ge=1)


@dataclasses.dataclass(frozen=True)
class MeshConfig(Declared):
    """Device mesh sizes (one may be -1: all remaining devices) and logical-to-mesh rules."""

    section = "mesh"

    data: int = setting(ge=-1)
    fsdp: int = setting(ge=-1)
    tensor: int = setting(ge=-1)
    rules: tuple[tuple[str, Any], ...]  # (logical axis, mesh axis | tuple of mesh axes | None)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Declared):
    section = "checkpoint"

    every_steps: int = setting(ge=1)  # periodic save interval (the final step is always saved)
    max_to_keep: int = setting(ge=1)
    accept_missing_digests: bool = False  # restore a checkpoint without digests, unchecked
    # Keys or sections, comma-separated, that a resume, eval.py or compare may change although
    # they define the result (jrope.train.checkpoints), e.g. 'opt.learning_rate' after a divergence.
    accept_changes: str = ""


@dataclasses.dataclass(frozen=True)
class LogConfig(Declared):
    section = "log"

    every_steps: int = setting(ge=1)  # progress line, JSONL and TensorBoard interval
    tensorboard: bool


@dataclasses.dataclass(frozen=True)
class EvalConfig(Declared):
    section = "eval"

    lengths: tuple[int, ...] = setting(ge=2, distinct=True, nonempty=True)
    num_sequences: int = setting(ge=1)  # per length
    # Global evaluation batch (small: long lengths must fit in memory).
    batch_size: int = setting(ge=1, divides="num_sequences")
    every_steps: int = setting(ge=0)  # evaluation during training (0 = only after the last step)
    # The same evaluation sequences for every run seed and method (numpy's seed range).
    seed: int = setting(DEFAULT_EVAL_SEED, ge=0, le=2**32 - 1)


@dataclasses.dataclass(frozen=True)
class RuntimeConfig(Declared):
    """Process runtime: the persistent compilation cache and a profiler trace."""

    section = "runtime"

    compilation_cache_dir: str = ""  # JAX's compilation cache (a folder or gs://...); '' = off
    # jax.profiler trace of train steps [profile_from_step, profile_to_step) (step s
    # turns state s into s + 1) into <workdir>/tensorboard; to <= from: no trace.
    profile_from_step: int = setting(0, ge=0)
    profile_to_step: int = setting(0, ge=0)


@dataclasses.dataclass(frozen=True)
class TrainConfig(Declared):
    """Everything a training or evaluation run reads."""

    # Parameter initialisation (and the data's, through the config's reference); numpy's range.
    seed: int = setting(ge=0, le=2**32 - 1, defines=RESULT)
    num_steps: int = setting(ge=1)  # optimizer steps
    batch_size: int = setting(ge=1)  # global batch (sequences per step)
    model: ModelConfig
    pe: PEConfig
    data: Any  # the data source's frozen config dataclass (its `source` field names it)
    opt: OptimConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig
    log: LogConfig
    eval: EvalConfig
    runtime: RuntimeConfig

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> TrainConfig:
        """Convert a ConfigDict (or nested dict); ConfigError listing every problem."""
        cfg, problems = convert_config(config)
        if problems:
            raise ConfigError(problems)
        return cfg

    def to_json_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready nested dict that `from_config_dict` accepts back."""
        plain = dataclasses.asdict(self)
        # The name's suffixes override the base settings idempotently: these parse back alike.
        plain["pe"] = {key: getattr(self.pe, key) for key in PE_KEYS}
        for key in DERIVED_DATA_KEYS:  # set again from the model's keys when read back
            plain["data"].pop(key, None)
        return plain


# Each section's keys are its factory's arguments: the pe section's, pe_config_from_name's.
SECTIONS = {"model": ModelConfig, "pe": pe_config_from_name} | {
    cls.section: cls
    for cls in (OptimConfig, MeshConfig, CheckpointConfig, LogConfig, EvalConfig, RuntimeConfig)
}
PE_KEYS = tuple(inspect.signature(pe_config_from_name).parameters)
TOP_KEYS = ("seed", "num_steps", "batch_size")
# The data keys that are the model's: set where the data section is built, never in a config.
DERIVED_DATA_KEYS = {
    "seq_len": "pe.train_context",
    "head_dim": "model.d_model",
    "theta": "pe.theta",
}


def convert_config(config: Mapping[str, Any]) -> tuple[TrainConfig | None, list[str]]:
    """(the run config, []) or (None, every problem of every section, a line each naming its key,
    its value and what it may be). `config`: a ConfigDict, or the nested dict that `to_json_dict`
    writes."""
    raw = config.to_dict() if isinstance(config, config_dict.ConfigDict) else dict(config)
    top = {field.name for field in dataclasses.fields(TrainConfig)}
    problems = key_problems("", raw, top, TOP_KEYS)
    problems += fields.problems(TrainConfig, {key: raw[key] for key in TOP_KEYS if key in raw})
    built = {name: build_section(name, factory, raw.get(name, {}), problems)
             for name, factory in SECTIONS.items()}  # fmt: skip
    model, pe = built["model"], built["pe"]
    if model and pe and model.head_dim % pe.head_block:
        problems.append(
            f"model.d_model = {model.d_model}: {pe.name} needs d_model / num_heads "
            f"({model.head_dim}) a multiple of {pe.head_block}."
        )
        model = None  # the data section's head dim would only repeat it
    data = dict(raw.get("data", {}))
    if data.get("seed") == raw.get("seed") and any(p.startswith("seed ") for p in problems):
        data.pop("seed")  # the data's seed follows seed: its problem is said once
    if data.get("source") not in SOURCES:
        choices = tuple(SOURCES)
        problems.append(f"data.source = {data.get('source')!r} is not one of {choices}"
                        f"{did_you_mean(data.get('source'), choices) or '.'}")  # fmt: skip
    else:
        data_class = SOURCES[data["source"]].load()[0]
        problems += [f"data.{key}: set from {source}; set {source} instead."
                     for key, source in DERIVED_DATA_KEYS.items() if key in data]  # fmt: skip
        if model and pe:
            derived = {"seq_len": pe.train_context, "head_dim": model.head_dim, "theta": pe.theta}
            data.update({k: v for k, v in derived.items() if k in data_class.__dataclass_fields__})
        built["data"] = build_section("data", data_class, data, problems, DERIVED_DATA_KEYS)
    if problems or not all(built.values()):
        return None, problems
    cfg = TrainConfig(**{key: raw[key] for key in TOP_KEYS}, **built)
    refused, warned = keys_without_effect(cfg.data)
    for warning in warned:
        _warn_once(warning)
    impl = cfg.model.attention_impl
    if getattr(cfg.data, "pack", False) and impl not in ("auto", *PACKING_KERNELS):
        refused.append(f"data.pack needs model.attention_impl in {('auto', *PACKING_KERNELS)}, "
                       f"not {impl!r}.")  # fmt: skip
    keys = flat_keys(cfg.to_json_dict())
    for name in filter(None, map(str.strip, cfg.checkpoint.accept_changes.split(","))):
        if not any(key == name or key.startswith(f"{name}.") for key in keys):
            refused.append(f"checkpoint.accept_changes names {name!r}: no such key"
                           f"{did_you_mean(name, keys) or '; drop it.'}")  # fmt: skip
    return (None, refused) if refused else (cfg, [])


def declared_effect(key: str, data_source: str | None) -> str | None:
    """RESULT, PARAMETERS or None: what the field at dotted `key` of a run config declares it
    defines (a data key: in the config of `data_source`)."""
    section, _, name = key.partition(".")
    if not name:
        return fields.defines(TrainConfig, section)
    classes = {**SECTIONS, "pe": PEConfig}
    if section == "data" and data_source in SOURCES:
        classes["data"] = SOURCES[data_source].load()[0]
    cls = classes.get(section)
    return fields.defines(cls, name) if dataclasses.is_dataclass(cls) else None


def build_section(name: str, factory, values, problems: list[str], derived=()) -> Any:
    """`factory(**values)`, or None with a problem appended per unknown or missing key and per
    problem of its declarations; a `derived` key is not built without its value (the sections it
    derives from have their problems)."""
    parameters = inspect.signature(factory).parameters
    if not isinstance(values, Mapping):
        problems.append(f"{name} must be a section, got {values!r}.")
        return None
    absent = [key for key, p in parameters.items() if key not in values and p.default is p.empty]
    unknown = [key for key in values if key not in parameters]
    problems += key_problems(
        f"{name}.", values, parameters, [k for k in absent if k not in derived]
    )
    if absent:
        return None
    try:  # the known keys, so that their problems are reported with the unknown ones
        built = factory(**{key: with_tuples(values[key]) for key in values if key in parameters})
    except ValueError as error:
        if isinstance(error, UnknownEncodingName):
            problems.append(f"{name}.name: {first_line(error)} (jrope.ACCEPTED_NAMES)")
        else:
            lines = str(error).splitlines()
            problems += [line if line.startswith(name) else f"{name}: {line}" for line in lines]
        return None
    return None if unknown else built


def key_problems(prefix: str, values: Mapping, known, required) -> list[str]:
    """A line per key of `values` not `known` and per `required` key it lacks, named with `prefix`."""
    unknown = [f"{prefix}{key}: no such key{did_you_mean(key, known, prefix) or '; drop it.'}"
               for key in values if key not in known]  # fmt: skip
    return unknown + [f"{prefix}{key} is missing; set it in the config file."
                      for key in required if key not in values]  # fmt: skip


def keys_without_effect(data: Any) -> tuple[list[str], list[str]]:
    """(refused, warned): a line per data key set away from its default that the chosen source,
    kernel or label mode never reads (the data config's KEYS_READ_ONLY_BY), with the fix."""
    refused, warned = [], []
    defaults = {field.name: field.default for field in dataclasses.fields(data)}
    for (chooser, readers, refuse), keys in getattr(data, "KEYS_READ_ONLY_BY", {}).items():
        choice = getattr(data, chooser)
        for key in keys:
            if choice in readers or getattr(data, key) == defaults[key]:
                continue
            value = getattr(data, key)
            line = f"data.{key} = {value!r} has no effect with data.{chooser} = {choice!r}"
            if refuse:
                refused.append(f"{line}; drop it, or set data.{chooser} to one of {readers}.")
            else:
                warned.append(f"{line} (only {readers} read it).")
    return refused, warned


@functools.cache
def _warn_once(message: str) -> None:
    """Each warning once per process (every run of a comparison converts its config)."""
    logging.warning("%s", message)


def first_line(err: Exception) -> str:
    """An error's first line without its full stop, for a problem that names the key."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")


def load_config_file(path: str) -> config_dict.ConfigDict:
    """The ConfigDict of a config file (`configs/x.py` or `configs/x.py:ARG`), from any folder."""
    command_line.make_importable(path)
    return config_flags.ConfigFileFlagParser("config", lock_config=False).parse(path)
