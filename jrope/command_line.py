"""What every command of the project shares, without starting JAX: `run(main)` (flags, log level,
exit statuses as in docs/runs.md, signals), help, the --config file's argument, and the process
flags of a multi-process run (`define_process_flags`, `start_processes`).

`--help` (also -?, -h, --helpshort) prints the command's usage and the
flags of the command itself and of the project's modules it uses (the
process flags, --verbose, ...), then exits 0; `--helpfull` adds every
library's flags. absl's own help lists only the flags of the main module
and exits 1, which hides the flags a module like this one defines
and reads as a failure to a shell or a CI step.

    app.run(main, flags_parser=parse_flags)

`keep_stdout_for_results` sends what native libraries print on the
process's stdout (Gloo's connection lines in a multi-process CPU run) to
stderr, so that stdout holds the progress and results alone.
"""

from __future__ import annotations

import errno
import functools
import inspect
import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

from absl import app, flags
from absl import logging as absl_logging

from jrope import commands
from jrope.errors import ConfigError, JropeError, RunIOError, UsageError

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


def config_argument(argv: Sequence[str], flag_name: str = "config") -> str | None:
    """The value of `--<flag_name>=PATH` (or `--<flag_name> PATH`) in argv, else None."""
    for arg, following in zip(argv, [*argv[1:], None], strict=True):
        match = re.fullmatch(rf"--?{re.escape(flag_name)}(=.*)?", arg, re.DOTALL)
        if match and (match[1] is not None or following is not None):
            return following if match[1] is None else match[1][1:]
    return None


def make_importable(path: str | None) -> None:
    """Put the parent of the config file's folder first on sys.path, so that the config's
    `from configs import base` resolves from any working directory (path may end in ':ARG')."""
    root = path and os.path.dirname(os.path.dirname(os.path.abspath(path.split(":", 1)[0])))
    if root and root not in sys.path:
        sys.path.insert(0, root)


VERBOSE_ENV = "JROPE_VERBOSE"
_PROCESS_FLAGS = ("multiprocess", "coordinator_address", "num_processes", "process_id")


def define_process_flags() -> None:
    """Defines the flags of a multi-process run (once, in the entry point that takes them)."""
    flags.DEFINE_bool(
        "multiprocess",
        False,
        "Start JAX's distributed runtime, detecting the cluster (Cloud TPU, Slurm, Open MPI).",
    )
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "HOST:PORT of process 0's coordinator service (reachable from every process).",
    )
    flags.DEFINE_integer("num_processes", None, "Number of processes of the run.", lower_bound=1)
    flags.DEFINE_integer(
        "process_id", None, "This process's index, 0 .. num_processes - 1.", lower_bound=0
    )


def start_processes() -> None:
    """Starts JAX's distributed runtime when the process flags ask for it, before anything touches
    a JAX backend; then logs this process's devices."""
    import jax  # not at import: a mistake on the command line is reported without loading JAX

    multiprocess, *explicit = (flags.FLAGS[name].value for name in _PROCESS_FLAGS)
    if multiprocess or any(value is not None for value in explicit):
        initialize_processes(*explicit)
    absl_logging.info(
        "JAX process %d of %d; local devices %s; all devices %d.",
        jax.process_index(),
        jax.process_count(),
        jax.local_devices(),
        jax.device_count(),
    )


def initialize_processes(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> None:
    """`jax.distributed.initialize` (unset arguments detected by JAX: Cloud TPU, Slurm, Open MPI,
    JAX_COORDINATOR_ADDRESS), with gloo for cross-process collectives on CPU."""
    import jax

    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise UsageError(
            f"--process_id={process_id} must lie in [0, --num_processes={num_processes}); "
            "number the processes 0 .. num_processes - 1."
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )


def run(
    main: Callable[[list[str]], None],
    *,
    usage: str | None = None,
    define_flags: Callable[[list[str]], None] | None = None,
) -> None:
    """`app.run(main)` with the project's flag parsing, log level and error reporting; `usage` is
    what --help prints above the flags (default: the main module's docstring); `define_flags`
    defines flags that depend on argv, just before it is parsed (its errors are reported as a
    bad flag's)."""
    if "verbose" not in flags.FLAGS:  # defined here: importing this module defines no flag
        flags.DEFINE_bool(
            "verbose", False, f"On an error, show its traceback too (or set {VERBOSE_ENV}=1)."
        )
        flags.DEFINE_enum(
            "log_level",
            "warning",
            ("debug", "info", "warning", "error"),
            "Lowest level of library log records shown (JAX, orbax, absl); progress always shows.",
        )
    command_module = getattr(main, "__module__", None)  # where the command defines its flags
    parse_flags = functools.partial(
        _parse_flags, usage=usage, command_module=command_module, define_flags=define_flags
    )
    app.run(functools.partial(_run_reporting_errors, main), flags_parser=parse_flags)


def exit_status(error: BaseException) -> tuple[int, str] | None:
    """(exit status, message) of a project error or of a storage failure in its chain, else None."""
    failure = None if isinstance(error, RunIOError) else find_io_failure(error)
    if failure is None:
        return (error.exit_status, str(error)) if isinstance(error, JropeError) else None
    status = error.exit_status if isinstance(error, JropeError) else RunIOError.exit_status
    where = f" writing {failure[1]}" if failure[1] else ""
    advice = "Free space, or choose another --workdir, and run again."
    return status, f"Storage failure{where}: {failure[0]}. {advice}"


def _verbose(argv: Sequence[str] = ()) -> bool:
    if os.environ.get(VERBOSE_ENV, "0") not in ("", "0") or "--verbose" in argv:
        return True  # argv: before the flags are parsed
    return "verbose" in flags.FLAGS and flags.FLAGS["verbose"].present and flags.FLAGS.verbose


def _fail(text: str, code: int, error: BaseException, argv: Sequence[str] = ()) -> None:
    if _verbose(argv):
        traceback.print_exception(error, file=sys.stderr)
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)
    sys.exit(code)


