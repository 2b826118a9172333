"""What every command shares: `run(main)`, absl's app.run with the project's exit statuses.

The one place errors become exit statuses (the README's table): a project error (jrope.errors)
ends a command with its message alone, a storage failure (full disk, quota, read-only disk, I/O)
with 7, a missing extra or a bad flag with 2; anything else is a bug, with its traceback. SIGTERM
and Ctrl-C end a command at once, but in the train loop (jrope.train.trainer).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable

from absl import app, flags, logging

from jrope import commands
from jrope.errors import JropeError, UsageError
from jrope.fields import did_you_mean, flat_keys

STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS)
_PROCESS_FLAGS = ("multiprocess", "coordinator_address", "num_processes", "process_id")


def define_run_flags(config: str | None = None) -> str | None:
    """--config (an experiment's name or file; default `config`, returned), --workdir, and the
    flags of a multi-process run. An override of a key the config lacks reaches the run's config,
    which names it (jrope.train.config)."""
    about = f"Experiment: a config file, or one of {', '.join(commands.config_names())}."
    try:
        from ml_collections import config_flags
    except ModuleNotFoundError as missing:  # no 'train' extra: --help answers, a run names it
        flags.DEFINE(_MissingExtra(missing), "config", config, about)
    else:
        config_flags.DEFINE_config_file(
            "config", config, about, lock_config=False, accept_new_attributes=True
        )
    flags.DEFINE_string("workdir", None, "The run's directory: checkpoints, logs and results.")
    flags.mark_flags_as_required(["workdir"] + (["config"] if config is None else []))
    flags.DEFINE_bool("multiprocess", False, "Start JAX's distributed runtime (cluster detected).")
    flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's coordinator.")
    flags.DEFINE_integer("num_processes", None, "Number of processes.", lower_bound=1)
    flags.DEFINE_integer("process_id", None, "This process's index.", lower_bound=0)
    flags.register_multi_flags_validator(
        _PROCESS_FLAGS[2:],
        lambda v: None in v.values() or v["process_id"] < v["num_processes"],
        "--process_id must be below --num_processes",
    )
    return config


class _MissingExtra(flags.ArgumentParser):
    """A flag's parser without its package: any value given raises the ModuleNotFoundError."""

    def __init__(self, missing: ModuleNotFoundError):
        self.missing = missing

    def parse(self, argument):
        raise self.missing


def start_processes() -> None:
    """jax.distributed.initialize (gloo on CPU) where the process flags ask for it, before anything
    starts a JAX backend; then logs this process's devices."""
    import jax  # here: a mistake on the command line is told without loading JAX

    multiprocess, *explicit = (flags.FLAGS[name].value for name in _PROCESS_FLAGS)
    if multiprocess or any(value is not None for value in explicit):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(*explicit)
    where = jax.process_index(), jax.process_count(), jax.local_devices(), jax.device_count()
    logging.info("JAX process %d of %d; local devices %s; all devices %d.", *where)


def run(main: Callable[[list[str]], None], define_flags: Callable | None = None) -> None:
    """app.run(main); `define_flags(argv)` defines the flags that depend on argv (and may return
    the default --config)."""
    if "verbose" not in flags.FLAGS:  # (run once more in one process: the tests)
        flags.DEFINE_bool("verbose", False, "On an error, show its traceback too.")
    # Ctrl-C ends the command at once, as SIGTERM does: a KeyboardInterrupt raised inside one of
    # JAX's callbacks would be swallowed, and the command would go on.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.excepthook, sys.unraisablehook = _excepthook, _unraisablehook
    parser = functools.partial(parse_flags, define_flags=define_flags)
    app.run(functools.partial(_run_main, main), flags_parser=parser)


def parse_flags(argv: list[str], define_flags: Callable | None = None) -> list[str]:
    """absl's parsing, --config=<experiment> read as its file, the last of a repeated override
    taken; --help exits 0."""
    argv = sys.argv = last_overrides(commands.with_config_paths(argv))  # ml_collections reads it
    config = flag_argument(argv, "config")
    try:
        default = define_flags(argv) if define_flags else None
        config = config or default
        for name, defined in flags.FLAGS.flags_by_module_dict().items():
            for flag in defined if name.startswith("jrope.") else ():  # absl's --help lists
                flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)  # the main module's
        if config and not os.path.isfile(config.partition(":")[0]):
            names = ", ".join(commands.config_names())
            raise UsageError(f"--config={config} is no config file here, nor one of {names}.")
        commands.make_importable(config)
        argv = flags.FLAGS(argv)
        if config:
            flags.FLAGS.config.keys()  # ml_collections raises a config file's error when read
        return argv
    except SystemExit:  # absl's --help and --helpfull exit 1 after printing: no failure here
        sys.exit(0)
    except Exception as error:  # absl and ml_collections raise many kinds: all mean a bad flag
        _fail(error, *(exit_status(error) or (2, _flag_problem(error, config, argv))))


