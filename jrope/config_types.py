"""Typed, frozen views of an experiment's ConfigDict.

`configs/*.py` build an `ml_collections.ConfigDict`; the library never reads
it directly. `TrainConfig.from_config_dict` converts it once, at the entry
point, into the frozen dataclasses below, rejecting unknown and missing keys
(a typo in a command-line override must not be silently ignored). The data
section is converted by the data source's own config dataclass, looked up in
`DATA_SOURCES` by the config's `experiment`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping

COMPUTE_DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("auto", "xla", "einsum", "blockwise")
REMAT_POLICIES = ("none", "full", "dots_saveable")
READOUTS = ("all", "last")
LR_SCHEDULES = ("constant", "cosine")
NONFINITE_POLICIES = ("stop", "skip")  # what a NaN/Inf loss or gradient norm does (jrope.nonfinite)


@dataclasses.dataclass(frozen=True)
class DataSourceSpec:
    """Where an experiment's data source lives and which config section feeds it."""

    section: str  # name of the ConfigDict section holding the source's settings
    module: str  # module defining the source
    config_class: str  # its frozen config dataclass
    # the source, built as Source(cfg, global_batch_size, process_index, process_count)
    source_class: str

    def load(self) -> tuple[type, type]:
        module = importlib.import_module(self.module)
        return getattr(module, self.config_class), getattr(module, self.source_class)


DATA_SOURCES = {
    "synthetic": DataSourceSpec(
        "task", "jrope.data.synthetic", "SyntheticTaskConfig", "SyntheticSource"
    ),
    "text_bytes": DataSourceSpec(
        "data", "jrope.data.text_bytes", "TextDataConfig", "ByteTextSource"
    ),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only Transformer shape and numerics (vocabulary comes from the data source)."""

    d_model: int
    num_heads: int
    num_layers: int
    mlp_ratio: int
    compute_dtype: str  # activations and matmuls; parameters are always float32
    attention_impl: str  # one of ATTENTION_IMPLS
    blockwise_min_length: int  # 'auto' switches to blockwise attention at this length and above
    block_size: int  # query/key block length of blockwise attention
    remat: str  # one of REMAT_POLICIES, applied per Transformer block
    # 'last': the final block computes queries, MLP and logits at the last
    # position only (for tasks whose loss weights are zero elsewhere).
    readout: str = "all"
    # Residual dropout on each block's attention and MLP outputs (0: none, the paper's setting).
    dropout_rate: float = 0.0

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model {self.d_model} must be a multiple of num_heads {self.num_heads}; change one of them."
            )
        _check_choice("model.compute_dtype", self.compute_dtype, COMPUTE_DTYPES)
        _check_choice("model.attention_impl", self.attention_impl, ATTENTION_IMPLS)
        _check_choice("model.remat", self.remat, REMAT_POLICIES)
        _check_choice("model.readout", self.readout, READOUTS)
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"model.dropout_rate must be in [0, 1), got {self.dropout_rate}.")
        for name in (
            "d_model",
            "num_heads",
            "num_layers",
            "mlp_ratio",
            "blockwise_min_length",
            "block_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


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

    def to_pe_config(self):
        """The core library's frozen PEConfig (ValueError on an unknown name)."""
        import jrope

        return jrope.pe_config_from_name(
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
class TrainConfig:
    """Everything a training or evaluation run reads."""

    experiment: str
    seed: int
    num_steps: int
    batch_size: int
    model: ModelConfig
    pe: PESettings
    data: Any  # the data source's frozen config dataclass
    opt: OptimConfig
    mesh: MeshConfig
    checkpoint: CheckpointConfig
    log: LogConfig
    eval: EvalConfig

    @property
    def data_source_spec(self) -> DataSourceSpec:
        return DATA_SOURCES[self.experiment]

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> "TrainConfig":
        """Convert a ConfigDict (or nested dict); ValueError on unknown, missing or bad keys."""
        raw = _to_plain(config)
        experiment = raw.get("experiment")
        if experiment not in DATA_SOURCES:
            raise ValueError(
                f"experiment {experiment!r} is not a training experiment; choose one of {sorted(DATA_SOURCES)}."
            )
        spec = DATA_SOURCES[experiment]
        scalar_keys = {"experiment", "seed", "num_steps", "batch_size"}
        sections = {
            "model": ModelConfig,
            "pe": PESettings,
            "opt": OptimConfig,
            "mesh": MeshConfig,
            "checkpoint": CheckpointConfig,
            "log": LogConfig,
            "eval": EvalConfig,
        }
        _check_keys("config", raw, scalar_keys | set(sections) | {spec.section})
        data_config_class, _ = spec.load()
        # Every section is converted, and all their errors are reported together.
        converted, errors = {}, []
        for name, section_cls in {**sections, spec.section: data_config_class}.items():
            try:
                converted[name] = _build(section_cls, raw[name], name)
            except ValueError as err:
                # Each line names its section (a message that does not already start with it gets it).
                errors.append(str(err) if str(err).startswith(name) else f"{name}: {err}")
        if errors:
            raise ValueError("\n".join(errors))
        cfg = cls(
            experiment=experiment,
            seed=int(raw["seed"]),
            num_steps=int(raw["num_steps"]),
            batch_size=int(raw["batch_size"]),
            data=converted.pop(spec.section),
            **converted,
        )
        cfg.check_consistency()
        return cfg

    def to_json_dict(self) -> dict[str, Any]:
        """The config as a JSON-ready nested dict that `from_config_dict` accepts back."""
        plain = {
            "experiment": self.experiment,
            "seed": self.seed,
            "num_steps": self.num_steps,
            "batch_size": self.batch_size,
            self.data_source_spec.section: dataclasses.asdict(self.data),
        }
        for name in ("model", "pe", "opt", "mesh", "checkpoint", "log", "eval"):
            plain[name] = dataclasses.asdict(getattr(self, name))
        return plain

    def check_consistency(self) -> None:
        """Cross-section checks: settings that two sections state must agree."""
        if self.num_steps < 1 or self.batch_size < 1:
            raise ValueError(
                f"num_steps and batch_size must be >= 1, got {self.num_steps}, {self.batch_size}."
            )
        shared = {
            "seq_len": self.pe.train_context,
            "head_dim": self.model.head_dim,
            "theta": self.pe.theta,
        }
        for field, expected in shared.items():
            if hasattr(self.data, field) and getattr(self.data, field) != expected:
                raise ValueError(
                    f"{self.data_source_spec.section}.{field} = {getattr(self.data, field)} disagrees with the "
                    f"model/pe value {expected}; set both from one place (see configs/)."
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
