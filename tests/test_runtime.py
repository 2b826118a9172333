"""jrope.command_line (exit statuses and messages, flag mistakes) and jrope.train.runtime (the CPU
tuning, cache and profiler)."""

import errno
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from etils import epath
from helpers import fake_gcs
from helpers.tiny_config import tiny_config

from jrope import command_line
from jrope.errors import (
    ConfigError,
    CorruptCheckpointError,
    DataError,
    GenerationRequestError,
    IncompatibleCheckpointError,
    JropeError,
    NoCheckpointError,
    NonFiniteEvaluationError,
    NonFiniteLossError,
    RunIOError,
    SkippedTooManySteps,
    TrainingPreempted,
    UsageError,
    WikiTextUnavailable,
    WorkdirBusy,
)
from jrope.train import runtime, setup
from jrope.train.config import RuntimeConfig
from jrope.train.evaluation import EvalStep
from jrope.train.setup import set_up_run
from jrope.train.trainer import make_train_step, train_and_evaluate


def test_the_runtime_section_defaults_to_off_and_checks_its_steps():
    assert tiny_config().runtime == RuntimeConfig("", 0, 0)
    assert not tiny_config().runtime.profiles
    with pytest.raises(ConfigError, match=r"runtime\.profile_from_step .* must be >= 0"):
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
    trace = runtime.StepTrace("gs://bucket/run", RuntimeConfig("", 3, 4))
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


CONFIG = "--config=tests/helpers/subprocess_run_config.py"


@pytest.mark.parametrize(
    "error, status",
    [
        (ConfigError(["a"]), 2),
        (UsageError("--methods is required"), 2),
        (GenerationRequestError("pass a non-empty --prompt"), 2),
        (DataError(["the text is too short"]), 3),
        (WikiTextUnavailable("WikiText-2 is not available"), 3),
        (CorruptCheckpointError("damaged"), 4),
        (IncompatibleCheckpointError("other parameters"), 4),
        (NoCheckpointError("no checkpoint"), 4),
        (NonFiniteLossError("loss is nan"), 5),
        (SkippedTooManySteps("skipped"), 5),
        (NonFiniteEvaluationError("nan evaluation"), 5),
        (WorkdirBusy("another run"), 6),
        (RunIOError("No space left on device", "/w/m", "none"), 7),
        (OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl"), 7),
        (TrainingPreempted(8, "/w/checkpoints/8"), 143),
        (ValueError("a bug"), None),
        (OSError(errno.ENOENT, "No such file or directory", "/x"), None),
    ],
)
def test_each_kind_of_error_has_its_exit_status(error, status):
    reported = command_line.exit_status(error)
    assert (reported[0] if reported else None) == status
    if isinstance(error, JropeError):
        assert reported[1] == str(error)  # the message alone


def test_a_storage_failure_is_found_in_a_wrapped_library_error():
    # tensorstore's words inside orbax's wrapping, as a full disk gives them.
    inner = ValueError(
        'OUT_OF_RANGE: Error writing local file "/w/checkpoints/8.orbax-checkpoint-tmp/state/d/ab": '
        "Failed to write 626 bytes: No space left on device [os_error_code='28']"
    )
    try:
        try:
            raise inner
        except ValueError as cause:
            raise RuntimeError("Save Finalize thread failed") from cause
    except RuntimeError as wrapped:
        error = wrapped
    assert command_line.find_io_failure(error) == (
        "No space left on device",
        "/w/checkpoints/8.orbax-checkpoint-tmp/state/d/ab",
    )
    status, message = command_line.exit_status(error)
    assert status == 7
    assert message.startswith(
        "Storage failure writing /w/checkpoints/8.orbax-checkpoint-tmp/state/d/ab: "
        "No space left on device."
    )


def test_library_records_of_a_storage_failure_are_hidden():
    def record(message, error=None):
        exc_info = (type(error), error, None) if error else None
        return logging.LogRecord("absl", logging.ERROR, "f.py", 1, message, (), exc_info)

    disk_full = OSError(errno.ENOSPC, "No space left on device")
    assert not command_line._shown_record(record("Save thread failed", disk_full))
    assert not command_line._shown_record(record("write: File too large [27]"))
    assert command_line._shown_record(record("Save thread failed", ValueError("bug")))


def test_errors_exit_with_the_message_alone(monkeypatch, capsys):
    # What command_line.run sets up around main, undone afterwards.
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)

    def main(argv):
        raise ConfigError(["pe.name = 'x' is not a known encoding; use e.g. rope."])

    with pytest.raises(SystemExit) as exited:
        command_line.run(main)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("1 problem(s) in the run's config") and "Traceback" not in err
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        command_line.run(lambda argv: 1 / 0)


def test_the_leftovers_of_a_failed_checkpoint_read_print_nothing(monkeypatch, capsys):
    """After one array fails to read, orbax's other reads are abandoned: silent, not tracebacks."""
    monkeypatch.setattr(
        sys, "unraisablehook", command_line._unraisablehook_without_abandoned_io_noise
    )

    class Pending:
        def __await__(self):
            yield

    async def read_array():
        try:
            await Pending()
        finally:  # closed when collected: raises, as an abandoned read does
            raise ValueError("Encountered error while reading array index")

    abandoned = read_array()
    abandoned.send(None)
    del abandoned
    closed_loop = RuntimeError("Event loop is closed")

    class CallbackAfterTheLoop:
        def __del__(self):
            raise closed_loop

    CallbackAfterTheLoop()
    assert capsys.readouterr().err == ""

    class Bug:
        def __del__(self):
            raise ZeroDivisionError("a bug elsewhere")

    Bug()
    assert "ZeroDivisionError: a bug elsewhere" in capsys.readouterr().err

    def record(name, text):
        return logging.LogRecord(name, logging.ERROR, __file__, 1, text, (), None)

    shown = command_line._shown_record
    assert not shown(record("asyncio", "Task exception was never retrieved"))
    assert shown(record("asyncio", "Unclosed client session"))
    assert shown(record("jrope", "Task exception"))


def test_a_process_id_outside_the_processes_is_a_usage_error():
    with pytest.raises(UsageError, match=r"number the processes 0 \.\. num_processes - 1"):
        command_line.initialize_processes(num_processes=2, process_id=2)  # before any JAX start-up


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
