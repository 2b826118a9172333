"""The project's errors, each with its exit status (README.md's table) and its whole message."""

import signal


class JropeError(Exception):
    exit_status = 1  # a failure the user can fix; str(error) is the whole message


class UsageError(JropeError, ValueError):
    exit_status = 2  # a command line, setting or install that cannot run


class ConfigError(UsageError):
    def __init__(self, problems):  # every problem found, each naming its key and the fix
        self.problems = tuple(problems)
        lines = "\n".join("  - " + problem.replace("\n", "\n    ") for problem in self.problems)
        super().__init__(f"Found before compiling (docs/runs.md):\n{lines}")


class DataError(ConfigError):
    exit_status = 3  # every problem found before compiling is the data's


class DataUnavailable(JropeError, FileNotFoundError):
    exit_status = 3  # a data set is neither prepared nor on disk


class CheckpointError(JropeError, RuntimeError):
    exit_status = 4  # missing, damaged, or of settings this run may not change


class NonFiniteError(JropeError, FloatingPointError):
    exit_status = 5  # a NaN or infinite loss, gradient norm or evaluation; skips in a row


class WorkdirBusy(JropeError, RuntimeError):
    exit_status = 6  # another run holds the workdir's lock


class TrainingPreempted(JropeError):
    def __init__(self, step: int, checkpoint_path: str, signum: int = signal.SIGTERM):
        self.step, self.exit_status = step, 128 + signum  # a shell's status for the signal
        what = "Interrupted (Ctrl-C)" if signum == signal.SIGINT else "Preempted (SIGTERM)"
        super().__init__(f"{what} at step {step}: saved {checkpoint_path}; run again to resume.")
