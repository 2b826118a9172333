"""Preemption: on SIGTERM, checkpoint the current step and stop.

Cloud TPU VMs, GKE and most batch schedulers send SIGTERM some time before
they take a machine away. The train loop asks `PreemptionWatch.reached(step)`
once per step; when it answers True the loop saves a checkpoint of that
step, waits for the write to finish and raises `TrainingPreempted`. The next
start of the same command resumes from that checkpoint.

One process: the SIGTERM handler only sets a flag. A Python handler runs
between two bytecodes of the main thread, possibly in the middle of a JAX
call or a checkpoint write, so saving from inside it could deadlock or
corrupt state; the loop does the work at a step boundary instead.

Several processes: every process must save the same step, but the signal
may reach one host only, or the hosts at different steps. JAX's coordination
service (started by `jax.distributed.initialize`) already catches SIGTERM on
every host and agrees on a step all hosts will reach;
`multihost_utils.reached_preemption_sync_point(step)` returns True on every
process at that step. No Python handler is installed then: it would replace
the service's own.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
    """Context manager answering, once per step, whether to checkpoint and stop.

    Use as `with PreemptionWatch() as watch: ... if watch.reached(step): ...`.
    Every process must call `reached` at every step, from the same first step.
    """

    def __init__(self):
        self._requested = False
        self._previous_handler = None
        self._multiprocess = False

    def __enter__(self) -> PreemptionWatch:
        self._multiprocess = jax.process_count() > 1
        # signal.signal works only in the main thread; elsewhere (a library
        # caller's worker thread) SIGTERM keeps its default action.
        if not self._multiprocess and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def reached(self, step: int) -> bool:
        """Whether `step` is the step at which to save and stop."""
        if self._multiprocess:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._requested

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self._requested = True
