"""Checkpoints: the save, its digests, the restore that resumes a run, the workdir lock.

Each step of `<workdir>/checkpoints` holds `state`, `config` (JSON) and `digests`. Orbax saves are atomic: a killed save leaves a
`<step>.orbax-checkpoint-tmp-<n>` directory, never restored, which orbax deletes at the next start. Process 0 holds a `flock` on
`<workdir>/run.lock`, which the kernel releases however the process ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax.traverse_util import flatten_dict

from jrope import commands, errors, saved_run_config
from jrope.data.files import is_uri, resolved
from jrope.train.config import TrainConfig, convert_config
from jrope.train.outputs import say

STATE_ITEM = "state"
CONFIG_ITEM = "config"
DIGESTS_ITEM = "digests"


class Checkpointer:
    """Saves every `every_steps` steps (or forced) into `directory`, one subdirectory per step,
    keeping the latest `max_to_keep`, with `config_json` (the run's config) beside each state."""

    def __init__(
        self, directory: str, *, every_steps: int, max_to_keep: int, config_json: dict[str, Any]
    ):
        self.directory = resolved(directory)  # a gs:// URI reaches orbax unchanged
        self._config_json = config_json
        self._every_steps = every_steps
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                create=True,
                cleanup_tmp_directories=True,  # every save is forced: should_save decides
            ),
            item_names=(STATE_ITEM, CONFIG_ITEM, DIGESTS_ITEM),
        )

    @classmethod
    def for_run(cls, cfg: TrainConfig, workdir: str) -> Checkpointer:
        """The checkpoints of the run in `workdir` (`<workdir>/checkpoints`), as `cfg` sets them."""
        return cls(
            epath.Path(workdir) / "checkpoints",
            every_steps=cfg.checkpoint.every_steps,
            max_to_keep=cfg.checkpoint.max_to_keep,
            config_json=cfg.to_json_dict(),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether `step` is due (every `every_steps`); the loop asks for preemption apart."""
        return step % self._every_steps == 0

    def reached_preemption(self, step: int) -> bool:
        """Whether the processes of a multi-process run agreed to stop at `step` (JAX's
        coordination service caught a SIGTERM); False in a single process."""
        return self._manager.reached_preemption(step)

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Save `state` as checkpoint `step` when due (or `force`); returns whether it saved.
        Returns once the arrays are off the device: the caller may donate `state`."""
        if not (force or self.should_save(step)):
            return False  # before the digests are computed
        items = {
            STATE_ITEM: ocp.args.StandardSave(state),
            CONFIG_ITEM: ocp.args.JsonSave(self._config_json),
            DIGESTS_ITEM: ocp.args.JsonSave(state_digests(state)),
        }
        return self._manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, abstract_state: Any, step: int | None = None) -> Any:
        """Checkpoint `step` (default: latest) read straight into `abstract_state`'s shardings."""
        return self._restore(STATE_ITEM, ocp.args.StandardRestore(abstract_state), step)

    def restore_json(self, item: str, step: int | None = None) -> Any:
        """JSON item `item` (CONFIG_ITEM, DIGESTS_ITEM) of checkpoint `step`."""
        return self._restore(item, ocp.args.JsonRestore(), step)

    def _restore(self, item: str, args: Any, step: int | None) -> Any:
        step = self.latest_step() if step is None else step
        if step is None or step not in self._manager.all_steps():
            raise errors.NoCheckpointError(
                f"No checkpoint {'' if step is None else step} in {self.directory}; train first "
                f"({commands.command('train')} --config=... --workdir=...) or point --workdir at "
                "a trained run."
            )
        return self._manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]

    def damaged_arrays(self, state: Any, step: int) -> list[str]:
        """Arrays of `state` (restored from checkpoint `step`) whose digest is not the saved one."""
        return mismatches(self.restore_json(DIGESTS_ITEM, step), state_digests(state))

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
    """uint32 [2] per array: sum_i x_i and sum_i (2 i + 1) x_i mod 2^32 of its bits as uint32 words.

    A flipped bit changes the first by +-2^k (never 0 mod 2^32); the odd weights keep that true for
    the second and make it see moved words; integer sums do not depend on the sharding. A check
    against damage, not a cryptographic hash."""
    sums = []
    for leaf in leaves:
        flat = leaf.reshape(-1)
        if flat.dtype == jnp.bool_:
            flat = flat.astype(jnp.uint8)
        # The bits as uint32 words, 16- and 8-bit elements widened.
        unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[flat.dtype.itemsize]
        words = jax.lax.bitcast_convert_type(flat, unsigned).astype(jnp.uint32)
        weighted = words * (2 * jnp.arange(words.shape[0], dtype=jnp.uint32) + 1)
        sums.append(jnp.stack([words.sum(dtype=jnp.uint32), weighted.sum(dtype=jnp.uint32)]))
    return sums


