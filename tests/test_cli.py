"""The entry points' shared behaviour, in process: exit statuses per kind, messages, overrides."""

import errno
import logging
import sys

import pytest
from absl import flags

from jrope.errors import (
    ConfigError,
    CorruptCheckpointError,
    DataError,
    GenerationRequestError,
    IncompatibleCheckpointError,
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
from jrope.train import cli, config_overrides, distributed, io_failures

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
    assert cli.exit_code(error) == 7
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
    assert exited.value.code == 2
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
    with pytest.raises(UsageError, match=r"number the processes 0 \.\. num_processes - 1"):
        distributed.initialize(num_processes=2, process_id=2)  # before any JAX start-up
