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
what to do. So does damage that reads without error (a flipped bit, garbled
bytes): every restored array's digest must equal the one saved with it
(jrope.train.digests), or the message names the arrays that differ. Either
way it also names the latest earlier checkpoint that restores intact (each
is restored and checked to find it). Nothing in the workdir is ever deleted
here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from jrope.errors import CorruptCheckpointError, IncompatibleCheckpointError, NoCheckpointError
from jrope.train import digests
from jrope.train.checkpointing import Checkpointer
from jrope.train.config import TrainConfig, flatten_dict
from jrope.train.outputs import say

# Tensorstore's read error names the array as orbax stores it: 'params.blocks.0.attn.qkv.value'.
_FAILED_READ = re.compile(r'Error reading "([^"/]+)/')

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
    say(f"Resuming from checkpoint {checkpoint_path(checkpointer, step)}.")
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
        raise NoCheckpointError(
            f"No finished checkpoint {path}; the finished ones are steps {finished_steps(checkpointer.directory)}."
        )
    try:
        saved_config = checkpointer.restore_config(step)
    except Exception as err:  # orbax and tensorstore raise many types; all mean "unreadable"
        raise CorruptCheckpointError(
            _unreadable_message(checkpointer, abstract_state, step, "its saved config", err)
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
        state, damaged = _restore_and_compare(checkpointer, abstract_state, step)
    except Exception as err:
        raise CorruptCheckpointError(
            _unreadable_message(checkpointer, abstract_state, step, "its state", err)
        ) from err
    if damaged:
        del state  # before earlier checkpoints are restored to find an intact one
        shown = ", ".join(damaged[:3]) + (
            f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
        )
        raise CorruptCheckpointError(
            f"Checkpoint {path} is damaged: the contents of {shown} differ from the digests saved "
            f"with it. Nothing was deleted. {_fallback(checkpointer, abstract_state, step)}"
        )
    return state


def _restore_and_compare(
    checkpointer: Checkpointer, abstract_state: Any, step: int
) -> tuple[Any, list[str]]:
    """(the state of checkpoint `step`, names of its arrays whose digest differs from the saved)."""
    state = checkpointer.restore(abstract_state, step)
    saved = checkpointer.restore_digests(step)
    if saved is None:
        logging.warning(
            "Checkpoint %s carries no digests (written by an earlier version): restored unchecked.",
            checkpoint_path(checkpointer, step),
        )
        return state, []
    return state, digests.mismatches(saved, digests.state_digests(state))


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """Differences between two JSON config dicts as "key: saved value there, current value now" lines.

    Returns (incompatible, changed): differences in parameter-defining keys,
    and all the others.
    """
    saved_flat = flatten_dict(json.loads(json.dumps(saved)))
    current_flat = flatten_dict(json.loads(json.dumps(current)))  # tuples -> lists, as saved
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


def _unreadable_message(
    checkpointer: Checkpointer, abstract_state: Any, step: int, what: str, err: Exception
) -> str:
    path = checkpoint_path(checkpointer, step)
    root = err
    while root.__cause__ is not None:  # orbax wraps tensorstore's error, which names the array
        root = root.__cause__
    cause = (str(root).strip().splitlines() or [""])[0][:300]
    array = _FAILED_READ.search(str(root))
    where = f"array {array.group(1).replace('.', '/')}: " if array else ""
    return (
        f"Cannot read {what} from checkpoint {path} ({where}{type(root).__name__}: {cause}). "
        f"The file may be truncated or damaged; nothing was deleted. "
        f"{_fallback(checkpointer, abstract_state, step)}"
    )


def _fallback(checkpointer: Checkpointer, abstract_state: Any, step: int) -> str:
    """Which earlier checkpoint restores intact, and how to resume from it."""
    path = checkpoint_path(checkpointer, step)
    for earlier in reversed([s for s in finished_steps(checkpointer.directory) if s < step]):
        try:
            _, damaged = _restore_and_compare(checkpointer, abstract_state, earlier)
        except Exception:  # unreadable too: try the one before
            continue
        if not damaged:
            return (
                f"Checkpoint {checkpoint_path(checkpointer, earlier)} is intact (restored and "
                f"checked): to resume from step {earlier}, move {path} out of "
                f"{checkpointer.directory} (e.g. mv {path} "
                f"{checkpointer.directory.parent / f'damaged_checkpoint_{step}'}) and run the same "
                "command again."
            )
    return "No earlier checkpoint is intact: start a new run with another --workdir."
