"""The run config: typed, frozen views of an experiment's ConfigDict.

`configs/*.py` build an `ml_collections.ConfigDict`; nothing below the entry
points reads it. `TrainConfig.from_config_dict` converts it once into the
frozen dataclasses below, rejecting unknown and missing keys (a typo in a
command-line override must not be silently ignored) and reporting every
section's problems together. The `data` section is converted by the config
dataclass of the source it names (`data.source`, jrope.data.source.SOURCES).

The encoding's name is parsed once per run config (`TrainConfig.pe_config`)
and its Encoding built once (`TrainConfig.encoding`); everything downstream
takes those.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any, Mapping

from jrope.data.source import source_spec
from jrope.encodings import Encoding, make_encoding
from jrope.model.config import ModelConfig
from jrope.pe_config import PEConfig, pe_config_from_name

LR_SCHEDULES = ("constant", "cosine")
NONFINITE_POLICIES = (
    "stop",
    "skip",
)  # what a NaN/Inf loss or gradient norm does (jrope.train.nonfinite)


class ConfigError(ValueError):
    """Every problem found in a run's config, one per line, each naming its key and the fix."""

    def __init__(self, problems: Sequence[str]):
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(
            f"{len(self.problems)} problem(s) in the run's config, found before compiling:\n{lines}"
        )


