"""The sections of the run config: a frozen dataclass per ConfigDict section, with its own checks.

Each section checks its keys when built and raises ValueError with one line
per problem, each naming its `section.key` and, where one is plain, the fix
(jrope.train.config collects them from every section at once). The model's
section is jrope.model.config.ModelConfig, the data's the config dataclass
of its source (jrope.data.source.SOURCES).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jrope.pe_config import PEConfig, pe_config_from_name

LR_SCHEDULES = ("constant", "cosine")
# What a NaN/Inf loss or gradient norm does (jrope.train.nonfinite).
NONFINITE_POLICIES = ("stop", "skip")


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
        _raise_if(
            [
                _choice_problem("opt.schedule", self.schedule, LR_SCHEDULES),
                _choice_problem("opt.nonfinite", self.nonfinite, NONFINITE_POLICIES),
            ]
            + _bound_problems(
                "opt",
                ("learning_rate", self.learning_rate, "> 0"),
                ("warmup_steps", self.warmup_steps, ">= 0"),
                ("clip_norm", self.clip_norm, ">= 0"),
                ("max_consecutive_skips", self.max_consecutive_skips, ">= 1"),
            )
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
        _raise_if(
            _bound_problems(
                "checkpoint",
                ("every_steps", self.every_steps, ">= 1"),
                ("max_to_keep", self.max_to_keep, ">= 1"),
            )
        )


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every_steps: int  # progress line, JSONL and TensorBoard interval
    tensorboard: bool

    def __post_init__(self):
        _raise_if(_bound_problems("log", ("every_steps", self.every_steps, ">= 1")))


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
            isinstance(length, int) and meets_bound(length, ">= 2") for length in lengths
        ):
            problems.append(
                "eval.lengths must be a non-empty list of integer lengths >= 2, got "
                f"{self.lengths!r}; e.g. --config.eval.lengths='(256,512)'."
            )
        object.__setattr__(self, "lengths", lengths)
        sizes = _bound_problems(
            "eval",
            ("num_sequences", self.num_sequences, ">= 1"),
            ("batch_size", self.batch_size, ">= 1"),
            ("every_steps", self.every_steps, ">= 0"),
        )
        problems += sizes
        if not sizes and self.num_sequences % self.batch_size:
            problems.append(
                f"eval.batch_size {self.batch_size} must divide eval.num_sequences "
                f"{self.num_sequences}; set them to e.g. {self.batch_size} and "
                f"{self.num_sequences + self.batch_size - self.num_sequences % self.batch_size}."
            )
        _raise_if(problems)


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


def _choice_problem(name: str, value: str, choices: tuple[str, ...]) -> str | None:
    return None if value in choices else f"{name} = {value!r} is not one of {choices}."


def meets_bound(value: Any, bound: str) -> bool:
    """Whether `value` is an int or float (not a bool) meeting `bound` ('>= 1', '> 0', ...)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    operator, limit = bound.split()
    return value > float(limit) if operator == ">" else value >= float(limit)


def _bound_problems(section: str, *checks: tuple[str, Any, str]) -> list[str]:
    """'<section>.<key> must be <bound>, got <value>.' for each (key, value, bound) not met."""
    return [
        f"{section}.{key} must be {bound}, got {value!r}."
        for key, value, bound in checks
        if not meets_bound(value, bound)
    ]


def _raise_if(problems) -> None:
    """ValueError with one line per problem (None entries ignored), if there is any."""
    lines = [problem for problem in problems if problem]
    if lines:
        raise ValueError("\n".join(lines))


def _as_mesh_axes(axes: Any):
    if axes is None or isinstance(axes, str):
        return axes
    return tuple(axes)
