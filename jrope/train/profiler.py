"""A `jax.profiler` trace of the train steps the config names, into the run's TensorBoard folder.

`runtime.profile_from_step` .. `runtime.profile_to_step` (half open; step s
turns state s into s + 1) are traced: the trace starts before step `from`
is dispatched and stops once step `to - 1` has finished on the device, so
the trace holds whole steps (dispatch is asynchronous: without the wait the
last steps would still be running). A run resumed past `from` traces the
steps of the window it still runs.

The trace lands in `<workdir>/tensorboard/plugins/profile/<run>/`, where
TensorBoard's profile plugin finds it next to the scalars. The profiler
writes through the host's file system, so for a workdir in a bucket it
writes to a local temporary folder and the files are copied to the bucket
through etils.epath when the trace stops.
"""

from __future__ import annotations

import pathlib
import tempfile
from typing import Any

import jax
from absl import logging
from etils import epath

from jrope.data.files import is_uri
from jrope.train.config import RuntimeConfig


class StepTrace:
    """Starts and stops the profiler around the configured steps of a training loop.

    Args:
      workdir: the run's workdir (local or a bucket).
      runtime: the config's runtime section (the step window).
    """

    def __init__(self, workdir: epath.PathLike, runtime: RuntimeConfig):
        self._destination = epath.Path(workdir) / "tensorboard"
        self._window = (runtime.profile_from_step, runtime.profile_to_step)
        self._staging: tempfile.TemporaryDirectory | None = None
        self._active = False

    def before_step(self, step: int) -> None:
        """Call before dispatching train step `step`."""
        start, stop = self._window
        if self._active or not start <= step < stop:
            return
        if is_uri(self._destination):
            self._staging = tempfile.TemporaryDirectory(prefix="jrope-profile-")
            log_dir = self._staging.name
        else:
            log_dir = str(self._destination)
        jax.profiler.start_trace(log_dir)
        self._active = True
        logging.info("Profiling train steps %d to %d.", step, stop - 1)

    def after_step(self, step: int, state: Any) -> None:
        """Call after dispatching train step `step`, with the state it returned."""
        if self._active and step + 1 >= self._window[1]:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stops a running trace (also when the loop ends early) and delivers its files."""
        if not self._active:
            return
        self._active = False
        jax.profiler.stop_trace()
        if self._staging is not None:
            _copy_tree(pathlib.Path(self._staging.name), self._destination)
            self._staging.cleanup()
            self._staging = None
        logging.info("Profile written to %s/plugins/profile.", self._destination)


def _copy_tree(source: pathlib.Path, destination: epath.Path) -> None:
    """Every file under the local folder `source` to the same relative path under `destination`."""
    for path in source.rglob("*"):
        if path.is_file():
            target = destination / str(path.relative_to(source))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
