"""Resuming from a workdir: which checkpoint, whether it fits the config, a restore that fails clearly.

Which checkpoint: the latest finished one. Orbax writes a checkpoint into
`<step>.orbax-checkpoint-tmp-<n>` and renames it to `<step>` only once
every item is written, so a save interrupted by a kill leaves a temporary
directory that is never listed as a step (it is reported, not deleted).

Whether it fits: each checkpoint keeps the config of the run that wrote it.
Settings that define the parameters or the optimizer state (the model's
shape, the encoding, the task's vocabulary, whether gradients are clipped)
must be the same, or the restore stops with the keys that differ. Other
changes (more steps, another learning rate, another mesh: orbax reshards on
restore) are allowed and logged.

Clear failures: any error while reading a checkpoint (a truncated or
missing file) becomes a CorruptCheckpointError naming the checkpoint and
what to do. Nothing in the workdir is ever deleted here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from jrope.train.checkpointing import Checkpointer
from jrope.train.config import TrainConfig

# Name part of the temporary directory of a save in progress (orbax's atomic rename).
UNFINISHED_SAVE_MARKER = ".orbax-checkpoint-tmp"

# Dotted config keys that define the shapes or meaning of the saved parameters.
PARAMETER_KEYS = (
    "data.source",  # also the task: the tied readout or a regression head
    "data.input_channels",  # regression: the input projection's and the head's shapes
    "model.d_model",
    "model.num_heads",
    "model.num_layers",
    "model.mlp_ratio",
)
# Every key under these sections defines the encoding's parameters and what they mean.
PARAMETER_SECTIONS = ("pe",)
# Data-section fields that set the vocabulary (the embedding's shape).
VOCABULARY_KEYS = ("data.vocab_size", "data.num_keys", "data.num_values")


class IncompatibleCheckpointError(ValueError):
    """The checkpoint was written by a run whose parameters differ from this config's."""


class CorruptCheckpointError(RuntimeError):
    """The checkpoint cannot be read (truncated, missing or damaged files)."""


def checkpoint_path(checkpointer: Checkpointer, step: int) -> epath.Path:
    """The directory of checkpoint `step` (CheckpointManager's default step names: the number)."""
    return checkpointer.directory / str(step)


def describe_latest(checkpointer: Checkpointer) -> str:
    """The latest checkpoint's step and path, for messages."""
    latest = checkpointer.latest_step()
    if latest is None:
        return f"none yet in {checkpointer.directory}"
    return f"step {latest} at {checkpoint_path(checkpointer, latest)}"


def finished_steps(directory: str) -> list[int]:
    """Steps of the finished checkpoints in a checkpoint directory (local or a bucket), ascending."""
    return sorted(ocp.path.step.checkpoint_steps(directory))


def unfinished_saves(directory: str) -> list[str]:
    """Names of the temporary directories of interrupted saves in a checkpoint directory."""
    path = epath.Path(directory)
    if not path.exists():
        return []
    return sorted(child.name for child in path.iterdir() if UNFINISHED_SAVE_MARKER in child.name)


def restore_or_initialize(
    cfg: TrainConfig, checkpointer: Checkpointer, abstract_state: Any, initialize: Callable[[], Any]
) -> Any:
    """The state of the latest finished checkpoint, or `initialize()` when there is none."""
    leftovers = unfinished_saves(checkpointer.directory)
    if leftovers:
        logging.warning(
            "Ignoring unfinished checkpoint writes %s in %s (left by a run stopped mid-save; "
            "never restored, safe to delete).",
            leftovers,
            checkpointer.directory,
        )
    step = checkpointer.latest_step()
    if step is None:
        return initialize()
    logging.info("Resuming from checkpoint %s.", checkpoint_path(checkpointer, step))
    return restore_compatible(cfg, checkpointer, abstract_state, step)


def restore_compatible(
    cfg: TrainConfig, checkpointer: Checkpointer, abstract_state: Any, step: int
) -> Any:
    """Checkpoint `step` restored into `abstract_state`, after checking its saved config against `cfg`.

    Raises:
      IncompatibleCheckpointError: the saved config differs in a parameter-defining key.
      CorruptCheckpointError: the config or the state cannot be read.
    """
    path = checkpoint_path(checkpointer, step)
    if step not in finished_steps(checkpointer.directory):
        raise FileNotFoundError(
            f"No finished checkpoint {path}; the finished ones are steps {finished_steps(checkpointer.directory)}."
        )
    try:
        saved_config = checkpointer.restore_config(step)
    except Exception as err:  # orbax and tensorstore raise many types; all mean "unreadable"
        raise CorruptCheckpointError(
            _unreadable_message(checkpointer, step, "its saved config", err)
        ) from err
    incompatible, changed = config_differences(saved_config, cfg.to_json_dict())
    if incompatible:
        raise IncompatibleCheckpointError(
            f"Checkpoint {path} was written by a run with other parameters: {'; '.join(incompatible)}. "
            "Resume with the checkpoint's settings, or start a new run with another --workdir "
            "(nothing was deleted)."
        )
    if changed:
        logging.warning("Resuming %s with changed settings: %s.", path, "; ".join(changed))
    try:
        return checkpointer.restore(abstract_state, step)
    except Exception as err:
        raise CorruptCheckpointError(
            _unreadable_message(checkpointer, step, "its state", err)
        ) from err


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """Differences between two JSON config dicts as "key: saved value there, current value now" lines.

    Returns (incompatible, changed): differences in parameter-defining keys,
    and all the others.
    """
    saved_flat = _flatten(json.loads(json.dumps(saved)))
    current_flat = _flatten(json.loads(json.dumps(current)))  # tuples -> lists, as saved
    parameter_keys = set(PARAMETER_KEYS) | set(VOCABULARY_KEYS)
    incompatible, changed = [], []
    for key in sorted(set(saved_flat) | set(current_flat)):
        before, now = saved_flat.get(key, "absent"), current_flat.get(key, "absent")
        if before == now:
            continue
        line = f"{key} is {before!r} there, {now!r} now"
        if key in parameter_keys or key.split(".")[0] in PARAMETER_SECTIONS:
            incompatible.append(line)
        elif key == "opt.clip_norm" and (before == 0) != (now == 0):
            # Clipping adds a transformation to the optimizer chain: another state structure.
            incompatible.append(f"{line} (clipping on/off changes the optimizer state)")
        else:
            changed.append(line)
    return incompatible, changed


def _unreadable_message(checkpointer: Checkpointer, step: int, what: str, err: Exception) -> str:
    path = checkpoint_path(checkpointer, step)
    cause = (str(err).strip().splitlines() or [""])[0][:300]
    earlier = [finished for finished in finished_steps(checkpointer.directory) if finished < step]
    fallback = (
        f"move {path} out of {checkpointer.directory} to resume from step {earlier[-1]}"
        if earlier
        else "start a new run with another --workdir"
    )
    return (
        f"Cannot read {what} from checkpoint {path} ({type(err).__name__}: {cause}). "
        f"The file may be truncated or damaged; nothing was deleted. To go on, {fallback}."
    )


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"section.key": value}."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{dotted}."))
        else:
            flat[dotted] = value
    return flat
