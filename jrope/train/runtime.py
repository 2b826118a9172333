"""What every entry point shares (`run(main)`: flags, log level, exit statuses as in docs/runs.md,
signals) and the runtime options: CPU-only tuning, the compilation cache, the profiler trace."""

import errno
import functools
import inspect
import logging
import os
import pathlib
import re
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import FrameType

import jax
from absl import app, flags
from absl import logging as absl_logging
from etils import epath

from jrope import command_line, commands
from jrope.data.files import is_uri, resolved
from jrope.errors import ConfigError, JropeError, RunIOError
from jrope.model.projection import ProjectionFn, contract, cpu_projection
from jrope.train import config as run_config

VERBOSE_ENV = "JROPE_VERBOSE"
_PROCESS_FLAGS = ("multiprocess", "coordinator_address", "num_processes")  # setup's flags


def run(main: Callable[[list[str]], None], *, usage: str | None = None) -> None:
    """`app.run(main)` with the project's flag parsing, log level and error reporting; `usage` is
    what --help prints above the flags (default: the main module's docstring)."""
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
    parse_flags = functools.partial(_parse_flags, usage=usage, command_module=command_module)
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


def _parse_flags(argv: list[str], *, usage: str | None, command_module: str | None) -> list[str]:
    """absl's parsing of argv; a bad flag or config file ends with absl's (or the config file's)
    own message on one line, status 2."""
    if command_line.help_requested(argv):
        command_line.parse_flags(argv, usage, command_module)  # prints the help and exits 0
    # --config=quickstart names an experiment: its file's path instead. ml_collections reads the
    # overrides from sys.argv itself, so it gets the same list.
    argv = sys.argv = commands.with_config_paths(argv)
    missing = _missing_config_file(run_config.config_argument(argv))
    if missing:
        _fail(missing, ConfigError.exit_status, FileNotFoundError(missing), argv)
    run_config.make_importable(run_config.config_argument(argv))
    try:
        argv = flags.FLAGS(argv)
        if "config" in flags.FLAGS and flags.FLAGS.config is not None:
            flags.FLAGS.config.keys()  # ml_collections raises a config file's error only when read
        return argv
    except Exception as error:  # absl and ml_collections raise many types: all mean "bad flag"
        own = _project_error(error)  # e.g. eval.py's saved config, damaged
        if own is not None:
            _fail(str(own), own.exit_status, error, argv)
        text = _config_file_error(error, run_config.config_argument(argv))
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
        command_line.keep_stdout_for_results()  # Gloo's connection lines are no results
    if not _verbose():
        for handler in logging.getLogger().handlers:
            handler.addFilter(_shown_record)
        sys.excepthook = _excepthook_without_closed_loop_noise
        sys.unraisablehook = _unraisablehook_without_abandoned_io_noise
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_at_a_safe_point)
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


def huge_pages_requested() -> bool:
    """Whether this process started with glibc's huge-page option (docs/performance.md)."""
    return "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")


def step_compiler_options(*, blockwise: bool, platform: str) -> dict[str, str]:
    """`jax.jit`'s compiler_options for a train or evaluation step on `platform`. XLA:CPU's
    YNNPACK library fusions write out what XLA would fuse: dense steps ran as fast without them."""
    if platform == "cpu" and not blockwise:
        return {"xla_cpu_experimental_ynn_fusion_type": ""}  # no library-fusion kinds
    return {}


def model_projection(platform: str) -> ProjectionFn:
    """The Transformer's projection: on CPU, one whose backward pass has no transposing copy."""
    return cpu_projection if platform == "cpu" else contract


def enable_compilation_cache(cache_dir: str) -> None:
    """Use `cache_dir` (local, gs://; '' for none) as JAX's compilation cache, before compiling."""
    if cache_dir:
        location = str(resolved(cache_dir))
        jax.config.update("jax_compilation_cache_dir", location)
        absl_logging.info("Persistent compilation cache: %s", location)


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


class StepTrace:
    """A profiler trace of the steps runtime.profile_from_step <= step < profile_to_step, written
    to `<workdir>/tensorboard` (through a local staging folder for a bucket)."""

    def __init__(self, workdir: epath.PathLike, runtime: run_config.RuntimeConfig):
        self._destination = epath.Path(workdir) / "tensorboard"
        self._steps = range(runtime.profile_from_step, runtime.profile_to_step)
        self._staging: tempfile.TemporaryDirectory | None = None
        self._active = False

    def before_step(self, step: int) -> None:
        """Call before dispatching train step `step`."""
        if self._active or step not in self._steps:
            return
        if is_uri(self._destination):
            self._staging = tempfile.TemporaryDirectory(prefix="jrope-profile-")
        jax.profiler.start_trace(self._staging.name if self._staging else str(self._destination))
        self._active = True
        absl_logging.info("Profiling train steps %d to %d.", step, self._steps.stop - 1)

    def after_step(self, step: int, state: object) -> None:
        """Call after dispatching train step `step`, with the state it returned."""
        if self._active and step + 1 >= self._steps.stop:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stops a running trace (also when the loop ends early) and delivers its files."""
        if not self._active:
            return
        self._active = False
        jax.profiler.stop_trace()
        if self._staging is not None:
            staged = pathlib.Path(self._staging.name)
            for path in filter(pathlib.Path.is_file, staged.rglob("*")):
                target = self._destination / str(path.relative_to(staged))
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
            self._staging.cleanup()
        absl_logging.info("Profile written to %s/plugins/profile.", self._destination)