def state_digests(state: Any) -> dict[str, list[int]]:
    """'params/blocks/0/attn/qkv/value' -> [sum, weighted sum] of each array (waits for `state`)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    sums = jax.device_get(_fingerprints([leaf for _, leaf in flat]))
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): [int(v) for v in np.asarray(pair)]
        for (path, _), pair in zip(flat, sums, strict=True)
    }


def mismatches(saved: dict[str, list[int]], restored: dict[str, list[int]]) -> list[str]:
    """Names of the arrays whose restored digest differs from the saved one (or is missing)."""
    return sorted(
        name for name in saved.keys() | restored.keys() if saved.get(name) != restored.get(name)
    )


# Tensorstore's read error names the array as orbax stores it: 'params.blocks.0.attn.qkv.value'.
_FAILED_READ = re.compile(r'Error reading "([^"/]+)/')

# Keys and sections that define the shapes or meaning of the saved parameters.
PARAMETER_KEYS = {
    *("data.source", "data.input_channels", "data.vocab_size", "data.num_keys", "data.num_values"),
    *("model.d_model", "model.num_heads", "model.num_layers", "model.mlp_ratio", "pe"),
}
# What a resume may change: it leaves the trained model alone (the mesh only lays it out).
RESUME_FREE = {"eval", "log", "checkpoint", "runtime", "mesh", "opt.max_consecutive_skips"}
# Keys an evaluation refuses beyond the parameter-defining ones: they label its rows.
EVALUATION_LABEL_KEYS = {"seed", "data.seed"}


def checkpoint_path(checkpointer: Checkpointer, step: int) -> epath.Path:
    """The directory of checkpoint `step` (CheckpointManager's default step names: the number)."""
    return checkpointer.directory / str(step)


def finished_steps(directory: str) -> list[int]:
    """Steps of the finished checkpoints in `directory` (local or a bucket), ascending."""
    return sorted(ocp.path.step.checkpoint_steps(directory))


def describe_latest(checkpointer: Checkpointer) -> str:
    """The latest checkpoint's step and path, for messages."""
    latest = checkpointer.latest_step()
    if latest is None:
        return f"none yet in {checkpointer.directory}"
    return f"step {latest} at {checkpoint_path(checkpointer, latest)}"


def describe_last_good(checkpointer: Checkpointer, before: int | None = None) -> str:
    """The latest finished checkpoint (saved before step `before`, where given), for messages."""
    checkpointer.wait_until_finished()  # the last save is listed (or not) for good
    steps = [s for s in finished_steps(checkpointer.directory) if before is None or s < before]
    if not steps:
        return f"none in {checkpointer.directory}"
    return f"step {steps[-1]} at {checkpoint_path(checkpointer, steps[-1])}"


def restore_or_initialize(
    cfg: TrainConfig, checkpointer: Checkpointer, abstract: Any, initialize: Callable[[], Any]
) -> Any:
    """The state of the latest finished checkpoint, or `initialize()` when there is none."""
    step = checkpointer.latest_step()
    if step is None:
        return initialize()
    say(f"Resuming from checkpoint {checkpoint_path(checkpointer, step)}.")
    return restore_compatible(cfg, checkpointer, abstract, step)


def restore_compatible(
    cfg: TrainConfig, checkpointer: Checkpointer, abstract: Any, step: int, *, purpose="resume"
) -> Any:
    """Checkpoint `step` restored into `abstract` (its sharded target), once its config fits `cfg`
    for `purpose` ('resume' or 'evaluate'); NoCheckpointError, IncompatibleCheckpointError, or
    CorruptCheckpointError (unreadable, damaged, or without digests unless accepted)."""
    path = checkpoint_path(checkpointer, step)

    def corrupt(problem: str, then: str = "") -> errors.CorruptCheckpointError:
        fallback = _fallback(checkpointer, step)
        return errors.CorruptCheckpointError(f"{problem} {fallback}{then}")

    finished = finished_steps(checkpointer.directory)
    if step not in finished:
        raise errors.NoCheckpointError(
            f"No finished checkpoint {path}; the finished ones are steps {finished}."
        )
    try:
        saved_config = checkpointer.restore_json(CONFIG_ITEM, step)
    except Exception as err:  # orbax and tensorstore raise many types; all mean "unreadable"
        raise corrupt(_unreadable(path, "its saved config", err)) from err
    # A key added since the checkpoint was written takes its default, as the config converts.
    saved_cfg, _ = convert_config(saved_run_config.without_retired_keys(saved_config))
    saved_config = saved_config if saved_cfg is None else saved_cfg.to_json_dict()
    incompatible, changed = config_differences(saved_config, cfg.to_json_dict(), purpose=purpose)
    if incompatible:
        raise errors.IncompatibleCheckpointError(_incompatible_message(path, incompatible, purpose))
    if changed and purpose == "resume":
        say(f"Resuming {path} with changed settings: {'; '.join(changed)}.")
    checked = (path / DIGESTS_ITEM).exists()
    if not (checked or cfg.checkpoint.accept_missing_digests):
        raise corrupt(
            f"Checkpoint {path} has no digests ({path / DIGESTS_ITEM} is missing), so damage to "
            "its arrays could not be seen: it is refused like a damaged one. Nothing was deleted.",
            " To restore it unchecked anyway, add --config.checkpoint.accept_missing_digests=True.",
        )
    if not checked:
        say(f"Restoring {path} unchecked (no digests): a NaN later may come from damage.")
    try:
        state = checkpointer.restore(abstract, step)
        damaged = checkpointer.damaged_arrays(state, step) if checked else []
    except Exception as err:
        raise corrupt(_unreadable(path, "its state", err)) from err
    if damaged:
        more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
        raise corrupt(
            f"Checkpoint {path} is damaged: the contents of {', '.join(damaged[:3])}{more} differ "
            "from the digests saved with it. Nothing was deleted."
        )
    return state


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, purpose: str = "evaluate"
) -> tuple[list[str], list[str]]:
    """(refused, accepted) differences of two JSON configs, as "key is <saved> there, <current> now".

    'evaluate' refuses PARAMETER_KEYS and the seeds; 'resume' every key outside RESUME_FREE and
    checkpoint.accept_changes, and num_steps under a schedule. Both refuse toggling clipping.
    """
    saved_flat = flatten_dict(json.loads(json.dumps(saved)), sep=".")
    current_flat = flatten_dict(json.loads(json.dumps(current)), sep=".")  # tuples -> lists
    accepted = str(current_flat.get("checkpoint.accept_changes") or "").split(",")
    free = RESUME_FREE | {key.strip() for key in accepted if key.strip()}
    constant_rate = current_flat.get("opt.schedule") == "constant"  # whatever the run's length
    incompatible, changed = [], []
    for key in sorted(set(saved_flat) | set(current_flat)):
        before, now = saved_flat.get(key, "absent"), current_flat.get(key, "absent")
        if before == now:
            continue
        line = f"{key} is {before!r} there, {now!r} now"
        names = {key, key.split(".")[0]}
        if names & PARAMETER_KEYS or (purpose == "evaluate" and key in EVALUATION_LABEL_KEYS):
            incompatible.append(line)
        elif key == "opt.clip_norm" and (before == 0) != (now == 0):
            # Clipping adds a transformation to the optimizer chain: another state structure.
            incompatible.append(f"{line} (clipping on/off changes the optimizer state)")
        elif key == "opt.nonfinite" and purpose == "resume":
            incompatible.append(f"{line} (skipping wraps the optimizer state)")
        elif purpose == "evaluate" or names & free or (key == "num_steps" and constant_rate):
            changed.append(line)
        elif key == "num_steps":
            incompatible.append(f"{line} (the learning-rate schedule spans num_steps)")
        else:
            incompatible.append(line)
    return incompatible, changed


