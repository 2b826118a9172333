"""What every command-line entry point shares: its flags, log levels, error messages and exit codes.

    from jrope.train import cli

    def main(argv): ...

    if __name__ == "__main__":
        cli.run(main)

A person running a command wants to read what went wrong and how to fix it,
not a traceback: the project's own errors (a bad config, missing data, a
damaged checkpoint, a NaN loss, a busy workdir, a full disk, a preemption)
end with their message alone on stderr and an exit status that says which
kind it was (each error's `exit_status`, jrope.errors; the README has the table). `--verbose` (or
JROPE_VERBOSE=1) adds the traceback. Any other error is a bug and keeps its
traceback.

Mistakes on the command line are caught where absl parses it: a config key
that does not exist is named with the closest one that does
(jrope.train.config_overrides), for every such key at once.

The console is for what a person reads (jrope.train.console). Library log
records below WARNING (orbax writes about a hundred per short run) are
hidden unless `--log_level=info` (or debug) asks for them. So are the
libraries' own reports of a storage failure (orbax logs one traceback per
thread it runs), unless --verbose: the same failure reaches the entry point
as an exception, which ends the command with one message naming the path
and the cause (jrope.train.io_failures).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence

from absl import app, flags
from absl import logging as absl_logging

from jrope.errors import ConfigError, JropeError, RunIOError
from jrope.train import config_overrides, huge_pages, io_failures

VERBOSE_ENV = "JROPE_VERBOSE"
LOG_LEVELS = ("debug", "info", "warning", "error")

_VERBOSE = flags.DEFINE_bool(
    "verbose", False, f"On an error, show its traceback too (or set {VERBOSE_ENV}=1)."
)
_LOG_LEVEL = flags.DEFINE_enum(
    "log_level",
    "warning",
    LOG_LEVELS,
    "Lowest level of library log records shown (JAX, orbax, absl); progress is always shown.",
)


def run(main: Callable[[list[str]], None], *, config_flag: str = "config") -> None:
    """`app.run(main)` with the project's flag parsing, log level and error reporting.

    config_flag: the name of the entry point's config-file flag, whose
    overrides are checked (an entry point without one is unaffected).
    """
    huge_pages.restart_with_huge_pages()
    app.run(
        functools.partial(_run_reporting_errors, main),
        flags_parser=functools.partial(_parse_flags, config_flag=config_flag),
    )


def exit_code(error: BaseException) -> int | None:
    """The exit status of one of the project's errors; None for any other (a bug)."""
    if isinstance(error, JropeError):
        return error.exit_status
    return RunIOError.exit_status if io_failures.find_io_failure(error) else None


def message(error: BaseException) -> str:
    """What to print for one of the project's errors."""
    if isinstance(error, RunIOError) or not io_failures.find_io_failure(error):
        return str(error)
    cause, path = io_failures.find_io_failure(error)
    where = f" writing {path}" if path else ""
    return (
        f"Storage failure{where}: {cause}. Free space, or choose another --workdir, and run again."
    )


def _verbose(argv: Sequence[str] = ()) -> bool:
    if os.environ.get(VERBOSE_ENV, "0") not in ("", "0"):
        return True
    if "--verbose" in argv:  # before the flags are parsed
        return True
    return _VERBOSE.present and _VERBOSE.value


def _fail(text: str, code: int, error: BaseException, argv: Sequence[str] = ()) -> None:
    if _verbose(argv):
        traceback.print_exception(error, file=sys.stderr)
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)
    sys.exit(code)


def _parse_flags(argv: list[str], *, config_flag: str) -> list[str]:
    """absl's parsing of argv, with repeated config overrides resolved and mistakes explained."""
    # ml_collections reads the overrides from sys.argv itself: it must see the same list.
    argv = sys.argv = config_overrides.last_override_wins(argv, config_flag)
    missing_file = config_overrides.config_file_problem(argv, config_flag)
    if missing_file:
        _fail(missing_file, ConfigError.exit_status, FileNotFoundError(missing_file), argv)
    try:
        return flags.FLAGS(argv)
    except Exception as error:  # absl and ml_collections raise many types: all mean "bad flag"
        problems = _unknown_keys(argv, config_flag)
        text = "\n".join(problems) if problems else _first_line(error)
        required = re.search(r"Flag --(\w+) must have a value other than None", text)
        if required:
            text = (
                f"--{required.group(1)} is required; give it a value (--{required.group(1)}=...)."
            )
        _fail(f"{text}\n(--helpfull lists every flag.)", ConfigError.exit_status, error, argv)


def _unknown_keys(argv: list[str], config_flag: str) -> list[str]:
    try:
        return config_overrides.unknown_key_problems(argv, config_flag)
    except Exception:  # the config file itself fails to load: absl's error says why
        return []


def _run_reporting_errors(main: Callable[[list[str]], None], argv: list[str]) -> None:
    _set_log_level(_LOG_LEVEL.value)
    if not _verbose():
        for handler in logging.getLogger().handlers:
            handler.addFilter(_hide_storage_failure_records)
            handler.addFilter(_hide_abandoned_task_records)
        sys.excepthook = _excepthook_without_closed_loop_noise
        sys.unraisablehook = _unraisablehook_without_abandoned_io_noise
    try:
        main(argv)
    except Exception as error:
        code = exit_code(error)
        if code is None:
            raise
        _fail(message(error), code, error)


def _set_log_level(name: str) -> None:
    """Library records below `name` hidden: absl's (orbax logs through it) and Python's (JAX's)."""
    absl_logging.set_verbosity(name)
    logging.getLogger().setLevel(name.upper())


def _hide_storage_failure_records(record: logging.LogRecord) -> bool:
    """False (hide) for a library's record of a storage failure."""
    error = record.exc_info[1] if record.exc_info else Exception(record.getMessage())
    return error is None or io_failures.find_io_failure(error) is None


def _hide_abandoned_task_records(record: logging.LogRecord) -> bool:
    """False (hide) for asyncio's record of a task that orbax abandoned after another failed."""
    return not (record.name == "asyncio" and record.getMessage().startswith("Task exception"))


def _excepthook_without_closed_loop_noise(kind, value, traceback_) -> None:
    """sys.excepthook, silent for write callbacks that outlive a failed save's event loop.

    When a checkpoint write fails, tensorstore still completes the other
    writes of that save and prints each callback's "Event loop is closed"
    (through this hook); the failure itself is reported once.
    """
    if not _closed_loop(value):
        sys.__excepthook__(kind, value, traceback_)


def _unraisablehook_without_abandoned_io_noise(unraisable) -> None:
    """sys.unraisablehook, silent for the leftovers of a failed checkpoint read or write.

    When one array of a checkpoint cannot be read (or written), orbax gives up
    on the others: their coroutines raise again when they are collected, and
    tensorstore's callbacks find the event loop closed. Each would print a
    traceback before and after the one message that names the damaged array.
    """
    if not (_closed_loop(unraisable.exc_value) or inspect.iscoroutine(unraisable.object)):
        sys.__unraisablehook__(unraisable)


def _closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
