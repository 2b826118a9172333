"""The entry points' shared behaviour, in process: exit statuses per kind, messages, overrides."""

import errno
import logging
import sys

import pytest
from absl import app, flags

from jrope.data.wikitext import WikiTextUnavailable
from jrope.train import cli, config_overrides, distributed, io_failures
from jrope.train.checkpointing import NoCheckpointError
from jrope.train.config import ConfigError, DataError
from jrope.train.generation import GenerationRequestError
from jrope.train.metrics import NonFiniteLossError, SkippedTooManySteps
from jrope.train.nonfinite import NonFiniteEvaluationError
from jrope.train.preemption import TrainingPreempted
from jrope.train.resume import CorruptCheckpointError, IncompatibleCheckpointError
from jrope.train.workdir_lock import WorkdirBusy

CONFIG = "--config=tests/helpers/subprocess_run_config.py"


@pytest.mark.parametrize(
    "error, status",
    [
        (ConfigError(["a"]), cli.EXIT_CONFIG),
        (app.UsageError("--methods is required"), cli.EXIT_CONFIG),
        (GenerationRequestError("pass a non-empty --prompt"), cli.EXIT_CONFIG),
        (DataError(["the text is too short"]), cli.EXIT_DATA),
        (WikiTextUnavailable("WikiText-2 is not available"), cli.EXIT_DATA),
        (CorruptCheckpointError("damaged"), cli.EXIT_CHECKPOINT),
        (IncompatibleCheckpointError("other parameters"), cli.EXIT_CHECKPOINT),
        (NoCheckpointError("no checkpoint"), cli.EXIT_CHECKPOINT),
        (NonFiniteLossError("loss is nan"), cli.EXIT_NONFINITE),
        (SkippedTooManySteps("skipped"), cli.EXIT_NONFINITE),
        (NonFiniteEvaluationError("nan evaluation"), cli.EXIT_NONFINITE),
        (WorkdirBusy("another run"), cli.EXIT_WORKDIR_BUSY),
        (io_failures.RunIOError("No space left on device", "/w/m", "none"), cli.EXIT_IO),
        (OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl"), cli.EXIT_IO),
        (TrainingPreempted(8, "/w/checkpoints/8"), cli.EXIT_PREEMPTED),
        (ValueError("a bug"), None),
        (OSError(errno.ENOENT, "No such file or directory", "/x"), None),
    ],
)
def test_each_kind_of_error_has_its_exit_status(error, status):
    assert cli.exit_code(error) == status


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
    assert io_failures.find_io_failure(error) == (
        "No space left on device",
        "/w/checkpoints/8.orbax-checkpoint-tmp/state/d/ab",
    )
    assert cli.exit_code(error) == cli.EXIT_IO
    assert cli.message(error).startswith(
        "Storage failure writing /w/checkpoints/8.orbax-checkpoint-tmp/state/d/ab: "
        "No space left on device."
    )


def test_library_records_of_a_storage_failure_are_hidden():
    def record(message, error=None):
        exc_info = (type(error), error, None) if error else None
        return logging.LogRecord("absl", logging.ERROR, "f.py", 1, message, (), exc_info)

    disk_full = OSError(errno.ENOSPC, "No space left on device")
    assert not cli._hide_storage_failure_records(record("Save thread failed", disk_full))
    assert not cli._hide_storage_failure_records(record("write: File too large [27]"))
    assert cli._hide_storage_failure_records(record("Save thread failed", ValueError("bug")))


def test_the_last_of_repeated_overrides_wins():
    argv = ["train.py", CONFIG, "--config.eval.lengths=(8,)", "--workdir=w"]
    argv += ["--config.eval.lengths=(16,)", "--config.pe.name=rope"]
    assert config_overrides.last_override_wins(argv) == [
        "train.py",
        CONFIG,
        "--workdir=w",
        "--config.eval.lengths=(16,)",
        "--config.pe.name=rope",
    ]


def test_unknown_keys_are_named_with_the_closest_one():
    argv = ["train.py", CONFIG, "--config.pe.nmae=rope", "--config.pe.name=rope"]
    argv += ["--config.opt.lerning_rate=1", "--config.pe.name.x=1", "--config.zzz=1"]
    assert config_overrides.unknown_key_problems(argv) == [
        "--config.pe.nmae: the config has no key 'pe.nmae'; did you mean --config.pe.name?",
        "--config.opt.lerning_rate: the config has no key 'opt.lerning_rate'; "
        "did you mean --config.opt.learning_rate?",
        "--config.pe.name.x: pe.name is a value, not a section; set it with --config.pe.name=...",
        "--config.zzz: the config has no key 'zzz'; the config has batch_size, checkpoint, "
        "data, eval, log, mesh, model, num_steps, opt, pe, runtime, seed.",
    ]
    assert config_overrides.config_file_problem(argv) is None
    assert "no such file" in config_overrides.config_file_problem(["x", "--config=nope.py"])


def test_errors_exit_with_the_message_alone(monkeypatch, capsys):
    # What cli.run sets up around main, undone afterwards.
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)
    if not flags.FLAGS.is_parsed():
        flags.FLAGS(["train.py"], known_only=True)

    def main(argv):
        raise ConfigError(["pe.name = 'x' is not a known encoding; use e.g. rope."])

    with pytest.raises(SystemExit) as exited:
        cli._run_reporting_errors(main, ["train.py"])
    assert exited.value.code == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.startswith("1 problem(s) in the run's config") and "Traceback" not in err
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        cli._run_reporting_errors(lambda argv: 1 / 0, ["train.py"])


def test_the_leftovers_of_a_failed_checkpoint_read_print_nothing(monkeypatch, capsys):
    """After one array fails to read, orbax's other reads are abandoned: silent, not tracebacks."""
    monkeypatch.setattr(sys, "unraisablehook", cli._unraisablehook_without_abandoned_io_noise)

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

    hide = cli._hide_abandoned_task_records
    assert not hide(record("asyncio", "Task exception was never retrieved"))
    assert hide(record("asyncio", "Unclosed client session"))
    assert hide(record("jrope", "Task exception"))


def test_a_process_id_outside_the_processes_is_a_usage_error():
    with pytest.raises(app.UsageError, match=r"number the processes 0 \.\. num_processes - 1"):
        distributed.initialize(num_processes=2, process_id=2)  # before any JAX start-up