def _incompatible_message(path: epath.Path, incompatible: list[str], purpose: str) -> str:
    differences = "; ".join(incompatible)
    if purpose == "evaluate":
        return (
            f"Checkpoint {path} was written by a run with other settings of its model, data or "
            f"seed: {differences}. Evaluate it with the checkpoint's settings (drop these "
            "overrides, or the --config that sets them); nothing was deleted."
        )
    return (
        f"Checkpoint {path} was written with other settings than this run's, and they change what "
        f"the trained model and its results mean: {differences}. Resume with the checkpoint's "
        "settings (only eval, log, checkpoint, runtime and mesh may change) or use another "
        "--workdir; nothing was deleted. To change a setting anyway (e.g. a lower learning rate "
        "after a divergence), name it: --config.checkpoint.accept_changes=opt.learning_rate."
    )


def _unreadable(path: epath.Path, what: str, err: Exception) -> str:
    """Checkpoint `path`'s `what` could not be read: the error, naming the array where it can."""
    root = err
    while root.__cause__ is not None:  # orbax wraps tensorstore's error, which names the array
        root = root.__cause__
    cause = (str(root).strip().splitlines() or [""])[0][:300]
    array = _FAILED_READ.search(str(root))
    where = f"array {array.group(1).replace('.', '/')}: " if array else ""
    return (
        f"Cannot read {what} from checkpoint {path} ({where}{type(root).__name__}: {cause}). "
        "The file may be truncated or damaged; nothing was deleted."
    )


