"""Checkpoints: the save, its digests, the restore that resumes a run, the workdir lock.

Each step of `<workdir>/checkpoints` holds `state`, `config` (JSON) and `digests`. Orbax saves
are atomic: a killed save leaves a `<step>.orbax-checkpoint-tmp-<n>` directory, never restored,
which orbax deletes at the next start. Process 0 holds a `flock` on `<workdir>/run.lock`, which
the kernel releases however the process ends.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax.traverse_util import flatten_dict

from jrope import saved_run_config
from jrope.data.files import is_uri, resolved
from jrope.errors import CheckpointError, UsageError, WorkdirBusy
from jrope.fields import PARAMETERS, RESULT
from jrope.saved_run_config import damaged
from jrope.train.config import convert_config, declared_effect
from jrope.train.outputs import say

STATE_ITEM = "state"
CONFIG_ITEM = "config"
DIGESTS_ITEM = saved_run_config.DIGESTS_ITEM


class Checkpointer:
    """Saves every `every_steps` steps (or forced) into `directory`, keeping the latest
    `max_to_keep`, with `config_json` (the run's config) and the digests beside each state."""

    def __init__(
        self,
        directory: str,
        *,
        every_steps: int,
        max_to_keep: int,
        config_json: dict[str, Any],
        accept_missing_digests: bool = False,
    ):
        self.directory = resolved(directory)  # a gs:// URI reaches orbax unchanged
        self.config_json = config_json
        self.accept_missing_digests = accept_missing_digests
        self._every_steps = every_steps
        # Every save is forced (should_save decides); a killed save's folder goes at the next start.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, cleanup_tmp_directories=True
        )
        items = (STATE_ITEM, CONFIG_ITEM, DIGESTS_ITEM)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=items)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        """Whether `step` is due (every `every_steps`); the loop asks for preemption apart."""
        return step % self._every_steps == 0

    def reached_preemption(self, step: int) -> bool:
        """Whether a multi-process run's processes agreed to stop at `step` (a SIGTERM caught)."""
        return self._manager.reached_preemption(step)

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Save `state` as checkpoint `step` when due (or `force`); returns whether it saved.
        Returns once the arrays are off the device: the caller may donate `state`."""
        if not (force or self.should_save(step)):
            return False  # before the digests are computed
        items = {
            STATE_ITEM: ocp.args.StandardSave(state),
            CONFIG_ITEM: ocp.args.JsonSave(self.config_json),
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
        # orbax restores the latest step for None, and names a missing one (FileNotFoundError).
        return self._manager.restore(step, args=ocp.args.Composite(**{item: args}))[item]

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
    return sorted(n for n in saved.keys() | restored.keys() if saved.get(n) != restored.get(n))


# What a resume may change besides checkpoint.accept_changes: it leaves the trained model alone
# (the mesh only lays it out).
RESUME_FREE = {"eval", "log", "checkpoint", "runtime", "mesh", "opt.max_consecutive_skips"}


def checkpoint_path(checkpointer: Checkpointer, step: int) -> epath.Path:
    """The directory of checkpoint `step` (CheckpointManager's default step names: the number)."""
    return checkpointer.directory / str(step)


def finished_steps(directory: str) -> list[int]:
    """Steps of the finished checkpoints in `directory` (local or a bucket), ascending."""
    return sorted(ocp.path.step.checkpoint_steps(directory))


def describe_last_good(checkpointer: Checkpointer, before: int | None = None) -> str:
    """The latest finished checkpoint (saved before step `before`, where given), for messages."""
    checkpointer.wait_until_finished()  # the last save is listed (or not) for good
    steps = [s for s in finished_steps(checkpointer.directory) if before is None or s < before]
    return str(checkpoint_path(checkpointer, steps[-1])) if steps else "the start"


def restore_compatible(checkpointer: Checkpointer, abstract, step: int, *, purpose="resume"):
    """Checkpoint `step` restored into `abstract` (its sharded target) once its config fits the
    checkpointer's for `purpose` ('resume' or 'evaluate'); else CheckpointError."""
    path = checkpoint_path(checkpointer, step)
    if step not in finished_steps(checkpointer.directory):
        raise CheckpointError(f"No finished checkpoint {path}.")
    saved = saved_run_config.read_saved_config(path)
    # A key added since the checkpoint was written takes its default, as the config converts.
    saved_cfg, _ = convert_config(saved)
    saved = saved if saved_cfg is None else saved_cfg.to_json_dict()
    check_changes(path, saved, checkpointer.config_json, purpose)
    if not is_uri(str(path)):  # what the user may not read is no damage
        walked = [os.path.join(top, n) for top, dirs, files in os.walk(path) for n in dirs + files]
        if denied := [p for p in walked if not os.access(p, os.R_OK | os.X_OK * os.path.isdir(p))]:
            raise CheckpointError(f"{denied[0]}: permission denied; chmod -R u+rX {path}.")
    checked = (path / DIGESTS_ITEM).exists()
    if not (checked or checkpointer.accept_missing_digests):
        raise damaged(path, "has no digests (accept_missing_digests=True takes it)")
    try:
        state = checkpointer.restore(abstract, step)
        digests = checkpointer.restore_json(DIGESTS_ITEM, step) if checked else {}
        differing = mismatches(digests, state_digests(state)) if checked else []
    except Exception as error:  # orbax and tensorstore raise many kinds: all mean "unreadable"
        raise damaged(path, f"cannot be read ({_cause(error)})") from error
    if differing:
        raise damaged(path, f"digest mismatch in {', '.join(differing[:3])}")
    if not checked:
        say(f"Restoring {path} unchecked (no digests).")
    return state


def check_changes(path: epath.Path, saved: Mapping, current: Mapping, purpose: str) -> None:
    """CheckpointError where `current` changes what checkpoint `path`'s config `saved` may not
    change for `purpose` (config_differences); a resume names the changes it takes."""
    refused, changed = config_differences(saved, current, purpose=purpose)
    if refused:
        fix = "drop those overrides"
        if purpose == "resume":
            fix = "name them in checkpoint.accept_changes, or use another --workdir"
        raise CheckpointError(f"{path} holds other settings: {'; '.join(refused)}; {fix}.")
    if changed and purpose == "resume":
        say(f"Resuming {path} with changed settings: {'; '.join(changed)}.")


def config_differences(saved: Mapping, current: Mapping, *, purpose="evaluate") -> tuple:
    """(refused, accepted) differences of two JSON configs, as "key is <saved> there, <current> now".
    Refused: a key defining the result (jrope.fields) unless in checkpoint.accept_changes, or the
    parameters, toggled clipping; for 'resume' also keys outside RESUME_FREE and accept_changes
    (num_steps only under a schedule)."""
    saved_flat = flatten_dict(json.loads(json.dumps(saved)), sep=".")
    current_flat = flatten_dict(json.loads(json.dumps(current)), sep=".")  # tuples -> lists
    accepted = {
        key.strip() for key in str(current_flat.get("checkpoint.accept_changes") or "").split(",")
    }
    free = RESUME_FREE | accepted
    if current_flat.get("opt.schedule") == "constant":  # the same rates whatever the run's length
        free.add("num_steps")
    incompatible, changed = [], []
    for key in sorted(set(saved_flat) | set(current_flat)):
        before, now = saved_flat.get(key, "absent"), current_flat.get(key, "absent")
        if before == now:
            continue
        line = f"{key} is {before!r} there, {now!r} now"
        names = {key, key.split(".")[0]}
        defines = declared_effect(key, saved_flat.get("data.source"))
        if defines == PARAMETERS or (defines == RESULT and not names & accepted):
            incompatible.append(line)
        elif (key == "opt.clip_norm" and (before == 0) != (now == 0)) or (
            key == "opt.nonfinite" and purpose == "resume"
        ):  # clipping on or off, or skipping, changes the optimizer chain and so its state
            incompatible.append(f"{line} (another optimizer state)")
        elif purpose == "evaluate" or names & free:
            changed.append(line)
        elif key == "num_steps":
            incompatible.append(f"{line} (the schedule spans num_steps)")
        else:
            incompatible.append(line)
    return incompatible, changed


def _cause(error: BaseException) -> str:
    """The first line of the innermost error, which names the array where tensorstore's does."""
    while error.__cause__ is not None:
        error = error.__cause__
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"


LOCK_FILE = "run.lock"


class WorkdirLock:
    """Holds `<workdir>/run.lock` for a 'training' (refused while anything holds it) or an
    'evaluation' (waits for another evaluation, refused during training); a no-op when not
    `enabled` or on an object store. The file names its holder in one line of text."""

    def __init__(self, workdir: str, *, enabled: bool = True, role: str = "training"):
        self.path = os.path.join(workdir, LOCK_FILE)
        self.role = role
        self._enabled = enabled and not is_uri(workdir)
        self._file = None
        self.previous_holder: str | None = None  # the line of a holder that ended without release
        if enabled and is_uri(workdir):
            logging.warning("No lock on object store %s: run one at a time.", workdir)

    def __enter__(self) -> WorkdirLock:
        if not self._enabled:
            return self
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            handle = open(self.path, "a+b")  # noqa: SIM115 (held until __exit__)
        except OSError as error:  # a setting to fix, not a storage failure
            raise UsageError(f"--workdir {error.filename}: {error.strerror or error}; choose a "
                             "writable --workdir.") from None  # fmt: skip
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(handle)
            if self.role != "evaluation" or not holder.startswith("evaluation"):
                handle.close()
                raise WorkdirBusy(
                    f"{self.path} is held ({holder}): wait, or use another --workdir."
                ) from None
            say(f"Waiting for {self.path} ({holder}) ...")
            fcntl.flock(handle, fcntl.LOCK_EX)
        self.previous_holder = _holder(handle) or None
        if self.previous_holder:
            say(f"Taking over {self.path} ({self.previous_holder}, ended).")
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        holder = f"{self.role} by process {os.getpid()} on {socket.gethostname()} since {started}\n"
        _rewrite(handle, holder)
        self._file = handle
        return self

    def __exit__(self, *exc_info) -> None:
        if self._file is not None:
            _rewrite(self._file, "")  # an empty file: released cleanly
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()


def _holder(handle) -> str:
    """The lock file's line: who holds it, or held it last ('' when released cleanly)."""
    handle.seek(0)
    return handle.read(500).decode("utf-8", "replace").strip()


def _rewrite(handle, text: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(text.encode())
    handle.flush()