def _parse_flags(
    argv: list[str],
    *,
    usage: str | None,
    command_module: str | None,
    define_flags: Callable[[list[str]], None] | None,
) -> list[str]:
    """absl's parsing of argv; a bad flag or config file ends with absl's (or the config file's)
    own message on one line, status 2."""
    # --config=quickstart names an experiment: its file's path instead. ml_collections reads the
    # overrides from sys.argv itself, so it gets the same list.
    argv = sys.argv = commands.with_config_paths(argv)
    try:
        if define_flags is not None:
            define_flags(argv)
        if help_requested(argv):
            parse_flags(argv, usage, command_module)  # prints the help and exits 0
        missing = _missing_config_file(config_argument(argv))
        if missing:
            _fail(missing, ConfigError.exit_status, FileNotFoundError(missing), argv)
        make_importable(config_argument(argv))
        argv = flags.FLAGS(argv)
        if "config" in flags.FLAGS and flags.FLAGS.config is not None:
            flags.FLAGS.config.keys()  # ml_collections raises a config file's error only when read
        return argv
    except Exception as error:  # absl and ml_collections raise many types: all mean "bad flag"
        own = _project_error(error)  # e.g. eval.py's saved config, damaged
        if own is not None:
            _fail(str(own), own.exit_status, error, argv)
        text = _config_file_error(error, config_argument(argv))
        if text is None:
            text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
            lines = [line.strip() for line in text.splitlines() if line.strip()] or [repr(error)]
            text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # a traceback
            text += " (--helpshort lists the flags; see docs/runs.md)"
        _fail(text, ConfigError.exit_status, error, argv)


def _missing_config_file(value: str | None) -> str | None:
    """The message for a --config value that is neither a file nor an experiment's name."""
    if not value or os.path.isfile(value.split(":", 1)[0]):
        return None
    path = value.split(":", 1)[0]
    a_name = "/" not in path and not path.endswith(".py")
    return (
        f"--config={value}: No such file or directory: '{path}' (looked from {os.getcwd()})"
        f"{', and no experiment has that name' if a_name else ''}; {commands.config_hint()}."
    )


def _config_file_error(error: BaseException, path: str | None) -> str | None:
    """What the config file itself raised, with its line; None when the error is absl's."""
    if not path:
        return None
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    config_file = os.path.abspath(path.split(":")[0])
    frames = traceback.extract_tb(cause.__traceback__)
    lines = [frame for frame in frames if os.path.abspath(frame.filename) == config_file]
    if not lines:
        return None
    first_line = (str(cause).strip() or type(cause).__name__).splitlines()[0]
    return (
        f"The config file {path} raised {type(cause).__name__}: {first_line}, "
        f"line {lines[-1].lineno}: {lines[-1].line}. Fix the file (--verbose shows the traceback)."
    )


