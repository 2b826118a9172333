"""The model's own configuration: shape and numerics of the decoder-only Transformer."""

from __future__ import annotations

import dataclasses

from jrope.attention.selection import ATTENTION_IMPLS

COMPUTE_DTYPES = ("float32", "bfloat16")
# Dot precisions (jax.lax.Precision names); 'auto' lets the encoding decide
# (jrope.attention.precision).
ATTENTION_PRECISIONS = ("auto", "default", "high", "highest")
MATMUL_PRECISIONS = ("default", "high", "highest")
REMAT_POLICIES = ("none", "full", "dots_saveable")
READOUTS = ("all", "last")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only Transformer shape and numerics (the vocabulary comes from the data).

    Every check raises ValueError naming the `model.` key and the fix.
    """

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

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ValueError("\n".join(problems))

    def problems(self) -> list[str]:
        """Every problem of this section, one line each (empty when valid)."""
        problems = []
        for name in (
            "d_model",
            "num_heads",
            "num_layers",
            "mlp_ratio",
            "blockwise_min_length",
            "block_size",
        ):
            if getattr(self, name) < 1:
                problems.append(f"model.{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_heads >= 1 and self.d_model % self.num_heads:
            problems.append(
                f"model: d_model {self.d_model} must be a multiple of num_heads "
                f"{self.num_heads}; change one of them."
            )
        for name, choices in (
            ("compute_dtype", COMPUTE_DTYPES),
            ("attention_impl", ATTENTION_IMPLS),
            ("remat", REMAT_POLICIES),
            ("readout", READOUTS),
            ("attention_precision", ATTENTION_PRECISIONS),
            ("matmul_precision", MATMUL_PRECISIONS),
        ):
            if getattr(self, name) not in choices:
                problems.append(f"model.{name} = {getattr(self, name)!r} is not one of {choices}.")
        if not 0.0 <= self.dropout_rate < 1.0:
            problems.append(f"model.dropout_rate must be in [0, 1), got {self.dropout_rate}.")
        if not self.max_damping > 0.0:
            problems.append(f"model.max_damping must be > 0, got {self.max_damping}.")
        return problems

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads
