"""XLA compiler options for the project's jitted train and evaluation steps.

On CPU, XLA hands dots and reductions to YNNPACK library fusions by default.
A library fusion takes only whole arrays as operands, so whatever XLA would
otherwise fuse into its loops is written out first: the RMSNorm scale
broadcast to a full [B, T, D] array in every block, for one. With those
fusions off (`xla_cpu_experimental_ynn_fusion_type` empty) the steps that
use the dense attention kernels ran as fast or faster, while the blockwise
kernel ran slower, so it keeps XLA's defaults (docs/performance.md has the
measurements). Other backends keep them too (the option names a CPU pass).
"""

from __future__ import annotations

from typing import Any

import jax

# An empty list of library-fusion kinds: XLA's own fused loops and dot thunks only.
_WITHOUT_LIBRARY_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def step_compiler_options(*, blockwise: bool, platform: str | None = None) -> dict[str, Any]:
    """Options for `jax.jit(..., compiler_options=...)` of a train or evaluation step.

    blockwise: whether the step's attention runs the blockwise kernel (jrope.attention.blockwise).
    platform: the devices' platform ('cpu', 'gpu', 'tpu'); default: JAX's default backend.
    """
    platform = platform or jax.default_backend()
    if platform == "cpu" and not blockwise:
        return dict(_WITHOUT_LIBRARY_FUSIONS)
    return {}
