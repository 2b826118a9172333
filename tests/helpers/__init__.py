"""Shared test helpers: tiny configs and drivers of subprocess runs.

The two settings below are read by conftest.py before JAX is imported, so this
module imports nothing of JAX.
"""

import os
import tempfile

# XLA's CPU compiler without its fusion emitters (the older elemental emitter): the tests compile
# hundreds of small programs and run each a few times, and this compiles them in about 40 % less
# time. Its results can differ from the default compiler's in the last bits, so the published
# checks, which compare with the documents, run without it (test_documented_results.py).
TEST_XLA_FLAGS = "--xla_cpu_use_fusion_emitters=false"


# One compilation cache for every subprocess of a test session and the next: the tiny configs'
# train and evaluation steps are compiled once, not by every run that trains them.
SHARED_COMPILATION_CACHE = os.path.join(
    tempfile.gettempdir(), f"jrope-tests-jax-cache-{os.getuid()}"
)
