"""The experiments' commands as this installation runs them, and the experiment configs by name.

A clone runs `python train.py`, `python eval.py` and `python sample.py` from
its root and reads the configs from its `configs/`; an installed package
(`pip install`) runs `python -m jrope.train`, `python -m jrope.eval` and
`python -m jrope.sample` (or the `jrope-*` console scripts) from any folder
and reads the copy of `configs/` its wheel carries (pyproject.toml maps it
to `jrope/installed_configs/configs/`). Every message that gives a command
builds it here, so that it is the one that works where it is read.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

ENTRY_POINTS = ("train", "eval", "sample")
_PACKAGE = pathlib.Path(__file__).resolve().parent
# In a clone: the folder holding the jrope package, the entry-point scripts and configs/.
_CLONE = _PACKAGE.parent
# The wheel's copy of configs/; its parent goes on sys.path to load a config
# (`from configs import base`), so it holds `configs` alone.
_INSTALLED_CONFIGS = _PACKAGE / "installed_configs" / "configs"


def _in_clone_root() -> bool:
    return (_CLONE / "train.py").is_file() and pathlib.Path.cwd().resolve() == _CLONE


def command(entry_point: str) -> str:
    """How to run `entry_point` ('train', 'eval' or 'sample') from here: `python eval.py` in a
    clone's root, else `python -m jrope.eval`."""
    if entry_point not in ENTRY_POINTS:
        raise ValueError(f"Unknown entry point {entry_point!r}; one of {ENTRY_POINTS}.")
    if _in_clone_root():
        return f"python {entry_point}.py"
    return f"python -m jrope.{entry_point}"


def configs_folder() -> pathlib.Path | None:
    """The folder of the experiment configs: a clone's configs/, else the installed copy."""
    for folder in (_CLONE / "configs", _INSTALLED_CONFIGS):
        if (folder / "base.py").is_file():
            return folder
    return None


def config_names() -> list[str]:
    """The experiments' names (quickstart, synthetic_cpu, ...), sorted."""
    folder = configs_folder()
    if folder is None:
        return []
    return sorted(path.stem for path in folder.glob("*.py") if path.stem != "base")


def config_path(value: str) -> str:
    """A --config value with an experiment's name (`quickstart`, `kernel_probe:ARG`) replaced by
    its file's path; a path, or a name that no config has, comes back as it is."""
    name, colon, argument = value.partition(":")
    folder = configs_folder()
    if folder is None or "/" in name or os.sep in name or name.endswith(".py"):
        return value
    if os.path.exists(name):  # a file of that name where the command runs is meant as a path
        return value
    path = folder / f"{name}.py"
    return f"{path}{colon}{argument}" if path.is_file() else value


def config_value(path: str) -> str:
    """The --config value that names the config file `path` (may end in ':ARG') from here: an
    experiment's config as `configs/<name>.py` in a clone's root and by name elsewhere; any other
    file as it is."""
    file, colon, argument = path.partition(":")
    folder = configs_folder()
    if folder is None or not os.path.isfile(file):
        return path
    resolved = pathlib.Path(file).resolve()
    if resolved.parent != folder.resolve() or resolved.stem == "base":
        return path
    if _in_clone_root() and folder == _CLONE / "configs":
        return f"configs/{resolved.name}{colon}{argument}"
    return f"{resolved.stem}{colon}{argument}"


def config_hint() -> str:
    """How to name an experiment's config here, with the names there are."""
    names = config_names()
    if not names:
        return "name a config file, e.g. --config=configs/quickstart.py"
    listed = ", ".join(names)
    if _in_clone_root() and configs_folder() == _CLONE / "configs":
        return f"name one by its file, e.g. --config=configs/quickstart.py, or by name ({listed})"
    return f"name one, e.g. --config=quickstart ({listed}), or a config file by its path"


def with_config_paths(argv: Sequence[str]) -> list[str]:
    """argv with the experiment name of --config=NAME (or --config NAME) replaced by its path."""
    resolved = list(argv)
    for index, arg in enumerate(resolved):
        if arg.startswith(("--config=", "-config=")):
            flag, value = arg.split("=", 1)
            resolved[index] = f"{flag}={config_path(value)}"
        elif arg in ("--config", "-config") and index + 1 < len(resolved):
            resolved[index + 1] = config_path(resolved[index + 1])
    return resolved
