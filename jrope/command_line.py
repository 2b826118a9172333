"""What every command shares: experiments by name, app.run, the run flags, and the one place an
error becomes its message and exit status (README.md's table)."""

import errno
import functools
import importlib.util
import os
import pathlib
import signal
import sys
import traceback

from absl import app, flags, logging

from jrope.errors import JropeError
from jrope.fields import did_you_mean, flat_keys

_CLONE = pathlib.Path(__file__).resolve().parent.parent
_FOLDERS = (_CLONE / "configs", _CLONE / "jrope/installed_configs/configs")  # a wheel's copy
CONFIGS = next((folder for folder in _FOLDERS if (folder / "base.py").is_file()), None)
EXPERIMENTS = sorted(p.stem for p in CONFIGS.glob("*.py") if p.stem != "base") if CONFIGS else []
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS)
PROCESS_FLAGS = ("multiprocess", "coordinator_address", "num_processes", "process_id")


def command(entry_point: str) -> str:
    """How to run 'train', 'eval' or 'sample' from here: a clone's root has its scripts."""
    in_root = (_CLONE / "train.py").is_file() and pathlib.Path.cwd().resolve() == _CLONE
    return f"python {entry_point}.py" if in_root else f"python -m jrope.{entry_point}"


def install_command(extras: str) -> str:
    return f'pip install ".[{extras}]" in a clone, or the wheel with [{extras}]'


def config_path(value: str) -> str:
    """--config's value with an experiment's name (`quickstart`, `kernel_probe:ARG`) as its file,
    unless a file of that name is here."""
    name, colon, argument = value.partition(":")
    path = CONFIGS and name.isidentifier() and CONFIGS / f"{name}.py"
    found = path and path.is_file() and not pathlib.Path(name).exists()
    return f"{path}{colon}{argument}" if found else value


def make_importable(config: str | None) -> None:
    """The config file's grandparent first on sys.path, for its `from configs import base`."""
    root = config and str(pathlib.Path(config.partition(":")[0]).resolve().parent.parent)
    if root and root not in sys.path:
        sys.path.insert(0, root)


def define_run_flags(config: str | None = None) -> str | None:
    """--config (default `config`, returned), --workdir and the multi-process flags."""
    about = f"Experiment ({', '.join(EXPERIMENTS)}) or config file."
    if importlib.util.find_spec("ml_collections"):  # else --help answers; a run names the extra
        from ml_collections import config_flags

        config_flags.DEFINE_config_file(
            "config", config, about, lock_config=False, accept_new_attributes=True
        )  # a key the config lacks reaches jrope.train.config, which names it
    else:
        flags.DEFINE_string("config", config, about)
    flags.DEFINE_string("workdir", None, "Run folder.")
    flags.mark_flags_as_required(["workdir"] + (["config"] if config is None else []))
    flags.DEFINE_bool("multiprocess", False, "Start jax.distributed.")
    flags.DEFINE_string("coordinator_address", None, "Coordinator HOST:PORT.")
    flags.DEFINE_integer("num_processes", None, "Process count.", lower_bound=1)
    flags.DEFINE_integer("process_id", None, "Process index.", lower_bound=0)
    flags.register_multi_flags_validator(
        PROCESS_FLAGS[2:],
        lambda v: None in v.values() or v["process_id"] < v["num_processes"],
        "--process_id must be below --num_processes",
    )
    return config


def run(main, define_flags=None) -> None:
    """app.run(main) after `define_flags(argv)` defines the flags (and may return --config's
    default). Ctrl-C ends the command at once, as SIGTERM does (the train loop saves first): a
    KeyboardInterrupt raised in one of JAX's callbacks would be lost."""

    # tensorstore's threads report a closed event loop once orbax abandons their reads: no error.
    def closed_loop(error: BaseException | None) -> bool:
        return type(error) is RuntimeError and str(error) == "Event loop is closed"

    flags.DEFINE_bool("verbose", False, "Show tracebacks.")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.excepthook = lambda *error: closed_loop(error[1]) or sys.__excepthook__(*error)
    sys.unraisablehook = lambda hook: closed_loop(hook.exc_value) or sys.__unraisablehook__(hook)
    app.run(functools.partial(_call, main), flags_parser=functools.partial(_parse, define_flags))