def _project_error(error: BaseException) -> JropeError | None:
    """The first of the project's errors in `error`'s chain, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, JropeError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _run_reporting_errors(main: Callable[[list[str]], None], argv: list[str]) -> None:
    level = flags.FLAGS.log_level  # absl's records (orbax logs through it) and Python's (JAX's)
    absl_logging.set_verbosity(level)
    logging.getLogger().setLevel(level.upper())
    if any(flags.FLAGS[name].value for name in _PROCESS_FLAGS if name in flags.FLAGS):
        keep_stdout_for_results()  # Gloo's connection lines are no results
    if not _verbose():
        for handler in logging.getLogger().handlers:
            handler.addFilter(_shown_record)
        sys.excepthook = _excepthook_without_closed_loop_noise
        sys.unraisablehook = _unraisablehook_without_abandoned_io_noise
    before = {
        signum: signal.signal(signum, _stop_at_a_safe_point)
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        main(argv)
    except (KeyboardInterrupt, Stopped) as error:
        signum = signal.SIGTERM if isinstance(error, Stopped) else signal.SIGINT
        _fail(stop_message(signum, getattr(error, "during", None)), 128 + signum, error)
    except Exception as error:
        reported = exit_status(error)
        if reported is None:
            raise
        _fail(reported[1], reported[0], error)
    else:
        # Everything is written: a signal from here on (or one deferred out of a library above)
        # takes its usual effect, never a stop message raised inside the interpreter's shutdown.
        for signum, handler in before.items():
            signal.signal(signum, handler)


class Stopped(BaseException):
    """SIGTERM outside the train loop: a BaseException, so no `except Exception` swallows it."""


# Modules whose code a stop must not interrupt: JAX runs Python inside its compilation (tracing,
# lowering, its garbage-collection callback), where an exception is swallowed ("Exception ignored")
# or leaves native state half-built, and the interpreter's shutdown then crashes on it.
_LIBRARIES_NOT_TO_INTERRUPT = ("jax", "jaxlib", "flax", "optax", "orbax", "tensorstore")
# How soon a stop deferred out of those libraries looks again for a point to stop at.
STOP_RECHECK_S = 0.05


def _stop_at_a_safe_point(signum: int, frame: FrameType | None) -> None:
    """The SIGTERM and Ctrl-C handler until the train loop (or a multi-process run) installs its
    own: raises Stopped or KeyboardInterrupt where the main thread runs no code of the libraries
    above; inside them, the signal is sent again STOP_RECHECK_S later, until it is outside."""
    stack = frame
    while stack is not None:
        if stack.f_globals.get("__name__", "").split(".")[0] in _LIBRARIES_NOT_TO_INTERRUPT:
            again = threading.Timer(STOP_RECHECK_S, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        stack = stack.f_back
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Stopped(signal.Signals(signum).name)


@contextmanager
def activity(description: str) -> Iterator[None]:
    """Names the activity a SIGTERM or Ctrl-C stops (its `during`; the outermost one's)."""
    try:
        yield
    except (KeyboardInterrupt, Stopped) as stop:
        stop.during = description
        raise


def stop_message(signum: int, during: str | None = None) -> str:
    """The one line for a command stopped by `signum` outside the train loop, during `during`."""
    what = "Interrupted (Ctrl-C)" if signum == signal.SIGINT else "Stopped by SIGTERM"
    if during:
        return f"{what} during {during}."
    return (
        f"{what}. Nothing is half-written: a run resumes from its latest checkpoint when the "
        "same command is run again."
    )


def _shown_record(record: logging.LogRecord) -> bool:
    """False for a library's record of a storage failure or of a task orbax abandoned."""
    if record.name == "asyncio" and record.getMessage().startswith("Task exception"):
        return False
    error = record.exc_info[1] if record.exc_info else Exception(record.getMessage())
    return error is None or find_io_failure(error) is None


# After one array of a checkpoint fails, orbax abandons the others: their coroutines raise when
# collected and tensorstore's callbacks find the event loop closed, tracebacks hiding the message.
def _excepthook_without_closed_loop_noise(kind, value, traceback_) -> None:
    if not _closed_loop(value):
        sys.__excepthook__(kind, value, traceback_)


def _unraisablehook_without_abandoned_io_noise(unraisable) -> None:
    if not (_closed_loop(unraisable.exc_value) or inspect.iscoroutine(unraisable.object)):
        sys.__unraisablehook__(unraisable)


def _closed_loop(error: BaseException | None) -> bool:
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


# Failures of the storage itself, not of the program: the fix is outside it.
IO_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS)
# A path in a library's message, quoted (tensorstore: 'Error writing local file "/w/..."').
_QUOTED_PATH = re.compile(r"""["']((?:/|gs://)[^"']+)["']""")


def find_io_failure(error: BaseException) -> tuple[str, str | None] | None:
    """(cause, path or None) of the first storage failure in `error`'s chain, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, RunIOError):
            return error.cause, error.path
        if isinstance(error, OSError) and error.errno in IO_ERRNOS:
            return os.strerror(error.errno), error.filename
        for words in map(os.strerror, IO_ERRNOS):
            if words in str(error):
                path = _QUOTED_PATH.search(str(error))
                return words, path.group(1) if path else None
        error = error.__cause__ or error.__context__
    return None
