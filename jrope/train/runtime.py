"""What every entry point shares (`run(main)`: flags, log level, exit statuses as in docs/runs.md,
signals) and the runtime options: CPU-only tuning, the compilation cache, the profiler trace."""

import errno
import functools
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import pathlib
import pkgutil
import re
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from platform import libc_ver
from types import FrameType

import jax
from absl import app, flags
from absl import logging as absl_logging
from etils import epath

from jrope import command_line
from jrope.data.files import is_uri, resolved
from jrope.errors import ConfigError, JropeError, RunIOError
from jrope.model.projection import ProjectionFn, contract, cpu_projection
from jrope.train import config as run_config

VERBOSE_ENV = "JROPE_VERBOSE"
_PROCESS_FLAGS = ("multiprocess", "coordinator_address", "num_processes")  # setup's flags


def run(main: Callable[[list[str]], None], *, usage: str | None = None) -> None:
    """`app.run(main)` with the project's flag parsing, log level and error reporting; `usage` is
    what --help prints above the flags (default: the main module's docstring)."""
    if not command_line.help_requested(sys.argv):
        restart_with_huge_pages()
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
    parse_flags = functools.partial(_parse_flags, usage=usage)
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


def _parse_flags(argv: list[str], *, usage: str | None) -> list[str]:
    """absl's parsing of argv, with repeated config overrides resolved and mistakes explained."""
    if command_line.help_requested(argv):
        command_line.parse_flags(argv, usage)  # prints the help and exits 0
    # ml_collections reads the overrides from sys.argv itself: it must see the same list.
    argv = sys.argv = run_config.last_override_wins(argv)
    missing_file = run_config.config_file_problem(argv)
    if missing_file:
        _fail(missing_file, ConfigError.exit_status, FileNotFoundError(missing_file), argv)
    run_config.make_importable(run_config.config_argument(argv))
    try:
        return flags.FLAGS(argv)
    except Exception as error:  # absl and ml_collections raise many types: all mean "bad flag"
        own = _project_error(error)  # e.g. eval.py's saved config, damaged
        if own is not None:
            _fail(str(own), own.exit_status, error, argv)
        try:
            problems = run_config.unknown_key_problems(argv)
        except Exception:  # the config file itself fails to load: the error says why
            problems = []
        text = "\n".join(problems) if problems else _config_file_error(error, argv)
        required = re.search(r"Flag --(\w+) must have a value other than None", text)
        if required:
            text = f"--{required[1]} is required; give it a value (--{required[1]}=...)."
        _fail(f"{text}\n(--helpfull lists every flag.)", ConfigError.exit_status, error, argv)


def _project_error(error: BaseException) -> JropeError | None:
    """The first of the project's errors in `error`'s chain, else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, JropeError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def _config_file_error(error: BaseException, argv: list[str]) -> str:
    """absl's first line, or what the config file itself raised, with the file's line."""
    path = run_config.config_argument(argv)
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    config_file = os.path.abspath(path.split(":")[0]) if path else None
    frames = traceback.extract_tb(cause.__traceback__)
    lines = [frame for frame in frames if os.path.abspath(frame.filename) == config_file]
    if not path or (cause is error and not lines):  # absl's own complaint about the flag
        return _first_line(error)
    where = f", line {lines[-1].lineno}: {lines[-1].line}" if lines else ""
    return (
        f"The config file {path} raised {type(cause).__name__}: {_first_line(cause)}{where}. "
        "Fix the file (--verbose shows the traceback)."
    )


def _first_line(error: BaseException) -> str:
    return (str(error).strip() or type(error).__name__).splitlines()[0]


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


TUNABLE = "glibc.malloc.hugetlb"
OPT_OUT = "JROPE_HUGE_PAGES"  # '0': never restart; '1': on any backend; unset: on CPU only


def environment_with_huge_pages(
    environ: Mapping[str, str], glibc: tuple[int, int] | None, thp: str | None, *, cpu_run: bool
) -> dict[str, str] | None:
    """The environment to restart with, or None. glibc: (major, minor); thp: the huge-page mode."""
    choice = environ.get(OPT_OUT, "")
    tunables = environ.get("GLIBC_TUNABLES", "")
    supported = glibc is not None and glibc >= (2, 35) and thp not in (None, "never")
    if choice == "0" or (choice != "1" and not cpu_run) or not supported or TUNABLE in tunables:
        return None
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def _host_support() -> tuple[tuple[int, int] | None, str | None]:
    """This host's glibc version and huge-page mode ('always [madvise] never' -> 'madvise')."""
    numbers = re.match(r"glibc (\d+)\.(\d+)", " ".join(libc_ver()))  # ('glibc', '2.36')
    glibc = (int(numbers[1]), int(numbers[2])) if numbers else None
    mode_file = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    chosen = re.search(r"\[(\w+)\]", mode_file.read_text()) if mode_file.exists() else None
    return glibc, chosen[1] if chosen else None


def runs_on_cpu(environ: Mapping[str, str]) -> bool:
    """Whether JAX will pick its CPU backend: JAX_PLATFORMS, else no TPU or GPU backend is found."""
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if importlib.util.find_spec("libtpu") or importlib.metadata.entry_points(group="jax_plugins"):
        return False
    plugins = importlib.util.find_spec("jax_plugins")
    return plugins is None or not any(pkgutil.iter_modules(plugins.submodule_search_locations))


def restart_with_huge_pages() -> None:
    """Re-executes sys.orig_argv with glibc's huge-page tunable (read only at start) when wanted,
    for XLA:CPU's per-step scratch buffers; call it first. Not off Linux, nor under a debugger."""
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+ debuggers
    debugger = monitoring is not None and monitoring.get_tool(monitoring.DEBUGGER_ID) is not None
    if not sys.platform.startswith("linux") or sys.gettrace() is not None or debugger:
        return
    environ = environment_with_huge_pages(
        os.environ, *_host_support(), cpu_run=runs_on_cpu(os.environ)
    )
    if environ is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def huge_pages_requested() -> bool:
    """Whether this process started with glibc's huge-page option (benchmarks report it)."""
    return f"{TUNABLE}=1" in os.environ.get("GLIBC_TUNABLES", "")


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
