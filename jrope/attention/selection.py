"""Which attention kernel runs: one function of the model config, the encoding, the length and the backend.

The model, the run checks, the train step's compiler options and the
evaluation step all ask `choose_kernel`, so they cannot disagree.
"""

from __future__ import annotations

from jrope.model.config import ATTENTION_IMPLS, ModelConfig

# The concrete kernels `choose_kernel` returns.
KERNELS = ("xla", "einsum", "blockwise")


def choose_kernel(
    model_cfg: ModelConfig, *, has_bias: bool, length: int, backend: str | None = None
) -> str:
    """The kernel ('xla', 'einsum' or 'blockwise') for attention over `length` keys.

    model_cfg.attention_impl 'auto' takes blockwise attention from
    model_cfg.blockwise_min_length on and the einsum kernel below it (on CPU
    its train step is faster than xla's; see jrope.attention.dense).
    has_bias: the encoding adds a logit bias (ALiBi), which 'xla' cannot take.
    backend: 'cpu', 'gpu' or 'tpu' (default: JAX's default backend).

    Raises:
      ValueError: the requested kernel cannot run this encoding.
    """
    del backend  # every kernel here runs on every backend
    impl = model_cfg.attention_impl
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"Unknown attention_impl {impl!r}; choose one of {ATTENTION_IMPLS}.")
    if impl == "auto":
        return "blockwise" if length >= model_cfg.blockwise_min_length else "einsum"
    if impl == "xla" and has_bias:
        raise ValueError(
            "attention_impl='xla' cannot add a logit bias; use 'einsum' or 'auto' for ALiBi variants."
        )
    return impl
