"""The model's own configuration: shape and numerics of the decoder-only Transformer."""

from __future__ import annotations

import dataclasses

from jrope.attention.settings import (
    ATTENTION_IMPLS,
    ATTENTION_PRECISIONS,
    MATMUL_PRECISIONS,
    AttentionSettings,
)
from jrope.fields import PARAMETERS, Declared, setting

COMPUTE_DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots_saveable")
READOUTS = ("all", "last")


@dataclasses.dataclass(frozen=True)
class ModelConfig(Declared):
    """Decoder-only Transformer shape and numerics (the vocabulary comes from the data)."""

    section = "model"

    d_model: int = setting(ge=1, defines=PARAMETERS)
    num_heads: int = setting(ge=1, divides="d_model", defines=PARAMETERS)
    num_layers: int = setting(ge=1, defines=PARAMETERS)
    mlp_ratio: int = setting(ge=1, defines=PARAMETERS)
    # Activations and matmuls; parameters are always float32.
    compute_dtype: str = setting(choices=COMPUTE_DTYPES)
    attention_impl: str = setting(choices=ATTENTION_IMPLS)  # jrope.attention.choose_kernel
    # 'auto' switches to blockwise attention at this length and above.
    blockwise_min_length: int = setting(ge=1)
    block_size: int = setting(ge=1)  # query/key block length of blockwise attention
    remat: str = setting(choices=REMAT_POLICIES)  # applied per Transformer block
    # 'last': the final block computes queries, MLP and logits at the last
    # position only (for tasks whose loss weights are zero elsewhere).
    readout: str = setting("all", choices=READOUTS)
    # Residual dropout on each block's attention and MLP outputs (0: none, the paper's setting).
    dropout_rate: float = setting(0.0, ge=0.0, lt=1.0)
    # Precision of the attention's q.k and p.v dots: 'auto' is full float32 for
    # encodings whose logits cancel large products (Encoding.dot_precision), the
    # backend's default otherwise (docs/numerics.md, section 4).
    attention_precision: str = setting("auto", choices=ATTENTION_PRECISIONS)
    # Precision of every other matmul (projections, MLP, output logits).
    matmul_precision: str = setting("default", choices=MATMUL_PRECISIONS)
    # The largest learned damping gamma that 'auto' plans for: attention that maps
    # all S keys from one origin is taken only while max_damping * S <= 80
    # (jrope.attention.selection); longer windows go blockwise.
    max_damping: float = setting(0.02, gt=0.0)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def attention(self) -> AttentionSettings:
        """The attention kernels' share of these settings (jrope.attention takes no ModelConfig)."""
        names = [field.name for field in dataclasses.fields(AttentionSettings)]
        return AttentionSettings(**{name: getattr(self, name) for name in names})
