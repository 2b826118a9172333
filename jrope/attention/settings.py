"""What the attention kernels need to know of the model: a small settings object of their own.

The kernel choice (jrope.attention.selection) and the dots' precision
(jrope.attention.precision) read these fields and nothing else, so the
attention package depends on no model code; the Transformer's ModelConfig
hands its share over as `ModelConfig.attention`.
"""

from __future__ import annotations

import dataclasses

# The values of attention_impl: a kernel, or 'auto' for choose_kernel's choice.
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "splash", "blockwise", "einsum", "shear", "shear_flash")
# Dot precisions (jax.lax.Precision names); 'auto' lets the encoding and the kernel decide.
ATTENTION_PRECISIONS = ("auto", "default", "high", "highest")
MATMUL_PRECISIONS = ("default", "high", "highest")


@dataclasses.dataclass(frozen=True)
class AttentionSettings:
    """The attention's settings: the fields of the same names of jrope.model.config.ModelConfig,
    which says what each means."""

    head_dim: int  # H, the width of one head (ModelConfig.head_dim)
    compute_dtype: str = "float32"
    attention_impl: str = "auto"
    blockwise_min_length: int = 4096
    block_size: int = 512
    max_damping: float = 0.02
    attention_precision: str = "auto"
    matmul_precision: str = "default"
