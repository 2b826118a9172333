"""The runtime options of a run: CPU-only tuning, the compilation cache, the profiler trace."""

import os
import pathlib
import tempfile

import jax
from absl import logging as absl_logging
from etils import epath

from jrope.data.files import is_uri
from jrope.model.projection import ProjectionFn, contract, cpu_projection


def host_allocator() -> str:
    """The host allocator this process started with (docs/performance.md): 'tcmalloc' preloaded,
    'glibc huge pages' (its tunable), or 'glibc'."""
    if "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return "tcmalloc"
    huge_pages = "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "")
    return "glibc" + " huge pages" * huge_pages


def step_compiler_options(*, blockwise: bool, platform: str) -> dict[str, str]:
    """`jax.jit`'s compiler_options for a train or evaluation step on `platform`. XLA:CPU's
    YNNPACK library fusions write out what XLA would fuse: dense steps ran as fast without them."""
    if platform == "cpu" and not blockwise:
        return {"xla_cpu_experimental_ynn_fusion_type": ""}  # no library-fusion kinds
    return {}


def model_projection(platform: str) -> ProjectionFn:
    """The Transformer's projection: on CPU, one whose backward pass has no transposing copy."""
    return cpu_projection if platform == "cpu" else contract


def enable_compilation_cache(cache_dir: str) -> None:
    """Use `cache_dir` (local, gs://; '' for none) as JAX's compilation cache, before compiling."""
    if cache_dir:  # JAX reads a local folder (from this process's folder) or a bucket's URI
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache_dir))
        absl_logging.info("Compilation cache: %s", cache_dir)


class StepTrace:
    """A profiler trace of the train steps `steps` (runtime.profile_from_step to profile_to_step),
    written to `<workdir>/tensorboard` (through a local staging folder for a bucket)."""

    def __init__(self, workdir: epath.PathLike, steps: range):
        self._destination = epath.Path(workdir) / "tensorboard"
        self._steps = steps
        self._staging: tempfile.TemporaryDirectory | None = None
        self._active = False

    def before_step(self, step: int) -> None:
        """Call before dispatching train step `step`."""
        if self._active or step not in self._steps:
            return
        if is_uri(self._destination):
            self._staging = tempfile.TemporaryDirectory(prefix="jrope-profile-")
        jax.profiler.start_trace(self._staging.name if self._staging else str(self._destination))
        self._active = True
        absl_logging.info("Profiling steps %d to %d.", step, self._steps.stop - 1)

    def after_step(self, step: int, state: object) -> None:
        """Call after dispatching train step `step`, with the state it returned."""
        if self._active and step + 1 >= self._steps.stop:
            jax.block_until_ready(state)
            self.close()

    def close(self) -> None:
        """Stops a running trace (also when the loop ends early) and delivers its files."""
        if not self._active:
            return
        self._active = False
        jax.profiler.stop_trace()
        if self._staging is not None:
            staged = pathlib.Path(self._staging.name)
            for path in filter(pathlib.Path.is_file, staged.rglob("*")):
                target = self._destination / str(path.relative_to(staged))
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
            self._staging.cleanup()
        absl_logging.info("Profile: %s/plugins/profile", self._destination)
