"""The run config: a frozen dataclass per section, each checking its own values when it is built,
and `convert_config`, which builds them from a ConfigDict and reports every problem at once, each
naming its key and the fix.

A TrainConfig is what the harness reads; checkpoints save its JSON form (`to_json_dict`), which
converts back the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Mapping
from typing import Any

from absl import logging
from ml_collections import config_dict
from ml_collections.config_flags import config_flags

from jrope import commands
from jrope.attention.selection import PACKING_KERNELS
from jrope.data.source import DEFAULT_EVAL_SEED, SOURCES
from jrope.encodings import make_encoding
from jrope.errors import ConfigError
from jrope.model.config import ConfigSection, ModelConfig
from jrope.pe_config import ACCEPTED_NAMES, PEConfig, UnknownEncodingName, pe_config_from_name

LR_SCHEDULES = ("constant", "cosine")
# What a NaN/Inf loss or gradient norm does (jrope.train.trainer): stop the run or skip the update.
NONFINITE_POLICIES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class PESection:
    """The pe section: an encoding's name and the base settings that its suffixes override."""

    name: str  # any paper or reference name (docs/mathematics.md, section 4)
    train_context: int  # L: tau(t) = t / (1 + |t| / L), gamma = c / L; the training length
    theta: float = 10000.0  # rotary base: omega_b = theta^(-2b / head_dim)
    gamma_min: float = 1e-4  # damping floor: gamma = softplus(raw) + gamma_min
    init_gamma: float = 1e-4  # initial damping
    eta_max: float = 0.1  # shear bound: eta = eta_max * tanh(raw)
    init_eta: float = 0.0  # initial shear

    def __post_init__(self):
        numbers = dataclasses.asdict(self)
        del numbers["name"]
        problems = [f"pe.{k} must be a finite number, got {v}." for k, v in numbers.items()
                    if not (isinstance(v, (int, float)) and math.isfinite(v))]  # fmt: skip
        if problems:
            raise ValueError("\n".join(problems))
        try:
            self.pe_config()
        except UnknownEncodingName as error:
            names = [name for line in ACCEPTED_NAMES.splitlines() for name in line.split(" | ")]
            hint = did_you_mean(self.name, [n.strip() for n in names if re.fullmatch(r"\s*\w+", n)])
            raise ValueError(f"pe.name: {first_line(error)}{hint} (jrope.ACCEPTED_NAMES)") from None
        except ValueError as error:
            raise ValueError(f"pe: {first_line(error)}; fix that pe.* value.") from None

    def pe_config(self) -> PEConfig:
        return pe_config_from_name(**dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class OptimConfig(ConfigSection):
    """AdamW after global-norm clipping, on a learning-rate schedule (jrope.train.setup)."""

    section = "opt"

    learning_rate: float  # peak learning rate
    weight_decay: float  # decoupled AdamW weight decay
    b1: float  # Adam's first-moment decay
    b2: float  # Adam's second-moment decay
    eps: float  # Adam's epsilon
    clip_norm: float  # global gradient norm clip; 0 disables
    schedule: str  # one of LR_SCHEDULES
    warmup_steps: int  # linear warm-up from 0 (0 = none)
    final_lr_ratio: float  # cosine: final lr = learning_rate * final_lr_ratio
    nonfinite: str = "stop"  # one of NONFINITE_POLICIES
    max_consecutive_skips: int = 10  # 'skip' stops after this many in a row (a divergence)

    def rules(self):
        return [
            ("schedule", self.schedule in LR_SCHEDULES, LR_SCHEDULES),
            ("nonfinite", self.nonfinite in NONFINITE_POLICIES, NONFINITE_POLICIES),
            ("learning_rate", self.learning_rate > 0, "> 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("b1", 0 <= self.b1 < 1, "in [0, 1)"),
            ("b2", 0 <= self.b2 < 1, "in [0, 1)"),
            ("eps", self.eps > 0, "> 0"),
            ("clip_norm", self.clip_norm >= 0, ">= 0 (0: no clipping)"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("final_lr_ratio", 0 <= self.final_lr_ratio <= 1, "in [0, 1]"),
            ("max_consecutive_skips", self.max_consecutive_skips >= 1, ">= 1"),
        ]


@dataclasses.dataclass(frozen=True)
class MeshConfig(ConfigSection):
    """Device mesh sizes (one may be -1: all remaining devices) and logical-to-mesh rules."""

    section = "mesh"

    data: int
    fsdp: int
    tensor: int
    rules: tuple[tuple[str, Any], ...]  # (logical axis, mesh axis | tuple of mesh axes | None)

    def problems(self) -> list[str]:
        sizes = (self.data, self.fsdp, self.tensor)
        if sizes.count(-1) <= 1 and all(size >= 1 or size == -1 for size in sizes):
            return []
        return [f"mesh sizes must be >= 1, one -1 at most; got {sizes}."]


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(ConfigSection):
    section = "checkpoint"

    every_steps: int  # periodic save interval (the final step is always saved)
    max_to_keep: int
    accept_missing_digests: bool = False  # restore a checkpoint without digests, unchecked
    # Keys or sections, comma-separated, that a resume may change besides eval, log,
    # checkpoint, runtime and mesh (e.g. 'opt.learning_rate' after a divergence).
    accept_changes: str = ""

    def rules(self):
        return [
            ("every_steps", self.every_steps >= 1, ">= 1"),
            ("max_to_keep", self.max_to_keep >= 1, ">= 1"),
        ]


@dataclasses.dataclass(frozen=True)
class LogConfig(ConfigSection):
    section = "log"

    every_steps: int  # progress line, JSONL and TensorBoard interval
    tensorboard: bool

    def rules(self):
        return [("every_steps", self.every_steps >= 1, ">= 1")]


@dataclasses.dataclass(frozen=True)
class EvalConfig(ConfigSection):
    section = "eval"

    lengths: tuple[int, ...]
    num_sequences: int  # per length
    batch_size: int  # global evaluation batch (small: long lengths must fit in memory)
    every_steps: int  # evaluation during training (0 = only after the last step)
    seed: int = DEFAULT_EVAL_SEED  # the same evaluation sequences for every run seed and method

    def rules(self):
        return [
            ("seed", 0 <= self.seed < 2**32, "an integer in 0 .. 2**32 - 1"),
            ("num_sequences", self.num_sequences >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("every_steps", self.every_steps >= 0, ">= 0"),
            (
                "lengths",
                bool(self.lengths) and all(type(n) is int and n >= 2 for n in self.lengths),
                "a non-empty tuple of integer lengths >= 2",
            ),
        ]

    def problems(self) -> list[str]:
        problems = super().problems()
        sequences, batch = self.num_sequences, self.batch_size
        if sequences >= 1 and batch >= 1 and sequences % batch:
            problems.append(f"eval.batch_size {batch} must divide eval.num_sequences {sequences}.")
        return problems


@dataclasses.dataclass(frozen=True)
class RuntimeConfig(ConfigSection):
    """Process runtime: the persistent compilation cache and a profiler trace."""

    section = "runtime"

    compilation_cache_dir: str = ""  # JAX's compilation cache (a folder or gs://...); '' = off
    # jax.profiler trace of train steps [profile_from_step, profile_to_step) (step s
    # turns state s into s + 1) into <workdir>/tensorboard; to <= from: no trace.
    profile_from_step: int = 0
    profile_to_step: int = 0

    def rules(self):
        return [
            ("profile_from_step", self.profile_from_step >= 0, ">= 0"),
            ("profile_to_step", self.profile_to_step >= 0, ">= 0"),
        ]

    @property
    def profiles(self) -> bool:
        return self.profile_to_step > self.profile_from_step


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training or evaluation run reads."""

    seed: int  # parameter initialisation (and the data's, through the config's reference)
    num_steps: int  # optimizer steps
    batch_size: int  # global batch (sequences per step)
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
        plain["pe"] = {key: getattr(self.pe, key) for key in SECTIONS["pe"].__dataclass_fields__}
        for key in DERIVED_DATA_KEYS:  # set again from the model's keys when read back
            plain["data"].pop(key, None)
        return plain


SECTIONS = {
    "model": ModelConfig,
    "pe": PESection,
    "opt": OptimConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "eval": EvalConfig,
    "runtime": RuntimeConfig,
}
# The data keys that are the model's: set where the data section is built, never in a config.
DERIVED_DATA_KEYS = {
    "seq_len": "pe.train_context",
    "head_dim": "model.d_model",
    "theta": "pe.theta",
}


def convert_config(config: Mapping[str, Any]) -> tuple[TrainConfig | None, list[str]]:
    """(the run config, []) or (None, every problem of every section, a line each naming its key
    and the fix). `config`: a ConfigDict, or the nested dict that `to_json_dict` writes."""
    raw = config.to_dict() if isinstance(config, config_dict.ConfigDict) else dict(config)
    top = {field.name for field in dataclasses.fields(TrainConfig)}
    problems = [f"{key}: no such key{did_you_mean(key, top) or '; drop it.'}"
                for key in raw if key not in top]  # fmt: skip
    problems += [
        f"{key} must be an integer >= 1, got {raw.get(key)!r}."
        for key in ("num_steps", "batch_size")
        if not (type(raw.get(key)) is int and raw[key] >= 1)
    ]
    if not (type(raw.get("seed")) is int and 0 <= raw["seed"] < 2**32):  # numpy's seeds
        problems.append(f"seed must be an integer in 0 .. 2**32 - 1, got {raw.get('seed')!r}.")
    built = {name: build_section(name, cls, raw.get(name, {}), problems)
             for name, cls in SECTIONS.items()}  # fmt: skip
    model, pe_section = built["model"], built.pop("pe")
    built["pe"] = pe = pe_section and pe_section.pe_config()
    data = dict(raw.get("data", {}))
    if model and pe:
        try:  # the encoding's blocks must divide the model's head dimension
            make_encoding(pe, num_heads=model.num_heads, head_dim=model.head_dim)
        except ValueError as error:
            problems.append(
                f"model.d_model = {model.d_model} (head dim {model.head_dim} with "
                f"{model.num_heads} heads): {first_line(error)}."
            )
            model = None  # the data section's head dim would only repeat it
    if data.get("source") not in SOURCES:
        problems.append(f"data.source = {data.get('source')!r} is not one of {tuple(SOURCES)}.")
    else:
        data_class = SOURCES[data["source"]].load()[0]
        problems += [f"data.{key}: set from {source}; set that key instead."
                     for key, source in DERIVED_DATA_KEYS.items() if key in data]  # fmt: skip
        if model and pe:
            derived = {"seq_len": pe.train_context, "head_dim": model.head_dim, "theta": pe.theta}
            data.update({k: v for k, v in derived.items() if k in data_class.__dataclass_fields__})
        built["data"] = build_section("data", data_class, data, problems, DERIVED_DATA_KEYS)
    if problems or not all(built.values()):
        return None, problems
    cfg = TrainConfig(seed=raw["seed"], num_steps=raw["num_steps"], batch_size=raw["batch_size"],
                      **built)  # fmt: skip
    refused, warned = keys_without_effect(cfg.data)
    for warning in warned:
        _warn_once(warning)
    impl = cfg.model.attention_impl
    if getattr(cfg.data, "pack", False) and impl not in ("auto", *PACKING_KERNELS):
        refused.append(f"data.pack needs segment ids: model.attention_impl = {impl!r} takes none.")
    return (None, refused) if refused else (cfg, [])


def build_section(
    name: str, section: type, values: Any, problems: list[str], derived: Any = ()
) -> Any:
    """`section(**values)`, or None with a problem appended per unknown or missing key and per
    problem that the section's own checks raise; a `derived` key is not built without its value
    (the sections it derives from have their problems)."""
    fields = {f.name: f for f in dataclasses.fields(section) if f.init}
    if not isinstance(values, Mapping):
        problems.append(f"{name} must be a section of keys, got {values!r}.")
        return None
    absent = [key for key, f in fields.items() if key not in values
              and f.default is f.default_factory is dataclasses.MISSING]  # fmt: skip
    unknown = [key for key in values if key not in fields]
    problems += [f"{name}.{key}: no such key{did_you_mean(key, fields, f'{name}.') or '; drop it.'}"
                 for key in unknown]  # fmt: skip
    problems += [f"{name}.{key} is missing; set it in the config file."
                 for key in absent if key not in derived]  # fmt: skip
    if absent:
        return None
    try:  # the known keys, so that their problems are reported with the unknown ones
        built = section(**{key: _as_tuples(values[key]) for key in values if key in fields})
    except (ValueError, TypeError) as error:
        lines = str(error).splitlines()
        problems += [line if line.startswith(name) else f"{name}: {line}" for line in lines]
        return None
    return None if unknown else built


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """'; did you mean <prefix><the closest choice>?', or '' when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _as_tuples(value: Any) -> Any:
    """JSON's lists as the tuples the sections hold, recursively."""
    return tuple(map(_as_tuples, value)) if isinstance(value, (list, tuple)) else value


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
    commands.make_importable(path)
    return config_flags.ConfigFileFlagParser("config", lock_config=False).parse(path)
