"""What every command of the project does before its flags are parsed, without starting JAX.

`--help` (also -?, -h, --helpshort) prints the command's usage and the
flags of the command itself and of the project's modules it uses (the
process flags, --verbose, ...), then exits 0; `--helpfull` adds every
library's flags. absl's own help lists only the flags of the main module
and exits 1, which hides the flags a module like jrope.train.setup defines
and reads as a failure to a shell or a CI step.

    app.run(main, flags_parser=command_line.parse_flags)

`keep_stdout_for_results` sends what native libraries print on the
process's stdout (Gloo's connection lines in a multi-process CPU run) to
stderr, so that stdout holds the progress and results alone.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from absl import flags

SHORT_HELP = ("--help", "-help", "--helpshort", "-helpshort", "-?", "-h")
FULL_HELP = ("--helpfull", "-helpfull")
_PROJECT_PACKAGE = "jrope"


def help_requested(argv: Sequence[str]) -> str | None:
    """'short', 'full' or None: which help the command line asks for (before a '--')."""
    for arg in argv[1:]:
        if arg == "--":
            return None
        if arg in FULL_HELP:
            return "full"
        if arg in SHORT_HELP:
            return "short"
    return None


def help_text(
    usage: str | None = None, *, full: bool = False, command_module: str | None = None
) -> str:
    """The usage text, then the flags of the main module and of the project's modules.

    usage: what the command does (default: the main module's docstring).
    full: every defined flag, the libraries' too.
    command_module: the module that defines the command's own flags where that is not the main
      module (a clone's train.py runs jrope.train.__main__).
    """
    usage = usage if usage is not None else (sys.modules["__main__"].__doc__ or "")
    by_module = flags.FLAGS.flags_by_module_dict()
    main_names = {sys.argv[0], os.path.basename(sys.argv[0]), "__main__", command_module}
    modules = [
        module
        for module in by_module
        if full or module in main_names or module.split(".")[0] == _PROJECT_PACKAGE
    ]
    sections = [
        _module_section(module, "this command" if module in main_names else module)
        for module in modules
    ]
    config_flags = [
        flag.name
        for module in modules
        for flag in by_module[module]
        if type(flag).__name__ == "_ConfigFlag"  # ml_collections' config-file flag
    ]
    notes = [
        f"--{name}.<key>=<value> sets one key of the config file, e.g. "
        f"--{name}.num_steps=50 or --{name}.eval.lengths='(256,512)'."
        for name in config_flags
    ]
    if not full:
        notes.append("--helpfull lists the libraries' flags too (absl, JAX, orbax).")
    return "\n".join([usage.rstrip(), "", "flags:", "", "\n\n".join(sections), "", *notes, ""])


def _module_section(module: str, label: str) -> str:
    """absl's help of one module's flags, headed by `label`."""
    lines = flags.FLAGS.module_help(module).strip().splitlines()
    return "\n".join([f"{label}:", *lines[1:]])


def parse_flags(
    argv: list[str], usage: str | None = None, command_module: str | None = None
) -> list[str]:
    """absl's flag parsing, with --help and --helpfull printing help_text and exiting 0."""
    wanted = help_requested(argv)
    if wanted:
        sys.stdout.write(help_text(usage, full=wanted == "full", command_module=command_module))
        sys.stdout.flush()
        sys.exit(0)
    return flags.FLAGS(argv)


def keep_stdout_for_results() -> None:
    """Native writes to file descriptor 1 go to stderr; Python's sys.stdout still goes to stdout.

    Gloo (JAX's CPU collectives) prints its connection lines with the C
    library's stdout. The process's descriptor 1 is pointed at stderr, and
    sys.stdout is rebound to a copy of the original descriptor, so that the
    project's progress and results (printed through sys.stdout) stay on stdout.
    """
    sys.stdout.flush()
    results = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(results, "w", buffering=1, encoding=sys.stdout.encoding)
