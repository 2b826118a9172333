"""The project's errors: each one's message says what went wrong and how to fix it.

Every error inherits `JropeError`, whose class attribute `exit_status` is the
status a command ends with when the error reaches it (the README's table);
the entry points print the message alone (jrope.command_line). An error that
is also a built-in kind (ValueError, FileNotFoundError, ...) inherits that
too, so code that catches the built-in keeps working. This module imports
nothing of the project, so any layer may raise these.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence


class JropeError(Exception):
    """A failure the user can fix; `str(error)` is the whole message."""

    exit_status: int = 1


class UsageError(JropeError, ValueError):
    """A command line that cannot run (a missing or contradictory flag)."""

    exit_status = 2


class ConfigError(JropeError, ValueError):
    """Every problem found in a run's config, one per line, each naming its key and the fix."""

    exit_status = 2

    def __init__(self, problems: Sequence[str]):
        self.problems = tuple(problems)
        # A problem of several lines (the data's directions) keeps them indented under its dash.
        lines = "\n".join("  - " + problem.replace("\n", "\n    ") for problem in self.problems)
        super().__init__(
            f"{len(self.problems)} problem(s) in the run's config, found before compiling (see "
            f"docs/runs.md):\n{lines}"
        )


class GenerationRequestError(UsageError):
    """Settings or prompts that cannot be generated from; the message names the flag and its fix."""


class GenerationError(UsageError):
    """A workdir that holds nothing to generate text from; the message says what to use instead."""


class AudioExtraMissing(JropeError, ImportError):
    """soundfile or soxr, the optional 'audio' dependencies, are not installed."""

    exit_status = 2


class DataError(ConfigError):
    """Every problem found before compiling, all of them with the run's data (absent, too short)."""

    exit_status = 3


class DataUnavailable(JropeError, FileNotFoundError):
    """A data set is neither prepared nor on disk; the message says how to get it."""

    exit_status = 3


class WikiTextUnavailable(DataUnavailable):
    """A WikiText dataset is neither prepared, nor on disk, nor downloadable from here."""


class AudioDataUnavailable(DataUnavailable):
    """The folder of WAV files to prepare is missing or holds none."""


class CheckpointError(JropeError):
    """A checkpoint is missing, damaged or of other parameters."""

    exit_status = 4


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """The workdir holds no finished checkpoint of the step asked for."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """The checkpoint was written by a run whose parameters differ from this config's."""


class CorruptCheckpointError(CheckpointError, RuntimeError):
    """The checkpoint cannot be read (truncated, missing or damaged files)."""


class NonFiniteError(JropeError, FloatingPointError):
    """A NaN or infinite loss, gradient norm or evaluation."""

    exit_status = 5


class NonFiniteLossError(NonFiniteError):
    """A training step produced a NaN or infinite loss or gradient norm."""


class SkippedTooManySteps(NonFiniteLossError):
    """opt.nonfinite = 'skip' met opt.max_consecutive_skips non-finite steps in a row."""


class NonFiniteEvaluationError(NonFiniteError):
    """An evaluation's loss is NaN or infinite."""


class WorkdirBusy(JropeError, RuntimeError):
    """Another run holds the workdir's lock."""

    exit_status = 6


class RunIOError(JropeError, OSError):
    """A storage failure during a run, with what the run had saved before it."""

    exit_status = 7

    def __init__(self, cause: str, path: str | None, last_checkpoint: str):
        self.cause, self.path = cause, path
        where = f" writing {path}" if path else ""
        super().__init__(
            f"Storage failure{where}: {cause}. The last good checkpoint is {last_checkpoint}; "
            "nothing was deleted. Free space (or choose a --workdir on another disk) and run the "
            "same command again to resume from it."
        )


class TrainingPreempted(JropeError):
    """Raised by the train loop after it saved a checkpoint on SIGTERM or SIGINT (Ctrl-C)."""

    # What a shell reports for a process ended by the signal: a scheduler sees "terminated".
    exit_status = 128 + signal.SIGTERM

    def __init__(self, step: int, checkpoint_path: str, signum: int = signal.SIGTERM):
        self.step = step
        self.checkpoint_path = checkpoint_path
        self.exit_status = 128 + signum
        what = "Interrupted (Ctrl-C)" if signum == signal.SIGINT else "Preempted (SIGTERM)"
        super().__init__(
            f"{what} at step {step}: checkpoint saved to {checkpoint_path}. "
            "Run the same command again to resume from it."
        )
