"""The config saved with a run's latest checkpoint, loadable as an ml_collections config file.

    python eval.py --workdir=DIR --config.eval.lengths='(256,512,4096)'

eval.py's --config flag defaults to `<this file>:DIR` (DIR its --workdir),
so the `--config.<key>=<value>` overrides apply to the run's own config as to
any config file (with the same type checks and the same names for an unknown key).

Every checkpoint keeps the config of the run that wrote it
(jrope.train.checkpoints: the `config` item, which orbax writes as JSON in
`<step>/config/metadata`). It is read as a file, without orbax's manager,
so that no JAX backend starts before a multi-process run's processes have
found each other.
"""

from __future__ import annotations

import json
from typing import Any

from etils import epath
from ml_collections import config_dict

from jrope.data.files import resolved
from jrope.errors import CorruptCheckpointError

CHECKPOINTS_FOLDER = "checkpoints"
_CONFIG_FILE = ("config", "metadata")
# Keys that checkpoints of earlier versions hold and that no longer set anything: dropped on load.
RETIRED_KEYS = {"eval": ("max_hours",), "data": ("seq_len", "head_dim", "theta")}


def get_config(workdir: str) -> config_dict.ConfigDict:
    """The config of the latest finished checkpoint in `workdir` (lists as tuples, as configs write them).

    Raises FileNotFoundError naming what is missing and what to do.
    """
    _, path = latest_saved_config(workdir)
    if path is None:
        raise FileNotFoundError(no_saved_config_message(workdir))
    try:
        saved = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as error:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        checkpoint = path.parent.parent
        aside = checkpoint.parent.parent / "damaged_checkpoints"
        raise CorruptCheckpointError(
            f"The config saved with checkpoint {checkpoint} cannot be read ({error}): that "
            f"checkpoint is damaged; nothing was deleted. Move it aside (mkdir -p {aside} && mv "
            f"{checkpoint} {aside}/) to evaluate the one before, or pass the experiment's "
            "config (--config=<experiment>: its name, e.g. quickstart, or its file's path)."
        ) from None
    return config_dict.ConfigDict(_with_tuples(without_retired_keys(saved)))


def latest_saved_config(workdir: str) -> tuple[int | None, epath.Path | None]:
    """(step, path of its saved config) of the latest finished checkpoint in `workdir`, or (None, None).

    A checkpoint is finished when orbax has renamed it to its step number (a
    save in progress has another name).
    """
    folder = resolved(workdir) / CHECKPOINTS_FOLDER
    if not folder.is_dir():
        return None, None
    steps = sorted(int(entry.name) for entry in folder.iterdir() if entry.name.isdigit())
    for step in reversed(steps):
        path = folder.joinpath(str(step), *_CONFIG_FILE)
        if path.exists():
            return step, path
    return None, None


def no_saved_config_message(workdir: str) -> str:
    return (
        f"--workdir {resolved(workdir)} holds no finished checkpoint with its config "
        f"({CHECKPOINTS_FOLDER}/<step>/{'/'.join(_CONFIG_FILE)}): point --workdir at a trained "
        "run, or pass the experiment's config (--config=<experiment>: its name, e.g. "
        "kernel_probe, or its file's path; a kernel probe always needs it)."
    )


def without_retired_keys(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config (JSON dict) without RETIRED_KEYS."""
    kept = dict(saved)
    for section, keys in RETIRED_KEYS.items():
        if isinstance(kept.get(section), dict):
            kept[section] = {k: v for k, v in kept[section].items() if k not in keys}
    return kept


def _with_tuples(value: Any) -> Any:
    """JSON's lists as tuples, recursively (the configs' sequences are tuples)."""
    if isinstance(value, dict):
        return {key: _with_tuples(item) for key, item in value.items()}
    if isinstance(value, list):
        return tuple(_with_tuples(item) for item in value)
    return value
