"""The model's own configuration: shape and numerics of the decoder-only Transformer."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jrope.attention.settings import (
    ATTENTION_IMPLS,
    ATTENTION_PRECISIONS,
    MATMUL_PRECISIONS,
    AttentionSettings,
)

COMPUTE_DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots_saveable")
READOUTS = ("all", "last")


class ConfigSection:
    """A frozen config section: building one with a problem raises ValueError, a line each.

    `rules`: (key, its check as a plain comparison, what the value must be, or a tuple of
    its choices); a section adds to `problems` what a rule cannot say (e.g. two keys).
    """

    section: ClassVar[str] = ""

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError("\n".join(problems))

    def rules(self) -> list[tuple[str, bool, str | tuple]]:
        return []

    def problems(self) -> list[str]:
        """Every problem of this section, one line each naming its key (empty when valid)."""
        problems = []
        for key, holds, required in self.rules():
            value = getattr(self, key)
            if not holds and isinstance(required, tuple):
                problems.append(f"{self.section}.{key} = {value!r} is not one of {required}.")
            elif not holds:
                problems.append(f"{self.section}.{key} must be {required}, got {value}.")
        return problems


@dataclasses.dataclass(frozen=True)
class ModelConfig(ConfigSection):
    """Decoder-only Transformer shape and numerics (the vocabulary comes from the data)."""

    section = "model"

    d_model: int
    num_heads: int
    num_layers: int
    mlp_ratio: int
    compute_dtype: str  # activations and matmuls; parameters are always float32
    attention_impl: str  # one of ATTENTION_IMPLS (jrope.attention.choose_kernel)
    blockwise_min_length: int  # 'auto' switches to blockwise attention at this length and above
    block_size: int  # query/key block length of blockwise attention
    remat: str  # one of REMAT_POLICIES, applied per Transformer block
    # 'last': the final block computes queries, MLP and logits at the last
    # position only (for tasks whose loss weights are zero elsewhere).
    readout: str = "all"
    # Residual dropout on each block's attention and MLP outputs (0: none, the paper's setting).
    dropout_rate: float = 0.0
    # Precision of the attention's q.k and p.v dots: 'auto' is full float32 for
    # encodings whose logits cancel large products (Encoding.dot_precision), the
    # backend's default otherwise (docs/numerics.md, section 4).
    attention_precision: str = "auto"
    # Precision of every other matmul (projections, MLP, output logits).
    matmul_precision: str = "default"
    # The largest learned damping gamma that 'auto' plans for: attention that maps
    # all S keys from one origin is taken only while max_damping * S <= 80
    # (jrope.attention.selection); longer windows go blockwise.
    max_damping: float = 0.02

    def rules(self):
        return [
            ("d_model", self.d_model >= 1, ">= 1"),
            ("num_heads", self.num_heads >= 1, ">= 1"),
            ("num_layers", self.num_layers >= 1, ">= 1"),
            ("mlp_ratio", self.mlp_ratio >= 1, ">= 1"),
            ("blockwise_min_length", self.blockwise_min_length >= 1, ">= 1"),
            ("block_size", self.block_size >= 1, ">= 1"),
            ("compute_dtype", self.compute_dtype in COMPUTE_DTYPES, COMPUTE_DTYPES),
            ("attention_impl", self.attention_impl in ATTENTION_IMPLS, ATTENTION_IMPLS),
            ("remat", self.remat in REMAT_POLICIES, REMAT_POLICIES),
            ("readout", self.readout in READOUTS, READOUTS),
            (
                "attention_precision",
                self.attention_precision in ATTENTION_PRECISIONS,
                ATTENTION_PRECISIONS,
            ),
            ("matmul_precision", self.matmul_precision in MATMUL_PRECISIONS, MATMUL_PRECISIONS),
            ("dropout_rate", 0.0 <= self.dropout_rate < 1.0, "in [0, 1)"),
            ("max_damping", self.max_damping > 0.0, "> 0"),
        ]

    def problems(self) -> list[str]:
        problems = super().problems()
        if self.num_heads >= 1 and self.d_model % self.num_heads:
            problems.append(
                f"model: d_model {self.d_model} must be a multiple of num_heads "
                f"{self.num_heads}; change one of them."
            )
        return problems

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def attention(self) -> AttentionSettings:
        """The attention kernels' share of these settings (jrope.attention takes no ModelConfig)."""
        names = [field.name for field in dataclasses.fields(AttentionSettings)]
        return AttentionSettings(**{name: getattr(self, name) for name in names})