@dataclasses.dataclass(frozen=True)
class PESettings:
    """The positional encoding: a paper name plus the base settings its suffixes override."""

    name: str
    train_context: int
    theta: float
    gamma_min: float
    init_gamma: float
    eta_max: float
    init_eta: float

    def to_pe_config(self) -> PEConfig:
        """The library's frozen PEConfig (ValueError on an unknown name or a bad setting)."""
        return pe_config_from_name(
            self.name,
            train_context=self.train_context,
            theta=self.theta,
            gamma_min=self.gamma_min,
            init_gamma=self.init_gamma,
            eta_max=self.eta_max,
            init_eta=self.init_eta,
        )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float
    weight_decay: float
    b1: float
    b2: float
    eps: float
    clip_norm: float  # global gradient norm clip; 0 disables
    schedule: str  # one of LR_SCHEDULES
    warmup_steps: int  # linear warm-up from 0 (0 = none)
    final_lr_ratio: float  # cosine: final lr = learning_rate * final_lr_ratio
    nonfinite: str = "stop"  # one of NONFINITE_POLICIES: stop the run, or skip the update

    def __post_init__(self):
        _check_choice("opt.schedule", self.schedule, LR_SCHEDULES)
        _check_choice("opt.nonfinite", self.nonfinite, NONFINITE_POLICIES)
        if self.learning_rate <= 0 or self.warmup_steps < 0 or self.clip_norm < 0:
            raise ValueError(
                "opt.learning_rate must be > 0, opt.warmup_steps >= 0 and opt.clip_norm >= 0; "
                f"got {self.learning_rate}, {self.warmup_steps}, {self.clip_norm}."
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes (one may be -1: all remaining devices) and logical-to-mesh rules."""

    data: int
    fsdp: int
    tensor: int
    rules: tuple[tuple[str, Any], ...]  # (logical axis, mesh axis | tuple of mesh axes | None)

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor)
        if sizes.count(-1) > 1 or any(size < 1 and size != -1 for size in sizes):
            raise ValueError(
                f"mesh sizes must be >= 1 with at most one -1; got data, fsdp, tensor = {sizes}."
            )
        object.__setattr__(
            self, "rules", tuple((str(name), _as_mesh_axes(axes)) for name, axes in self.rules)
        )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int  # periodic save interval (the final step is always saved)
    max_to_keep: int

    def __post_init__(self):
        if self.every_steps < 1 or self.max_to_keep < 1:
            raise ValueError("checkpoint.every_steps and checkpoint.max_to_keep must be >= 1.")


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every_steps: int  # progress line, JSONL and TensorBoard interval
    tensorboard: bool

    def __post_init__(self):
        if self.every_steps < 1:
            raise ValueError("log.every_steps must be >= 1.")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    lengths: tuple[int, ...]
    num_sequences: int  # per length
    batch_size: int  # global evaluation batch (small: long lengths must fit in memory)
    every_steps: int  # evaluation during training (0 = only after the last step)

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(int(length) for length in self.lengths))
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(
                f"eval.lengths must be a non-empty list of lengths >= 2, got {self.lengths}."
            )
        if self.batch_size < 1 or self.num_sequences % self.batch_size:
            raise ValueError(
                f"eval.batch_size {self.batch_size} must be >= 1 and divide eval.num_sequences {self.num_sequences}."
            )


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Process runtime: the persistent compilation cache and a profiler trace."""

    # JAX's persistent compilation cache (a local folder or gs://...); '' = off.
    compilation_cache_dir: str = ""
    # jax.profiler trace of train steps [profile_from_step, profile_to_step) (step s
    # turns state s into s + 1) into <workdir>/tensorboard; to <= from: no trace.
    profile_from_step: int = 0
    profile_to_step: int = 0

    def __post_init__(self):
        if self.profile_from_step < 0 or self.profile_to_step < 0:
            raise ValueError(
                "runtime.profile_from_step and runtime.profile_to_step must be >= 0, got "
                f"{self.profile_from_step}, {self.profile_to_step}."
            )

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
    pe: PESettings
    data: Any  # the data source's frozen config dataclass (its `source` field names it)
    opt: OptimConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig
    log: LogConfig
    eval: EvalConfig
    runtime: RuntimeConfig = RuntimeConfig()

    @functools.cached_property
    def pe_config(self) -> PEConfig:
        """The encoding's PEConfig, parsed once (ValueError on a bad name or setting)."""
        return self.pe.to_pe_config()

    @functools.cached_property
    def encoding(self) -> Encoding:
        """The model's Encoding, built once (ValueError when its blocks do not divide the head)."""
        return make_encoding(
            self.pe_config, num_heads=self.model.num_heads, head_dim=self.model.head_dim
        )

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> "TrainConfig":
        """Convert a ConfigDict (or nested dict); ConfigError listing every unknown, missing or bad key."""
        raw = _to_plain(config)
        scalar_keys = {"seed", "num_steps", "batch_size"}
        sections = {
            "model": ModelConfig,
            "pe": PESettings,
            "opt": OptimConfig,
            "mesh": MeshConfig,
            "checkpoint": CheckpointConfig,
            "log": LogConfig,
            "eval": EvalConfig,
            "runtime": RuntimeConfig,
        }
        problems = []
        try:
            # A config written before the runtime section existed runs with its defaults.
            _check_keys("config", raw, scalar_keys | set(sections) | {"data"}, {"runtime"})
            raw.setdefault("runtime", {})
        except ValueError as err:
            raise ConfigError([str(err)]) from None
        try:
            data = raw["data"]
            sections["data"] = source_spec(
                data.get("source") if isinstance(data, Mapping) else None
            ).load()[0]
        except ValueError as err:
            problems.append(str(err))
        # Every section is converted, and all their errors are reported together.
        converted = {}
        for name, section_cls in sections.items():
            try:
                converted[name] = _build(section_cls, raw[name], name)
            except ValueError as err:
                # Each line names its section (a message that does not already start with it gets it).
                problems += [
                    line if line.startswith(name) else f"{name}: {line}"
                    for line in str(err).splitlines()
                ]
        if problems:
            raise ConfigError(problems)
        cfg = cls(
            seed=int(raw["seed"]),
            num_steps=int(raw["num_steps"]),
            batch_size=int(raw["batch_size"]),
            **converted,
        )
        cfg.check_consistency()
        return cfg

    def to_json_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready nested dict that `from_config_dict` accepts back."""
        plain = {"seed": self.seed, "num_steps": self.num_steps, "batch_size": self.batch_size}
        for name in ("model", "pe", "data", "opt", "mesh", "checkpoint", "log", "eval", "runtime"):
            plain[name] = dataclasses.asdict(getattr(self, name))
        return plain

    def check_consistency(self) -> None:
        """Cross-section checks: settings that two sections state must agree."""
        if self.num_steps < 1 or self.batch_size < 1:
            raise ConfigError(
                [f"num_steps and batch_size must be >= 1, got {self.num_steps}, {self.batch_size}."]
            )
        shared = {
            "seq_len": self.pe.train_context,
            "head_dim": self.model.head_dim,
            "theta": self.pe.theta,
        }
        for field, expected in shared.items():
            if hasattr(self.data, field) and getattr(self.data, field) != expected:
                raise ConfigError(
                    [
                        f"data.{field} = {getattr(self.data, field)} disagrees with the model/pe "
                        f"value {expected}; set both from one place (see configs/)."
                    ]
                )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} = {value!r} is not one of {choices}.")


def _check_keys(
    where: str, given: Mapping[str, Any], expected: set[str], optional: set[str] = frozenset()
) -> None:
    unknown = set(given) - expected
    missing = expected - set(given) - set(optional)
    if unknown or missing:
        raise ValueError(
            f"{where}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; "
            f"accepted keys are {sorted(expected)}."
        )


def _build(config_class: type, values: Any, where: str):
    """Instantiate a dataclass from a dict, rejecting unknown keys (defaults may be omitted)."""
    if not isinstance(values, Mapping):
        raise ValueError(f"config section {where!r} must be a dict, got {type(values).__name__}.")
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    with_defaults = {
        name
        for name, f in fields.items()
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    _check_keys(where, values, set(fields), optional=with_defaults)
    kwargs = {
        name: tuple(value) if isinstance(value, list) else value for name, value in values.items()
    }
    return config_class(**kwargs)


def _as_mesh_axes(axes: Any):
    if axes is None or isinstance(axes, str):
        return axes
    return tuple(axes)


def _to_plain(config: Any) -> Any:
    """A ConfigDict (or FrozenConfigDict) as nested plain dicts, lists as tuples left alone."""
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if isinstance(config, Mapping):
        return {key: _to_plain(value) for key, value in config.items()}
    return config
