"""jrope.command_line (exit statuses and messages, flag mistakes) and jrope.train.runtime (the CPU
tuning, cache and profiler)."""

import errno
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from etils import epath
from helpers import fake_gcs
from helpers.repository import ROOT
from helpers.tiny_config import tiny_config

from jrope import command_line
from jrope.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DataUnavailable,
    JropeError,
    NonFiniteError,
    TrainingPreempted,
    UsageError,
    WorkdirBusy,
)
from jrope.train import runtime, setup
from jrope.train.config import RuntimeConfig
from jrope.train.evaluation import EvalStep
from jrope.train.setup import set_up_run
from jrope.train.trainer import make_train_step, train_and_evaluate


def test_the_runtime_section_defaults_to_off_and_checks_its_steps():
    assert tiny_config().runtime == RuntimeConfig("", 0, 0)
    with pytest.raises(
        ConfigError,
        match=r"runtime\.profile_from_step must be an integer in \[0, 2147483647\], got -1",
    ):
        tiny_config(**{"runtime.profile_from_step": -1})


@pytest.mark.slow
def test_training_traces_the_configured_steps_into_tensorboard(tmp_path):
    cfg = tiny_config(
        **{"mesh.data": -1, "runtime.profile_from_step": 1, "runtime.profile_to_step": 2}
    )
    train_and_evaluate(cfg, str(tmp_path))
    traces = list((tmp_path / "tensorboard" / "plugins" / "profile").glob("*/*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_a_trace_for_a_bucket_is_copied_there_and_nothing_stays_local(monkeypatch, tmp_path):
    fake_gcs.install(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runtime.tempfile, "tempdir", str(tmp_path))  # staging: here, then gone
    trace = runtime.StepTrace("gs://bucket/run", range(3, 4))
    state = jnp.ones(4)
    for step in range(3, 5):
        trace.before_step(step)
        state = jax.jit(lambda x: x * 2)(state)
        trace.after_step(step, state)
    profile = epath.Path("gs://bucket/run/tensorboard/plugins/profile")
    assert [path.name for path in profile.glob("*/*") if path.name.endswith(".xplane.pb")]
    assert fake_gcs.local_entries(tmp_path) == []


@pytest.mark.slow
def test_the_compilation_cache_stores_the_compiled_programs(tmp_path):
    cache = tmp_path / "cache"
    program = textwrap.dedent(
        f"""
        import jax
        from jrope.train import runtime
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        runtime.enable_compilation_cache({str(cache)!r})
        jax.jit(lambda x: x * 2 + 1)(jax.numpy.ones(3)).block_until_ready()
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", program], check=True, env=env, cwd=os.getcwd())
    assert any(cache.iterdir())


@pytest.mark.parametrize(
    "error, status",
    [
        (ConfigError(["a"]), 2),
        (UsageError("--methods is required"), 2),
        (ModuleNotFoundError("No module named 'ml_collections'", name="ml_collections"), 2),
        (DataError(["the text is too short"]), 3),
        (DataUnavailable("WikiText-2 is not available"), 3),
        (CheckpointError("damaged"), 4),
        (NonFiniteError("loss is nan"), 5),
        (WorkdirBusy("another run"), 6),
        (OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl"), 7),
        (OSError(errno.EFBIG, "File too large"), 7),
        (TrainingPreempted(8, "/w/checkpoints/8"), 143),
        (TrainingPreempted(8, "/w/checkpoints/8", signal.SIGINT), 130),
        (ValueError("a bug"), None),
        (ModuleNotFoundError("No module named 'jrope.x'", name="jrope.x"), None),
        (OSError(errno.ENOENT, "No such file or directory", "/x"), None),
        (ValueError("Error writing: No space left on device [os_error_code='28']"), None),
    ],
)
def test_each_kind_of_error_has_its_exit_status(error, status):
    reported = command_line.exit_status(error)
    assert (reported[0] if reported else None) == status
    if isinstance(error, JropeError):
        assert reported[1] == str(error)  # the message alone


def test_a_storage_failure_is_found_as_the_cause_of_a_library_error():
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/w/checkpoints/8/x")
        except OSError as cause:
            raise RuntimeError("Save Finalize thread failed") from cause
    except RuntimeError as wrapped:
        error = wrapped
    assert command_line.exit_status(error) == (
        7,
        "Storage failure writing /w/checkpoints/8/x: No space left on device; free space and run "
        "it again.",
    )


_ABANDONED_READ = """
import ctypes, os
from jrope import command_line
from jrope.errors import CheckpointError

class Pending:
    def __await__(self):
        yield

async def read_array():
    try:
        await Pending()
    finally:  # as a read orbax abandoned after a failed one raises when collected
        raise ValueError("Encountered error while reading array index")

class Abandoned:
    def __del__(self):
        raise RuntimeError("Event loop is closed")

def main(argv):
    main.pending = read_array()
    main.pending.send(None)  # alive until the interpreter's shutdown
    # What tensorstore's threads print (PyErr_Print, or as unraisable) for the reads orbax
    # abandoned.
    ctypes.pythonapi.PyRun_SimpleString(b"raise RuntimeError('Event loop is closed')")
    Abandoned()
    if os.environ.get("A_BUG"):
        raise ZeroDivisionError("a bug")
    raise CheckpointError("Checkpoint 2 cannot be read.")

command_line.run(main)
"""


def test_an_error_ends_the_command_with_its_message_alone_and_its_status():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    failed = subprocess.run(
        [sys.executable, "-c", _ABANDONED_READ], env=env, capture_output=True, text=True
    )
    assert failed.returncode == 4
    assert failed.stderr == "Checkpoint 2 cannot be read.\n"  # no shutdown's tracebacks after it
    bug = subprocess.run(
        [sys.executable, "-c", _ABANDONED_READ],
        env={**env, "A_BUG": "1"},
        capture_output=True,
        text=True,
    )
    assert bug.returncode == 1 and "ZeroDivisionError: a bug" in bug.stderr  # with its traceback


@pytest.mark.parametrize("command", ["jrope.train.__main__", "jrope.eval", "jrope.compare"])
def test_a_command_without_its_extra_says_which_to_install(command):
    # ml_collections absent, as in an install without the 'train' extra.
    code = f"import sys; sys.modules['ml_collections'] = None; import {command} as c; c.run_main()"
    args = ["--config=quickstart", "--workdir=run", "--methods=rope"][
        : 2 + (command == "jrope.compare")
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        "No ml_collections: install the 'train' extra: pip install \".[train]\" in a clone, or "
        "the wheel with [train].\n"
    )
    # --help answers all the same, with the run's flags and the experiments' names.
    helped = subprocess.run(
        [sys.executable, "-c", code, "--help"], env=env, capture_output=True, text=True
    )
    assert helped.returncode == 0, helped.stderr
    assert "--workdir" in helped.stdout and "quickstart, retrieval" in helped.stdout


_GC_SIGINT = """
import gc, os, signal, sys
from jrope import command_line

def main(argv):
    # A Ctrl-C that comes while a gc callback runs, as JAX's (_xla_gc_callback) does.
    gc.callbacks.append(lambda phase, info: phase == "start" and os.kill(os.getpid(), 2))
    gc.collect()
    print("went on")

if sys.argv[1:] == ["--python_handler"]:
    main([])  # Python's handler: the KeyboardInterrupt is raised in the callback, and lost
else:
    command_line.run(main)
"""


def test_ctrl_c_ends_a_command_even_inside_a_library_callback():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    ended = subprocess.run(
        [sys.executable, "-c", _GC_SIGINT], env=env, capture_output=True, text=True
    )
    assert ended.returncode == -signal.SIGINT and "went on" not in ended.stdout  # a shell: 130
    lost = subprocess.run(
        [sys.executable, "-c", _GC_SIGINT, "--python_handler"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert "went on" in lost.stdout and "KeyboardInterrupt" in lost.stderr


def test_help_lists_the_commands_flags_and_exits_0():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    shown = subprocess.run(
        [sys.executable, "train.py", "--help"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert shown.returncode == 0, shown.stderr  # absl's help exits 1
    assert "  --config:" in shown.stdout and "  --workdir:" in shown.stdout
    assert shown.stdout.startswith("Train one model: python -m jrope.train")


# How XLA:CPU names a YNNPACK library fusion in compiled HLO text.
_LIBRARY_FUSION = "__ynn_fusion"


_ON_CPU = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the library fusions are an XLA:CPU pass"
)


@_ON_CPU
def test_default_cpu_compilation_has_library_fusions():
    """The pinned jaxlib fuses a dot and its reduction into a library call by default.

    If this fails, XLA no longer makes them and jrope.train.runtime has nothing left to do.
    """

    def dot_then_max(x, w):
        return jnp.max(jnp.tanh(x @ w), axis=-1)

    x = jnp.ones((64, 64), jnp.float32)
    assert _LIBRARY_FUSION in jax.jit(dot_then_max).lower(x, x).compile().as_text()


@pytest.mark.slow
@_ON_CPU
def test_cpu_train_step_compiles_without_library_fusions():
    cfg = tiny_config()
    run = set_up_run(cfg, devices=jax.devices()[:1])
    state = run.init_state()
    step = make_train_step(run)
    with jax.set_mesh(run.mesh):
        batch = setup.global_batch(run.source.train_batch(0), cfg.mesh.rules, run.mesh)
        text = step.lower(state, batch).compile().as_text()
    assert _LIBRARY_FUSION not in text


def test_eval_step_picks_the_blockwise_compilation_by_length():
    cfg = tiny_config(**{"model.blockwise_min_length": 32, "model.block_size": 16})
    step = EvalStep(set_up_run(cfg, devices=jax.devices()[:1]))
    assert step.for_length(16) is step.for_length(31)
    assert step.for_length(32) is step.for_length(64)
    assert step.for_length(16) is not step.for_length(32)
