"""The config saved with a run's latest checkpoint, as an ml_collections config file: eval.py's
--config defaults to `<this file>:DIR`, so that --config.<key>=<value> applies to it as to any file.
Orbax writes it to `<step>/config/metadata`; it is read without orbax, so that no JAX backend starts
before a multi-process run's processes have found each other."""

from __future__ import annotations

import fcntl
import json
from typing import Any

from etils import epath
from ml_collections import config_dict

from jrope.data.files import resolved
from jrope.errors import CheckpointError, WorkdirBusy

DIGESTS_ITEM = "digests"  # beside each checkpoint's state (jrope.train.checkpoints)
# Keys that checkpoints of earlier versions hold and that no longer set anything: dropped on load.
RETIRED_KEYS = {"eval": ("max_hours",), "data": ("seq_len", "head_dim", "theta")}


def config_file(workdir: str) -> str:
    """The --config value of the config saved with `workdir`'s latest checkpoint."""
    saved_config_path(workdir)  # CheckpointError without one
    return f"{__file__}:{workdir}"


def get_config(workdir: str) -> config_dict.ConfigDict:
    """The config saved with the latest finished checkpoint in `workdir` (its lists as tuples)."""
    checkpoint = saved_config_path(workdir).parent.parent
    return config_dict.ConfigDict(with_tuples(read_saved_config(checkpoint)))


def read_saved_config(checkpoint: epath.Path) -> dict[str, Any]:
    """The config saved with `checkpoint` (a JSON dict, RETIRED_KEYS dropped)."""
    try:
        saved = json.loads((checkpoint / "config" / "metadata").read_bytes())
    except (OSError, ValueError) as error:  # ValueError: not UTF-8, or not JSON
        raise damaged(checkpoint, f"has a config that cannot be read ({error})") from None
    for section, keys in RETIRED_KEYS.items():
        if isinstance(saved.get(section), dict):
            saved[section] = {k: v for k, v in saved[section].items() if k not in keys}
    return saved


def damaged(checkpoint: epath.Path, problem: str) -> CheckpointError:
    """The refusal of `checkpoint` (`<workdir>/checkpoints/<step>`), naming the latest earlier one
    with digests (checked when it restores) and the `mv` that sets the later ones aside."""
    folder, step = checkpoint.parent, int(checkpoint.name)
    finished = sorted(int(entry.name) for entry in folder.iterdir() if entry.name.isdigit())
    earlier = [s for s in finished if s < step and (folder / str(s) / DIGESTS_ITEM).exists()]
    later = [folder / str(s) for s in finished if earlier and earlier[-1] < s <= step]
    aside = folder.parent / "damaged_checkpoints"
    resume = "start again in another --workdir"
    if earlier:
        moved = " ".join(map(str, later))
        resume = f"resume from step {earlier[-1]}: mkdir -p {aside} && mv {moved} {aside}/"
    return CheckpointError(f"Checkpoint {checkpoint} {problem}; {resume}.")


def saved_config_path(workdir: str) -> epath.Path:
    """The saved config of the latest finished checkpoint in `workdir` (finished: orbax renamed it
    to its step); CheckpointError without one."""
    folder = resolved(workdir) / "checkpoints"
    steps = [int(e.name) for e in folder.iterdir() if e.name.isdigit()] if folder.is_dir() else []
    for step in sorted(steps, reverse=True):
        if (path := folder / str(step) / "config" / "metadata").exists():
            return path
    raise no_checkpoint(workdir)


def no_checkpoint(workdir: str) -> CheckpointError | WorkdirBusy:
    """The refusal of `workdir` without a finished checkpoint: WorkdirBusy while a training holds
    its lock (an evaluation waits for the training to end), else CheckpointError."""
    path = resolved(workdir)
    if path.exists() and not path.is_dir():
        return CheckpointError(f"--workdir {path} is a file, not a run's folder.")
    lock = path / "run.lock"  # its holder's line (jrope.train.checkpoints.WorkdirLock)
    holder = lock.read_bytes().decode(errors="replace").strip() if lock.is_file() else ""
    if not holder.startswith("training"):
        return CheckpointError(f"--workdir {path} holds no finished checkpoint; point it at a "
                               "trained run.")  # fmt: skip
    with lock.open("rb") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return WorkdirBusy(f"{lock} is held ({holder}), which has saved no checkpoint yet: "
                               "wait for it to end, or use another --workdir.")  # fmt: skip
    return CheckpointError(f"--workdir {path} holds no finished checkpoint: the training there "
                           f"({holder}) ended before its first save; train it again.")  # fmt: skip


def with_tuples(value: Any) -> Any:
    """JSON's lists as tuples, recursively (the configs' sequences are tuples)."""
    if isinstance(value, dict):
        return {key: with_tuples(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(map(with_tuples, value))
    return value