def _fallback(checkpointer: Checkpointer, step: int) -> str:
    """The latest earlier checkpoint with its digests (named, not restored: a resume from it checks
    them), and how to resume from it."""
    finished = finished_steps(checkpointer.directory)
    earlier = [
        candidate
        for candidate in finished
        if candidate < step and (checkpoint_path(checkpointer, candidate) / DIGESTS_ITEM).exists()
    ]
    if not earlier:
        return "No earlier checkpoint has digests: start a new run with another --workdir."
    # Every checkpoint after the named one up to `step` goes aside, or the resume would take it.
    later = [checkpoint_path(checkpointer, s) for s in finished if earlier[-1] < s <= step]
    aside = checkpointer.directory.parent / "damaged_checkpoints"
    return (
        f"The latest earlier checkpoint is {checkpoint_path(checkpointer, earlier[-1])} (its "
        f"digests are checked when it restores): to resume from step {earlier[-1]}, move "
        f"{' and '.join(map(str, later))} out of {checkpointer.directory} (mkdir -p {aside} && "
        f"mv {' '.join(map(str, later))} {aside}/) and run the same command again."
    )


LOCK_FILE = "run.lock"


class WorkdirLock:
    """Holds `<workdir>/run.lock` as a 'training' (refused while anything holds it) or an
    'evaluation' (waits for another evaluation, refused during training); a no-op when not
    `enabled` or on an object store. previous_holder: a holder that ended without releasing it."""

    def __init__(self, workdir: str, *, enabled: bool = True, role: str = "training"):
        self.path = os.path.join(workdir, LOCK_FILE)
        self.role = role
        self._enabled = enabled and not is_uri(workdir)
        self._file = None
        self.previous_holder: dict | None = None
        if enabled and is_uri(workdir):
            logging.warning(f"{workdir} is on an object store (no locks): one run at a time.")

    def __enter__(self) -> WorkdirLock:
        if not self._enabled:
            return self
        workdir = os.path.dirname(self.path)
        try:
            os.makedirs(workdir, exist_ok=True)
            cannot_create = None
        except OSError as error:
            cannot_create = error.strerror or str(error)
        if cannot_create:  # raised outside the except: a setting to fix, not a storage failure
            raise errors.UsageError(
                f"--workdir {workdir} cannot be created ({cannot_create}); choose a --workdir in "
                "a folder you can write to."
            )
        if os.path.isdir(self.path):
            raise errors.UsageError(
                f"--workdir {workdir}: {self.path} is a directory, where the run keeps its lock "
                f"file. Remove it (rmdir {self.path}, if it is empty) or choose another --workdir."
            )
        handle = open(self.path, "a+b")  # noqa: SIM115 (held until __exit__)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(handle)
            if self.role != "evaluation" or (holder or {}).get("role") != "evaluation":
                handle.close()
                roles = {"training": "training run", "evaluation": "evaluation"}
                raise errors.WorkdirBusy(
                    f"Another {roles.get((holder or {}).get('role'), 'run')} is using {workdir}: "
                    f"{describe_holder(holder)} holds {self.path}. Wait for it to end (or stop "
                    "it), or choose another --workdir."
                ) from None
            say(
                f"Waiting for the evaluation by {describe_holder(holder)} on {workdir} to end "
                "(one evaluation at a time writes a workdir's results) ..."
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        self.previous_holder = _read_holder(handle)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
        _rewrite(handle, json.dumps({**me, "role": self.role}) + "\n")
        self._file = handle
        return self

    def __exit__(self, *exc_info) -> None:
        if self._file is not None:
            _rewrite(self._file, "")  # an empty file: released cleanly
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def _rewrite(handle, text: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(text.encode())
    handle.flush()


# What _read_holder gives for a lock whose content is not a holder's record (damaged, edited).
UNREADABLE_HOLDER = "unreadable"


def _read_holder(handle) -> dict | None:
    """The holder's record in the lock file; None when empty (released cleanly), or
    {UNREADABLE_HOLDER: its size in bytes} when it is no record: the flock, not the content,
    decides whether a live process holds the lock, so such a lock is taken over like a stale one."""
    handle.seek(0)
    content = handle.read().strip()
    if not content:
        return None
    try:
        holder = json.loads(content.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        holder = None
    return holder if isinstance(holder, dict) else {UNREADABLE_HOLDER: len(content)}


def describe_holder(holder: dict | None) -> str:
    """'process 1234 on host-a (started 2026-12-01 10:00:00)'."""
    if holder is None:
        return "a process that wrote no details"
    if UNREADABLE_HOLDER in holder:
        return (
            f"a process whose record in {LOCK_FILE} cannot be read ({holder[UNREADABLE_HOLDER]} "
            "bytes that are not a record of this program)"
        )
    pid, host, started = (holder.get(key, "?") for key in ("pid", "host", "started"))
    return f"process {pid} on {host} (started {started})"
