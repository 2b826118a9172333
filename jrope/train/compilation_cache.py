"""JAX's persistent compilation cache, switched on from the run config.

Compiling the train step and one evaluation step per length takes tens of
seconds on a TPU host and more for long lengths; every restart (a resumed
preemptible VM, an evaluation after training, each host of a pod) pays it
again. With `runtime.compilation_cache_dir` set, JAX keeps the compiled
executables there, keyed by the program, the compiler options and the
devices, and a later process with the same program loads them instead.
The folder may be local or a bucket (`gs://...`; JAX reads it through
etils.epath), so the hosts of a pod slice can share it. JAX's own
thresholds apply: programs that compile in under a second are not stored.

JAX sets the cache up at the first compilation of a process, so `enable`
must run before anything is compiled.
"""

from __future__ import annotations

import jax
from absl import logging

from jrope.data.files import resolved


def enable(cache_dir: str) -> None:
    """Use `cache_dir` (local or gs://...) as JAX's persistent compilation cache; '' leaves it off."""
    if not cache_dir:
        return
    location = str(resolved(cache_dir))
    jax.config.update("jax_compilation_cache_dir", location)
    logging.info("Persistent compilation cache: %s", location)
