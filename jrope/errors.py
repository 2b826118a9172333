"""The project's errors, each with the exit status a command ends with (the README's table) and
the built-in kind it also is; a command prints the message alone (jrope.command_line)."""

from __future__ import annotations

import signal
from collections.abc import Sequence


class JropeError(Exception):
    """A failure the user can fix; `str(error)` is the whole message."""

    exit_status: int = 1


class UsageError(JropeError, ValueError):
    """A command line that cannot run."""

    exit_status = 2


class ConfigError(JropeError, ValueError):
    """Every problem found in a config, one per line, each naming its key and the fix."""

    exit_status = 2

    def __init__(self, problems: Sequence[str]):
        self.problems = tuple(problems)
        lines = "\n".join("  - " + problem.replace("\n", "\n    ") for problem in self.problems)
        super().__init__(f"Found before compiling (docs/runs.md):\n{lines}")


class GenerationRequestError(UsageError):
    """Settings or prompts that cannot be generated from."""


class AudioExtraMissing(JropeError, ImportError):
    """soundfile or soxr, the optional 'audio' dependencies, are not installed."""

    exit_status = 2


class DataError(ConfigError):
    """Every problem found before compiling, all of them with the run's data."""

    exit_status = 3


class DataUnavailable(JropeError, FileNotFoundError):
    """A data set is neither prepared nor on disk."""

    exit_status = 3


class WikiTextUnavailable(DataUnavailable):
    """A WikiText dataset is neither prepared, nor on disk, nor downloadable from here."""


class AudioDataUnavailable(DataUnavailable):
    """The folder of WAV files to prepare is missing or holds none."""


class CheckpointError(JropeError, RuntimeError):
    """A checkpoint that is missing, damaged, or of settings this run may not change."""

    exit_status = 4


class NonFiniteError(JropeError, FloatingPointError):
    """A NaN or infinite loss, gradient norm or evaluation; or too many skipped steps in a row."""

    exit_status = 5


class WorkdirBusy(JropeError, RuntimeError):
    """Another run holds the workdir's lock."""

    exit_status = 6


class TrainingPreempted(JropeError):
    """The train loop saved its step on SIGTERM or Ctrl-C; the status is a shell's for the signal."""

    def __init__(self, step: int, checkpoint_path: str, signum: int = signal.SIGTERM):
        self.step, self.exit_status = step, 128 + signum
        what = "Interrupted (Ctrl-C)" if signum == signal.SIGINT else "Preempted (SIGTERM)"
        super().__init__(f"{what} at step {step}: saved {checkpoint_path}; run again to resume.")
