"""XLA compiler options for the project's jitted train and evaluation steps.

On CPU, XLA (jaxlib 0.10) hands dots and reductions to YNNPACK library
fusions by default. A library fusion takes only whole arrays as operands, so
whatever XLA would otherwise fuse into its loops is written out first: the
RMSNorm scale broadcast to a full [B, T, D] array in every block, for one.
With those fusions off (`xla_cpu_experimental_ynn_fusion_type` empty) the
steps that use the plain or einsum attention kernel ran as fast or faster on
the 2-core development machine, measured side by side in one process
(`benchmarks/train_step.py --xla_defaults=...`; README, Performance):
jordan_rope's synthetic train step 0.92x the time, RoPE's 1.01x (noise);
before the entry points used huge pages (jrope.train.huge_pages), 0.93 to 0.97x
for both at the synthetic and WikiText shapes and 0.83x for evaluation at
2048. Evaluation through the blockwise kernel at 8192 ran 1.02 to 1.07x
slower without them, so the blockwise path keeps XLA's defaults. Other
backends keep them too (the option names a CPU pass).
"""

from __future__ import annotations

from typing import Any

import jax

# An empty list of library-fusion kinds: XLA's own fused loops and dot thunks only.
_WITHOUT_LIBRARY_FUSIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def step_compiler_options(*, blockwise: bool, platform: str | None = None) -> dict[str, Any]:
    """Options for `jax.jit(..., compiler_options=...)` of a train or evaluation step.

    blockwise: whether the step's attention runs jrope.blockwise_attention.
    platform: the devices' platform ('cpu', 'gpu', 'tpu'); default: JAX's default backend.
    """
    platform = platform or jax.default_backend()
    if platform == "cpu" and not blockwise:
        return dict(_WITHOUT_LIBRARY_FUSIONS)
    return {}
