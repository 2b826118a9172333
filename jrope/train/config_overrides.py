"""Command-line overrides of a config file (`--config.pe.name=rope`), checked where absl parses.

ml_collections applies `--config.<dotted key>=<value>` overrides while absl
parses the command line. A key the config does not have then ends in a long
ml_collections traceback that names only the last part of the key, and a
tuple key given twice (`--config.eval.lengths=...` twice) is joined into one
tuple instead of the later value replacing the earlier. So the entry points
(jrope.train.cli) first keep only the last of repeated overrides, and when
parsing fails, they name every unknown key at once with the
closest existing one (`unknown_key_problems`), and a config file that does
not exist is named as such (`config_file_problem`).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator, Sequence

from ml_collections import config_dict
from ml_collections.config_flags import config_flags


def _override_pattern(flag_name: str) -> re.Pattern:
    # --config.a.b=v, -config.a.b=v, --noconfig.a.b (a boolean set to False)
    return re.compile(rf"^--?(?:no)?{re.escape(flag_name)}\.([^=]+)(=.*)?$", re.DOTALL)


def last_override_wins(argv: Sequence[str], flag_name: str = "config") -> list[str]:
    """`argv` with only the last `--<flag_name>.<key>=<value>` of each key kept (others unchanged).

    Overrides written as two arguments (`--config.key value`) are left as they are.
    """
    pattern = _override_pattern(flag_name)
    last_index = {}
    for index, arg in enumerate(argv):
        match = pattern.match(arg)
        if match and match.group(2) is not None:
            last_index[match.group(1)] = index
    kept = []
    for index, arg in enumerate(argv):
        match = pattern.match(arg)
        if match and match.group(2) is not None and last_index[match.group(1)] != index:
            continue
        kept.append(arg)
    return kept


def config_argument(argv: Sequence[str], flag_name: str = "config") -> str | None:
    """The value of `--<flag_name>=PATH` (or `--<flag_name> PATH`) in argv, else None."""
    for index, arg in enumerate(argv):
        if arg in (f"--{flag_name}", f"-{flag_name}") and index + 1 < len(argv):
            return argv[index + 1]
        for prefix in (f"--{flag_name}=", f"-{flag_name}="):
            if arg.startswith(prefix):
                return arg[len(prefix) :]
    return None


def overridden_keys(argv: Sequence[str], flag_name: str = "config") -> list[str]:
    """The dotted keys of argv's `--<flag_name>.<key>` overrides, in order."""
    pattern = _override_pattern(flag_name)
    return [match.group(1) for match in map(pattern.match, argv) if match]


def config_file_problem(argv: Sequence[str], flag_name: str = "config") -> str | None:
    """A line saying that the config file named in argv does not exist, else None."""
    path = config_argument(argv, flag_name)
    if path is None or os.path.isfile(path.split(":", 1)[0]):
        return None
    return (
        f"--{flag_name}={path}: no such file (looked from {os.getcwd()}); name an experiment "
        f"config, e.g. --{flag_name}=configs/quickstart.py (all of them are in configs/)."
    )


def unknown_key_problems(argv: Sequence[str], flag_name: str = "config") -> list[str]:
    """One line per override whose key the config file lacks, with the closest key; [] if none.

    Loads the config file the way the flag does (no file: []).
    """
    path = config_argument(argv, flag_name)
    if path is None or config_file_problem(argv, flag_name):
        return []
    config = config_flags.ConfigFileFlagParser(flag_name, lock_config=False).parse(path)
    known = list(_dotted_keys(config))
    problems = []
    for key in overridden_keys(argv, flag_name):
        if key in known:
            continue
        parent = _value_above(config, key)
        if parent is not None:
            problems.append(
                f"--{flag_name}.{key}: {parent} is a value, not a section; "
                f"set it with --{flag_name}.{parent}=..."
            )
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"did you mean --{flag_name}.{close[0]}?" if close else _section_hint(config, key)
        problems.append(f"--{flag_name}.{key}: the config has no key {key!r}; {hint}")
    return problems


def _dotted_keys(config: config_dict.ConfigDict, prefix: str = "") -> Iterator[str]:
    """Every key of the config as a dotted path, sections and leaves alike."""
    for key in config.keys():
        dotted = f"{prefix}{key}"
        yield dotted
        if isinstance(config[key], config_dict.ConfigDict):
            yield from _dotted_keys(config[key], f"{dotted}.")


def _value_above(config: config_dict.ConfigDict, key: str) -> str | None:
    """The dotted prefix of `key` that names a value (not a section), if any."""
    parts = key.split(".")
    node = config
    for depth, part in enumerate(parts[:-1]):
        if not isinstance(node, config_dict.ConfigDict) or part not in node:
            return None
        node = node[part]
        if not isinstance(node, config_dict.ConfigDict):
            return ".".join(parts[: depth + 1])
    return None


def _section_hint(config: config_dict.ConfigDict, key: str) -> str:
    """The keys of the deepest existing section on `key`'s path."""
    node, path = config, []
    for part in key.split(".")[:-1]:
        if part not in node or not isinstance(node[part], config_dict.ConfigDict):
            break
        node, path = node[part], path + [part]
    where = f"section {'.'.join(path)!r}" if path else "the config"
    return f"{where} has {', '.join(sorted(node.keys()))}."
