"""The run config: a frozen dataclass per section, each field commented where it is declared;
`convert_config`, the one place a config is validated, returning every problem at once, each naming
its key and the fix; loading a config file from any folder.

A config file's ConfigDict becomes one TrainConfig here, and the TrainConfig is what every part of
the harness reads; checkpoints save its JSON form (`to_json_dict`), which converts back the same.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Any

from absl import logging
from ml_collections import config_dict
from ml_collections.config_flags import config_flags

from jrope.attention.selection import PACKING_KERNELS
from jrope.command_line import make_importable
from jrope.data.source import DEFAULT_EVAL_SEED, source_spec
from jrope.encodings import Encoding, make_encoding
from jrope.errors import ConfigError
from jrope.model.config import ConfigSection, ModelConfig
from jrope.pe_config import PAPER_METHODS, PEConfig, UnknownEncodingName, pe_config_from_name

LR_SCHEDULES = ("constant", "cosine")
# What a NaN/Inf loss or gradient norm does (jrope.train.trainer): stop the run or skip the update.
NONFINITE_POLICIES = ("stop", "skip")


@dataclasses.dataclass(frozen=True)
class OptimConfig(ConfigSection):
    section = "opt"

    learning_rate: float
    weight_decay: float
    b1: float
    b2: float
    eps: float
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
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("clip_norm", self.clip_norm >= 0, ">= 0 (0: no clipping)"),
            ("max_consecutive_skips", self.max_consecutive_skips >= 1, ">= 1"),
        ]


@dataclasses.dataclass(frozen=True)
class MeshConfig(ConfigSection):
    """Device mesh sizes (one may be -1: all remaining devices) and logical-to-mesh rules."""

    data: int
    fsdp: int
    tensor: int
    rules: tuple[tuple[str, Any], ...]  # (logical axis, mesh axis | tuple of mesh axes | None)

    def problems(self) -> list[str]:
        sizes = (self.data, self.fsdp, self.tensor)
        if sizes.count(-1) <= 1 and all(size >= 1 or size == -1 for size in sizes):
            return []
        return [f"mesh sizes must be >= 1 with at most one -1; got data, fsdp, tensor = {sizes}."]


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
                bool(self.lengths) and all(isinstance(n, int) and n >= 2 for n in self.lengths),
                "a non-empty list of integer lengths >= 2",
            ),
        ]

    def problems(self) -> list[str]:
        problems = super().problems()
        sequences, batch = self.num_sequences, self.batch_size
        if sequences >= 1 and batch >= 1 and sequences % batch:
            problems.append(
                f"eval.batch_size {batch} must divide eval.num_sequences {sequences}; set them to "
                f"e.g. {batch} and {sequences + batch - sequences % batch}."
            )
        return problems


@dataclasses.dataclass(frozen=True)
class RuntimeConfig(ConfigSection):
    """Process runtime: the persistent compilation cache and a profiler trace."""

    compilation_cache_dir: str = ""  # JAX's compilation cache (a folder or gs://...); '' = off
    # jax.profiler trace of train steps [profile_from_step, profile_to_step) (step s
    # turns state s into s + 1) into <workdir>/tensorboard; to <= from: no trace.
    profile_from_step: int = 0
    profile_to_step: int = 0

    def problems(self) -> list[str]:
        if self.profile_from_step >= 0 and self.profile_to_step >= 0:
            return []
        return [
            "runtime.profile_from_step and runtime.profile_to_step must be >= 0, got "
            f"{self.profile_from_step}, {self.profile_to_step}."
        ]

    @property
    def profiles(self) -> bool:
        return self.profile_to_step > self.profile_from_step


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training or evaluation run reads."""

    seed: int
    num_steps: int
    batch_size: int
    model: ModelConfig
    pe: PEConfig
    data: Any  # the data source's frozen config dataclass (its `source` field names it)
    opt: OptimConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig
    log: LogConfig
    eval: EvalConfig
    runtime: RuntimeConfig

    @functools.cached_property
    def encoding(self) -> Encoding:
        """The model's Encoding, built once, for the longest window it trains or evaluates on."""
        return make_encoding(
            self.pe,
            num_heads=self.model.num_heads,
            head_dim=self.model.head_dim,
            max_length=max(self.pe.train_context, *self.eval.lengths),
        )

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> TrainConfig:
        """Convert a ConfigDict (or nested dict); ConfigError listing every problem."""
        cfg, problems = convert_config(config)
        if problems:
            raise ConfigError(problems)
        return cfg

    def to_json_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready nested dict that `from_config_dict` accepts back."""
        plain = {key: getattr(self, key) for key in SCALAR_KEYS}
        # The name's suffixes override the base settings idempotently: these parse back alike.
        plain["pe"] = {key: getattr(self.pe, key) for key in PE_KEYS}
        for name in ("model", "data", *SECTIONS):
            plain[name] = dataclasses.asdict(getattr(self, name))
        for key in DERIVED_DATA_KEYS:  # set again from the model's keys when read back
            plain["data"].pop(key, None)
        return plain


SECTIONS = {
    "opt": OptimConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "eval": EvalConfig,
    "runtime": RuntimeConfig,
}
SCALAR_KEYS = ("seed", "num_steps", "batch_size")
# The pe section: the name and the base settings of pe_config_from_name.
PE_KEYS = tuple(inspect.signature(pe_config_from_name).parameters)
TOP_KEYS = (*SCALAR_KEYS, "pe", "data", "model", *SECTIONS)


def convert_config(config: Mapping[str, Any]) -> tuple[TrainConfig | None, list[str]]:
    """(the run config, []) or (None, every problem of every section, a line each naming its key
    and the fix). `config`: a ConfigDict, or the nested dict that `to_json_dict` writes."""
    raw, unresolved = _resolved(config)
    problems = [
        f"{key} cannot be computed ({error}); it is derived from other keys (see the config "
        "file): fix those."
        for key, error in unresolved.items()
    ]
    problems += _key_problems("", raw, TOP_KEYS, TOP_KEYS, dict.fromkeys(SCALAR_KEYS, int))
    if any(key not in raw or not isinstance(raw[key], dict) for key in TOP_KEYS[3:]):
        return None, problems  # a section to build is missing
    sections = {"model": ModelConfig, **SECTIONS, "pe": _pe_config}
    try:
        sections["data"] = source_spec(raw["data"].get("source")).load()[0]
    except ValueError as err:
        problems.append(str(err))
    built = {key: raw.get(key) for key in SCALAR_KEYS}
    # A section holding a key that could not be computed is not built: its line says why.
    for name in sections:  # data last: it takes keys of the model and pe sections
        if name == "data" and not _derive_data_keys(raw["data"], sections["data"], built, problems):
            continue  # the model or pe section it derives from failed: their lines say why
        if not any(key.startswith(f"{name}.") for key in unresolved):
            built[name] = _build(sections[name], raw[name], name, problems)
    integers = {key: value for key, value in built.items() if type(value) is int}
    problems += [
        f"{key} must be an integer >= 1, got {integers[key]}."
        for key in ("num_steps", "batch_size")
        if integers.get(key, 1) < 1
    ]
    if not 0 <= integers.get("seed", 0) < 2**32:  # numpy takes no other seed
        problems.append(f"seed must be an integer in 0 .. 2**32 - 1, got {built['seed']}.")
    if problems:
        return None, problems
    cfg = TrainConfig(**built)  # every section built
    refused, warned = keys_without_effect(cfg.data)
    for warning in warned:
        _warn_once(warning)
    problems = _cross_section_problems(cfg) + refused
    return (None, problems) if problems else (cfg, [])


# Data keys that are the model's: set where the data section is built, never in a config.
DERIVED_DATA_KEYS = {
    "seq_len": "pe.train_context",  # the training length L
    "head_dim": "model.d_model // model.num_heads",  # whose rotary frequencies a kernel uses
    "theta": "pe.theta",  # the rotary base of those frequencies
}


def _derive_data_keys(data: dict, section: Callable, built: dict, problems: list[str]) -> bool:
    """Sets data[key] for each DERIVED_DATA_KEYS key the data `section` takes, from the built pe
    and model sections (False if one was not built); a problem per such key the config sets."""
    problems += [
        f"data.{key}: set from {source} where the data section is built; drop it from the config."
        for key, source in DERIVED_DATA_KEYS.items()
        if key in data
    ]
    pe, model = built.get("pe"), built.get("model")
    derived = {"seq_len": pe and pe.train_context, "theta": pe and pe.theta}
    derived["head_dim"] = model and model.head_dim
    takes = [key for key in DERIVED_DATA_KEYS if key in inspect.signature(section).parameters]
    if any(derived[key] is None for key in takes):
        return False
    data.update({key: derived[key] for key in takes if key not in data})
    return True


def _resolved(config: Any, prefix: str = "") -> tuple[Any, dict[str, str]]:
    """(`config` as nested dicts, its FieldReferences resolved; {dotted key: error} of the keys
    whose value failed to compute, left out). `config`: a ConfigDict or a nested mapping."""
    if not hasattr(config, "keys"):
        return config, {}
    plain, unresolved = {}, {}
    for key in config.keys():
        try:
            value = config[key]
        except Exception as err:  # any error of the config's own expression
            unresolved[prefix + key] = f"{type(err).__name__}: {err}"
            continue
        plain[key], inner = _resolved(value, f"{prefix}{key}.")
        unresolved.update(inner)
    return plain, unresolved


def _build(section: Callable, values: Any, where: str, problems: list[str]):
    """`section(**values)`; None with a problem appended per bad key or value, every one."""
    parameters = inspect.signature(section).parameters
    required = [key for key, param in parameters.items() if param.default is param.empty]
    types = typing.get_type_hints(section)
    misfits = _key_problems(f"{where}.", values, parameters, required, types)
    problems += misfits
    if not isinstance(values, dict) or any(" no such key" not in line for line in misfits):
        return None
    values = {key: value for key, value in values.items() if key in parameters}
    try:
        return section(**{key: _as_tuples(value) for key, value in values.items()})
    except (ValueError, TypeError) as err:
        lines = str(err).splitlines()
        problems += [line if line.startswith(where) else f"{where}: {line}" for line in lines]
        return None


def _as_tuples(value: Any) -> Any:
    """JSON's lists as the tuples the sections hold, recursively."""
    return tuple(map(_as_tuples, value)) if isinstance(value, (list, tuple)) else value