def last_overrides(argv: list[str]) -> list[str]:
    """argv with only the last --config.<key>=<value> of each key: ml_collections joins the values
    of a tuple key given twice, where the last should win."""
    keys = [arg.partition("=")[0].lstrip("-") if arg.startswith(("--config.", "-config.")) and
            "=" in arg else None for arg in argv]  # fmt: skip
    return [arg for i, arg in enumerate(argv) if not keys[i] or keys[i] not in keys[i + 1 :]]


def flag_argument(argv: list[str], name: str) -> str | None:
    """The value of --<name>=VALUE (or --<name> VALUE) in argv, else None."""
    for arg, following in zip(argv, [*argv[1:], None], strict=True):
        flag, equals, value = arg.partition("=")
        if flag in (f"--{name}", f"-{name}"):
            return value if equals else following
    return None


def _flag_problem(error: BaseException, config: str | None, argv: list[str]) -> str:
    """The flag error in one line: the config file's line where it raised, or an override's
    missing section with the nearest key, or absl's (ml_collections') message."""
    root = error
    while root.__cause__ or root.__context__:
        root = root.__cause__ or root.__context__
    file = config and os.path.abspath(config.partition(":")[0])
    frames = traceback.extract_tb(root.__traceback__)
    if lines := [frame.lineno for frame in frames if os.path.abspath(frame.filename) == file]:
        return f"{config}, line {lines[-1]}: {type(root).__name__}: {root}."  # (SyntaxError too)
    if isinstance(root, KeyError) and config:  # ml_collections: an override's parent is missing
        from ml_collections.config_flags import config_flags

        keys = flat_keys(config_flags.ConfigFileFlagParser("config").parse(config).to_dict())
        for flag in (arg.partition("=")[0].lstrip("-") for arg in argv):
            key = flag.removeprefix("config.") if flag.startswith("config.") else ""
            if "." in key and not any(k.startswith(key.rpartition(".")[0] + ".") for k in keys):
                hint = did_you_mean(key, keys, "--config.") or "; see --help."
                return f"--config.{key}: the config has no section {key.split('.')[0]!r}{hint}"
    return f"{(str(error).strip() or repr(error)).splitlines()[0].rstrip('.')}; see --help."


def exit_status(error: BaseException) -> tuple[int, str] | None:
    """(status, message) of a project error, storage failure or missing extra (or its cause)."""
    while error is not None:
        if isinstance(error, JropeError):
            return error.exit_status, str(error)
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            where = f" writing {error.filename}" if error.filename else ""
            return 7, f"Storage failure{where}: {error.strerror}; free space and run it again."
        if isinstance(error, ModuleNotFoundError) and "jrope" not in str(error.name):
            return (
                2,
                f"No {error.name}: install the 'train' extra: {commands.install_command('train')}.",
            )
        error = error.__cause__
    return None


def _run_main(main: Callable[[list[str]], None], argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:  # -v 0 shows the libraries' info records
        logging.set_verbosity(logging.WARNING)
    try:
        if len(argv) > 1:
            raise UsageError(f"Unexpected arguments {argv[1:]}; flags only.")
        main(argv)
    except Exception as error:
        if (reported := exit_status(error)) is None:
            raise
        _fail(error, *reported)


def _excepthook(kind, error, trace) -> None:
    """Python's, but for the closed event loop that tensorstore's threads report (PyErr_Print, or
    as unraisable) when orbax has abandoned their reads after a failed one: no error of the
    command."""
    if not _closed_loop(error):
        sys.__excepthook__(kind, error, trace)


def _unraisablehook(unraisable) -> None:
    if not _closed_loop(unraisable.exc_value):
        sys.__unraisablehook__(unraisable)


def _closed_loop(error: BaseException | None) -> bool:
    return type(error) is RuntimeError and str(error) == "Event loop is closed"


def _fail(error: BaseException, status: int, message: str) -> None:
    if "verbose" in flags.FLAGS and (flags.FLAGS["verbose"].value or "--verbose" in sys.argv):
        traceback.print_exception(error)
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    # Checkpoints and logs are closed: no shutdown follows, where the reads orbax abandoned after
    # a failed one would print their tracebacks.
    os._exit(status)
