"""The run config: typed, frozen views of an experiment's ConfigDict.

`configs/*.py` build an `ml_collections.ConfigDict`; nothing below the entry
points reads it. `TrainConfig.from_config_dict` converts it once into the
frozen dataclasses below, rejecting unknown and missing keys (a typo in a
command-line override must not be silently ignored) and reporting every
section's problems together. The `data` section is converted by the config
dataclass of the source it names (`data.source`, jrope.data.source.SOURCES).

`convert_config` is the same conversion without raising: it returns the
problems and a TrainConfig whose failed sections are None, so that the run
checks (jrope.train.validation) can still check every section that converted
and report all problems in one message, not in rounds of fixes.

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
        # A problem of several lines (the data's directions) keeps them indented under its dash.
        lines = "\n".join("  - " + problem.replace("\n", "\n    ") for problem in self.problems)
        super().__init__(
            f"{len(self.problems)} problem(s) in the run's config, found before compiling:\n{lines}"
        )


class DataError(ConfigError):
    """Every problem found before compiling, all of them with the run's data (absent, too short)."""


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
    # 'skip' gives up after this many skipped steps in a row (the run is diverging).
    max_consecutive_skips: int = 10

    def __post_init__(self):
        problems = [
            _choice_problem("opt.schedule", self.schedule, LR_SCHEDULES),
            _choice_problem("opt.nonfinite", self.nonfinite, NONFINITE_POLICIES),
        ]
        for key, value, low in (
            ("learning_rate", self.learning_rate, "> 0"),
            ("warmup_steps", self.warmup_steps, ">= 0"),
            ("clip_norm", self.clip_norm, ">= 0"),
            ("max_consecutive_skips", self.max_consecutive_skips, ">= 1"),
        ):
            if not _satisfies(value, low):
                problems.append(f"opt.{key} must be {low}, got {value!r}.")
        _raise_if(problems)


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
        _raise_if(
            f"checkpoint.{key} must be >= 1, got {value!r}."
            for key, value in (("every_steps", self.every_steps), ("max_to_keep", self.max_to_keep))
            if not _satisfies(value, ">= 1")
        )


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every_steps: int  # progress line, JSONL and TensorBoard interval
    tensorboard: bool

    def __post_init__(self):
        if not _satisfies(self.every_steps, ">= 1"):
            raise ValueError(f"log.every_steps must be >= 1, got {self.every_steps!r}.")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    lengths: tuple[int, ...]
    num_sequences: int  # per length
    batch_size: int  # global evaluation batch (small: long lengths must fit in memory)
    every_steps: int  # evaluation during training (0 = only after the last step)

    def __post_init__(self):
        problems = []
        lengths = tuple(self.lengths) if isinstance(self.lengths, (tuple, list)) else ()
        if not lengths or not all(
            isinstance(length, int) and _satisfies(length, ">= 2") for length in lengths
        ):
            problems.append(
                f"eval.lengths must be a non-empty list of integer lengths >= 2, got {self.lengths!r}; "
                "e.g. --config.eval.lengths='(256,512)'."
            )
        object.__setattr__(self, "lengths", lengths)
        for key, value in (
            ("num_sequences", self.num_sequences),
            ("every_steps", self.every_steps),
        ):
            low = ">= 1" if key == "num_sequences" else ">= 0"
            if not _satisfies(value, low):
                problems.append(f"eval.{key} must be {low}, got {value!r}.")
        if not _satisfies(self.batch_size, ">= 1"):
            problems.append(f"eval.batch_size must be >= 1, got {self.batch_size!r}.")
        elif _satisfies(self.num_sequences, ">= 1") and self.num_sequences % self.batch_size:
            problems.append(
                f"eval.batch_size {self.batch_size} must divide eval.num_sequences "
                f"{self.num_sequences}; set them to e.g. {self.batch_size} and "
                f"{self.num_sequences + self.batch_size - self.num_sequences % self.batch_size}."
            )
        _raise_if(problems)


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
        cfg, problems = convert_config(config)
        if problems:
            raise ConfigError(problems)
        return cfg

    def to_json_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready nested dict that `from_config_dict` accepts back."""
        plain = {"seed": self.seed, "num_steps": self.num_steps, "batch_size": self.batch_size}
        for name in ("model", "pe", "data", "opt", "mesh", "checkpoint", "log", "eval"):
            plain[name] = dataclasses.asdict(getattr(self, name))
        return plain

    def consistency_problems(self) -> list[str]:
        """Cross-section checks: settings that two sections state must agree (None sections skipped)."""
        problems = [
            f"{key} must be an integer >= 1, got {getattr(self, key)!r}."
            for key in ("num_steps", "batch_size")
            if getattr(self, key) is not None and not _satisfies(getattr(self, key), ">= 1")
        ]
        if self.data is None or self.pe is None or self.model is None:
            return problems
        shared = {
            "seq_len": self.pe.train_context,
            "head_dim": self.model.head_dim,
            "theta": self.pe.theta,
        }
        for field, expected in shared.items():
            if hasattr(self.data, field) and getattr(self.data, field) != expected:
                problems.append(
                    f"data.{field} = {getattr(self.data, field)} disagrees with the model/pe "
                    f"value {expected}; set both from one place (see configs/)."
                )
        return problems


SECTIONS = {
    "model": ModelConfig,
    "pe": PESettings,
    "opt": OptimConfig,
    "mesh": MeshConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "eval": EvalConfig,
}
SCALAR_KEYS = ("seed", "num_steps", "batch_size")


def convert_config(config: Mapping[str, Any]) -> tuple[TrainConfig | None, list[str]]:
    """(the run config, every problem); a section that fails to convert is None in it.

    Use the TrainConfig only when the problems are empty, or to check what
    did convert (jrope.train.validation). None when the top-level keys are wrong.
    """
    problems = []
    raw = _to_plain(config, "", problems)
    try:
        _check_keys("config", raw, set(SCALAR_KEYS) | set(SECTIONS) | {"data"})
    except ValueError as err:
        return None, problems + [str(err)]
    classes = dict(SECTIONS)
    try:
        data = raw["data"]
        classes["data"] = source_spec(
            data.get("source") if isinstance(data, Mapping) else None
        ).load()[0]
    except ValueError as err:
        problems.append(str(err))
    converted = {name: None for name in ("data", *SECTIONS)}
    for name, section_cls in classes.items():
        if raw[name] is _UNRESOLVED or _UNRESOLVED in _values(raw[name]):
            continue  # its unresolvable key is already a problem
        try:
            converted[name] = _build(section_cls, raw[name], name)
        except (ValueError, TypeError) as err:
            # Each line names its section (a message that does not already start with it gets it).
            problems += [
                line if line.startswith(name) else f"{name}: {line}"
                for line in str(err).splitlines()
            ]
    scalars = {key: None if raw[key] is _UNRESOLVED else raw[key] for key in SCALAR_KEYS}
    cfg = TrainConfig(**scalars, **converted)
    return cfg, problems + cfg.consistency_problems()


def flatten_dict(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"section.key": value}."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_dict(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat


def _choice_problem(name: str, value: str, choices: tuple[str, ...]) -> str | None:
    return None if value in choices else f"{name} = {value!r} is not one of {choices}."


def _satisfies(value: Any, bound: str) -> bool:
    """Whether `value` is an int or float (not a bool) meeting `bound` ('>= 1', '> 0', ...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    operator, limit = bound.split()
    return value > float(limit) if operator == ">" else value >= float(limit)


def _raise_if(problems) -> None:
    """ValueError with one line per problem (None entries ignored), if there is any."""
    lines = [problem for problem in problems if problem]
    if lines:
        raise ValueError("\n".join(lines))


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


# A key whose value could not be computed (a FieldReference expression that raised).
_UNRESOLVED = object()


def _to_plain(config: Any, prefix: str, problems: list[str]) -> Any:
    """A ConfigDict (or nested mapping) as nested plain dicts, key by key.

    A key derived from others (e.g. data.head_dim = d_model // num_heads)
    whose computation fails becomes _UNRESOLVED, and a problem naming it.
    """
    if not isinstance(config, Mapping) and not hasattr(config, "keys"):
        return config
    plain = {}
    for key in config.keys():
        try:
            value = config[key]
        except Exception as err:  # any error of the config's own expression
            problems.append(
                f"{prefix}{key} cannot be computed ({type(err).__name__}: {err}); it is derived "
                "from other keys (see the config file): fix those."
            )
            value = _UNRESOLVED
        plain[key] = _to_plain(value, f"{prefix}{key}.", problems)
    return plain


def _values(section: Any) -> list[Any]:
    return list(section.values()) if isinstance(section, Mapping) else []