@functools.wraps(pe_config_from_name)  # its keys, defaults and types are the pe section's
def _pe_config(**settings) -> PEConfig:
    """pe_config_from_name, its errors worded for the pe section."""
    try:
        return pe_config_from_name(**settings)
    except UnknownEncodingName as err:
        raise ValueError(
            f"pe.name = {settings['name']!r} is not a known encoding ({first_line(err)}); "
            f"use e.g. {', '.join(PAPER_METHODS[:7])} (all forms: jrope.ACCEPTED_NAMES)."
        ) from None
    except ValueError as err:
        raise ValueError(f"pe settings: {first_line(err)}; fix that pe.* value.") from None


# What a value of each annotated type may be (a bool is not a number here), and its name.
_ACCEPTED = {int: int, float: (int, float), str: str, bool: bool}
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


def _key_problems(prefix: str, values: Any, known, required, types) -> list[str]:
    """A problem per unknown key (with the closest known one), missing key, or value of another
    type than its annotation (a list stands for a tuple, as JSON writes it)."""
    if not isinstance(values, dict):
        return [f"{prefix.rstrip('.') or 'the config'} must be a ConfigDict, got {values!r}."]
    problems = []
    for key in (key for key in values if key not in known):
        close = difflib.get_close_matches(prefix + key, [prefix + k for k in known], n=1)
        where = f"section {prefix.rstrip('.')!r}" if prefix else "the config"
        hint = f"did you mean --config.{close[0]}?" if close else f"{where} has {', '.join(known)}."
        problems.append(f"{prefix}{key}: no such key; {hint}")
    problems += [
        f"{prefix}{key} is missing; set it in the config file."
        for key in required
        if key not in values
    ]
    for key, value in values.items():
        hint = types.get(key)
        if hint in _ACCEPTED:
            fits = isinstance(value, _ACCEPTED[hint]) and (hint is bool or type(value) is not bool)
        else:
            fits = typing.get_origin(hint) is not tuple or isinstance(value, (tuple, list))
        if not fits:
            problems.append(
                f"{prefix}{key} must be {_TYPE_NAMES.get(hint, 'a tuple')}, got {value!r}."
            )
    return problems


