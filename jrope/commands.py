"""The experiments by name (a clone's configs/, or the copy a wheel carries) and the commands that
messages give, as they run from here: `python train.py` in a clone's root, else `python -m
jrope.train`."""

import pathlib
import sys

_CLONE = pathlib.Path(__file__).resolve().parent.parent
_FOLDERS = (_CLONE / "configs", _CLONE / "jrope/installed_configs/configs")
CONFIGS = next((folder for folder in _FOLDERS if (folder / "base.py").is_file()), None)


def _in_clone_root() -> bool:
    return (_CLONE / "train.py").is_file() and pathlib.Path.cwd().resolve() == _CLONE


def command(entry_point: str) -> str:
    """How to run 'train', 'eval' or 'sample' from here."""
    return f"python {entry_point}.py" if _in_clone_root() else f"python -m jrope.{entry_point}"


def install_command(extras: str) -> str:
    """How to add extras (jrope comes from a clone or a wheel built there, not from the index)."""
    return f'pip install ".[{extras}]" in a clone, or the wheel with [{extras}]'


def config_names() -> list[str]:
    """The experiments' names (quickstart, synthetic_cpu, ...), sorted."""
    return sorted(p.stem for p in CONFIGS.glob("*.py") if p.stem != "base") if CONFIGS else []


def config_path(value: str) -> str:
    """A --config value with an experiment's name (`quickstart`, `kernel_probe:ARG`) replaced by
    its file's path; a path, a file of that name here, or an unknown name comes back as it is."""
    name, colon, argument = value.partition(":")
    path = CONFIGS / f"{name}.py" if CONFIGS and name.isidentifier() else None
    if path is None or not path.is_file() or pathlib.Path(name).exists():
        return value
    return f"{path}{colon}{argument}"


def with_config_paths(argv: list[str]) -> list[str]:
    """argv with the experiment name of --config=NAME (or --config NAME) replaced by its path."""
    resolved = list(argv)
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag in ("--config", "-config") and equals:
            resolved[index] = f"{flag}={config_path(value)}"
        elif flag in ("--config", "-config") and index + 1 < len(argv):
            resolved[index + 1] = config_path(argv[index + 1])
    return resolved


def config_value(path: str) -> str:
    """The --config value that names the config file `path` (may end in ':ARG') from here: an
    experiment's as `configs/<name>.py` in a clone's root and by name elsewhere; any other file
    as it is."""
    file, colon, argument = path.partition(":")
    resolved = pathlib.Path(file).resolve()
    if CONFIGS is None or resolved.parent != CONFIGS or resolved.stem == "base":
        return path
    in_clone = _in_clone_root() and CONFIGS == _CLONE / "configs"
    return f"{f'configs/{resolved.name}' if in_clone else resolved.stem}{colon}{argument}"


def make_importable(config: str | None) -> None:
    """The parent of the config file's folder first on sys.path: its `from configs import base`
    resolves from any folder (`config` may end in ':ARG'; None: nothing to do)."""
    root = config and str(pathlib.Path(config.partition(":")[0]).resolve().parent.parent)
    if root and root not in sys.path:
        sys.path.insert(0, root)
