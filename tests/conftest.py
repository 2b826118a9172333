"""Test-wide JAX set-up; runs before any test imports JAX.

Eight fake CPU devices let the sharding tests build a (2, 4) mesh on one
host. Rank promotion raises so that a silent broadcast of mismatched shapes is
a bug, not a result. Most XLA optimizations are off: the tests compile many
tiny programs, and compile time, not run time, dominates them. For the same
reason the test processes share a persistent compilation cache with the
subprocess runs (tests/helpers/train_process.py): many tests compile the same
program in a new function (a train step per call of train_and_evaluate), and
the second compilation loads the first one's executable, so the results stay
bitwise equal.
"""

import os

from helpers import SHARED_COMPILATION_CACHE, TEST_XLA_FLAGS

os.environ["XLA_FLAGS"] = " ".join(
    (os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS, "--xla_force_host_platform_device_count=8")
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must come after the environment is set)

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_disable_most_optimizations", True)

jax.config.update("jax_compilation_cache_dir", SHARED_COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def pytest_addoption(parser):
    parser.addoption(
        "--all-cases",
        action="store_true",
        help="run every case of the encoding and kernel matrices (marked exhaustive), not only "
        "the representative ones",
    )


def pytest_collection_modifyitems(config, items):
    """Leaves out the tests marked `published` unless -m names that marker (the quick start's
    numbers and the install checks take minutes each; .ci/run runs them after the suite), and
    the matrix cases marked `exhaustive` unless --all-cases is given."""
    published = "published" in (config.getoption("markexpr") or "")
    all_cases = config.getoption("--all-cases")
    left_out = {
        item
        for item in items
        if (item.get_closest_marker("published") and not published)
        or (item.get_closest_marker("exhaustive") and not all_cases)
    }
    if left_out:
        config.hook.pytest_deselected(items=list(left_out))
        items[:] = [item for item in items if item not in left_out]