def keys_without_effect(data: Any) -> tuple[list[str], list[str]]:
    """(refused, warned): a line per data key set away from its default that the chosen source,
    kernel or label mode never reads (the data config's KEYS_READ_ONLY_BY), with the fix."""
    refused, warned = [], []
    rules = getattr(data, "KEYS_READ_ONLY_BY", {})
    defaults = {field.name: field.default for field in dataclasses.fields(data)} if rules else {}
    for (chooser, readers, refuse), keys in rules.items():
        choice = getattr(data, chooser)
        for key in keys:
            value = getattr(data, key)
            if choice in readers or value == defaults[key]:
                continue
            only = " and ".join(repr(reader) for reader in readers)
            line = (
                f"data.{key} = {value!r} has no effect with data.{chooser} = {choice!r} (only "
                f"{only} read{'s' if len(readers) == 1 else ''} it)"
            )
            if refuse:
                fix = f"drop --config.data.{key}, or set --config.data.{chooser}={readers[0]}"
                refused.append(f"{line}; {fix}.")
            else:
                warned.append(f"{line}; the shared data section keeps it, unused.")
    return refused, warned


@functools.cache
def _warn_once(message: str) -> None:
    """Each warning once per process (every run of a comparison converts its config)."""
    logging.warning("%s", message)


def _cross_section_problems(cfg: TrainConfig) -> list[str]:
    """What two sections state must agree."""
    problems = []
    try:
        _ = cfg.encoding  # its blocks must divide the head dimension
    except ValueError as err:
        problems.append(
            f"model.d_model / model.num_heads (head dim {cfg.model.head_dim}): {first_line(err)}."
        )
    impl = cfg.model.attention_impl
    if getattr(cfg.data, "pack", False) and impl not in ("auto", *PACKING_KERNELS):
        problems.append(
            f"data.pack needs a kernel that takes segment ids, and model.attention_impl = "
            f"{impl!r} does not; set it to 'auto' or one of {PACKING_KERNELS}."
        )
    return problems


def first_line(err: Exception) -> str:
    """An error's first line without its full stop, for a problem that names the key."""
    return (str(err).strip().splitlines() or [type(err).__name__])[0].rstrip(".")


def load_config_file(path: str) -> config_dict.ConfigDict:
    """The ConfigDict of a config file (`configs/x.py` or `configs/x.py:ARG`), from any folder."""
    make_importable(path)
    return config_flags.ConfigFileFlagParser("config", lock_config=False).parse(path)
