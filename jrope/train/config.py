"""The run config: typed, frozen views of an experiment's ConfigDict.

`configs/*.py` build an `ml_collections.ConfigDict`; nothing below the entry
points reads it. `TrainConfig.from_config_dict` converts it once into frozen
dataclasses, one per section (jrope.train.config_sections), rejecting unknown and missing keys (a typo in a
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
from collections.abc import Mapping
from typing import Any

from jrope.data.source import source_spec
from jrope.encodings import Encoding, make_encoding
from jrope.errors import ConfigError
from jrope.model.config import ModelConfig
from jrope.pe_config import PEConfig
from jrope.train.config_sections import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    MeshConfig,
    OptimConfig,
    PESettings,
    RuntimeConfig,
    meets_bound,
)


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
    def from_config_dict(cls, config: Mapping[str, Any]) -> TrainConfig:
        """Convert a ConfigDict (or nested dict); ConfigError listing every unknown, missing or bad key."""
        cfg, problems = convert_config(config)
        if problems:
            raise ConfigError(problems)
        return cfg

    def to_json_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready nested dict that `from_config_dict` accepts back."""
        plain = {"seed": self.seed, "num_steps": self.num_steps, "batch_size": self.batch_size}
        for name in ("model", "pe", "data", "opt", "mesh", "checkpoint", "log", "eval", "runtime"):
            plain[name] = dataclasses.asdict(getattr(self, name))
        return plain

    def consistency_problems(self) -> list[str]:
        """Cross-section checks: what two sections state must agree (None sections skipped)."""
        problems = [
            f"{key} must be an integer >= 1, got {getattr(self, key)!r}."
            for key in ("num_steps", "batch_size")
            if getattr(self, key) is not None and not meets_bound(getattr(self, key), ">= 1")
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
    "runtime": RuntimeConfig,
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
        # A config written before the runtime section existed runs with its defaults.
        _check_keys("config", raw, set(SCALAR_KEYS) | set(SECTIONS) | {"data"}, {"runtime"})
    except ValueError as err:
        return None, problems + [str(err)]
    raw.setdefault("runtime", {})
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
