"""Test-wide JAX set-up; runs before any test imports JAX.

Eight fake CPU devices let the sharding tests build a (2, 4) mesh on one
host. Rank promotion raises so that a silent broadcast of mismatched shapes is
a bug, not a result. Most XLA optimizations are off: the tests compile many
tiny programs, and compile time, not run time, dominates them.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after the environment is set)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_disable_most_optimizations", True)