def _parse(define_flags, argv: list[str]) -> list[str]:
    """absl's parsing of last_overrides(argv); --help exits 0."""
    argv = sys.argv = last_overrides(argv)  # ml_collections reads sys.argv
    config = flag_argument(argv, "config")
    try:
        default = define_flags(argv) if define_flags else None
        config = config or default
        for name, defined in flags.FLAGS.flags_by_module_dict().items():
            for flag in defined if name.startswith("jrope.") else ():  # absl's --help lists
                flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)  # the main module's
        if config and not os.path.isfile(config.partition(":")[0]):
            _fail(2, f"--config={config} is no config file here, nor one of "
                     f"{', '.join(EXPERIMENTS)}.")  # fmt: skip
        make_importable(config)
        if (argv := flags.FLAGS(argv))[1:]:
            _fail(2, f"Unexpected arguments {argv[1:]}; flags only.")
        return argv
    except SystemExit:  # absl's --help exits 1 after printing: no failure
        sys.exit(0)
    except Exception as error:  # absl and ml_collections raise many kinds: all mean a bad flag
        _fail(*(exit_status(error) or (2, _flag_problem(error, config, argv))), error)


def last_overrides(argv: list[str]) -> list[str]:
    """argv with --config's experiment name as its file, and of each --config.<key>=<value> the
    last alone: ml_collections joins the values of a tuple key given twice."""
    resolved, keys = [], []
    for previous, arg in zip([None, *argv], argv, strict=False):
        flag, equals, value = arg.partition("=")
        if flag in ("--config", "-config"):
            arg = f"{flag}{equals}{config_path(value)}"
        elif previous in ("--config", "-config"):
            arg = config_path(arg)
        resolved.append(arg)
        override = equals and flag.startswith(("--config.", "-config."))
        keys.append(flag.lstrip("-") if override else None)
    return [arg for i, arg in enumerate(resolved) if not keys[i] or keys[i] not in keys[i + 1 :]]


def flag_argument(argv: list[str], name: str) -> str | None:
    """The value of the last --<name>=VALUE (or --<name> VALUE) in argv, as absl takes it."""
    found = None
    for arg, following in zip(argv, [*argv[1:], None], strict=True):
        flag, equals, value = arg.partition("=")
        if flag in (f"--{name}", f"-{name}"):
            found = value if equals else following
    return found


def _flag_problem(error: BaseException, config: str | None, argv: list[str]) -> str:
    """In one line: the config file's line that raised, a missing section's nearest key, or absl's."""
    root = error
    while root.__cause__ or root.__context__:
        root = root.__cause__ or root.__context__
    file = config and os.path.abspath(config.partition(":")[0])
    frames = traceback.extract_tb(root.__traceback__)
    if lines := [frame.lineno for frame in frames if os.path.abspath(frame.filename) == file]:
        return f"{config}, line {lines[-1]}: {type(root).__name__}: {root}."  # (SyntaxError too)
    if isinstance(root, KeyError) and config:  # ml_collections: an override's section is missing
        from ml_collections.config_flags import config_flags

        keys = flat_keys(config_flags.ConfigFileFlagParser("config").parse(config).to_dict())
        for key in (arg.partition("=")[0].lstrip("-").removeprefix("config.") for arg in argv):
            if root.args[0] in key.split(".")[:-1]:
                hint = did_you_mean(key, keys, "--config.") or "; see --help."
                return f"--config.{key}: the config has no section {root.args[0]!r}{hint}"
    return f"{(str(error).strip() or repr(error)).splitlines()[0].rstrip('.')}; see --help."


def exit_status(error: BaseException | None) -> tuple[int, str] | None:
    """(status, message) of a project error, storage failure or missing extra (or its cause)."""
    while error is not None:
        if isinstance(error, JropeError):
            return error.exit_status, str(error)
        if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
            where = f" writing {error.filename}" if error.filename else ""
            return 7, f"Storage failure{where}: {error.strerror}; free space and run it again."
        if isinstance(error, ModuleNotFoundError) and "jrope" not in str(error.name):
            return 2, f"No {error.name}: install the 'train' extra: {install_command('train')}."
        error = error.__cause__
    return None


def _call(main, argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:  # -v 0 shows the libraries' info records
        logging.set_verbosity(logging.WARNING)
    if "multiprocess" in flags.FLAGS:  # before any JAX backend starts
        import jax  # here: a flag mistake is told without loading JAX

        multiprocess, *explicit = (flags.FLAGS[name].value for name in PROCESS_FLAGS)
        if multiprocess or any(value is not None for value in explicit):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(*explicit)
        where = jax.process_index(), jax.process_count(), jax.local_devices(), jax.device_count()
        logging.info("JAX process %d of %d; local devices %s; all devices %d.", *where)
    try:
        main(argv)
    except Exception as error:
        _fail(*(exit_status(error) or (1, "")), error)  # "": a bug, told by its traceback


def _fail(status: int, message: str, error: BaseException | None = None) -> None:
    """Ends the command (a traceback too for a bug or --verbose); no shutdown: the reads orbax
    abandoned would print their tracebacks."""
    if error and (not message or "--verbose" in sys.argv or flags.FLAGS["verbose"].value):
        traceback.print_exception(error)
    sys.stdout.flush()
    print(message, file=sys.stderr, end="\n" if message else "", flush=True)
    os._exit(status)
