"""The precision of the model's dots: float32 where an encoding's exactness needs it.

On TPU a float32 dot without a precision runs as bfloat16 passes, and on
recent NVIDIA GPUs as TF32: for encodings whose logits are differences of
large products (`Encoding.keeps_float32`, docs/numerics.md, sections 3 and 4)
that drops the lag term inside the dot. So the attention's q.k and p.v dots
take `model.attention_precision` ('auto': `Encoding.dot_precision`), and
every other matmul `model.matmul_precision`.

A precision is a `jax.lax.Precision`, or None for the backend's default (no
precision attribute in the lowered dot). Kernels that JAX implements
(`jax.nn.dot_product_attention`) take it through `precision_scope`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

from jrope.attention.settings import AttentionSettings

# The kernels that form the shear's lag term as an exact weight (jrope.attention.shear).
SHEAR_KERNELS = ("shear", "shear_flash")

_PRECISIONS = {
    "default": None,
    "high": jax.lax.Precision.HIGH,
    "highest": jax.lax.Precision.HIGHEST,
}


def attention_precision(
    settings: AttentionSettings, encoding: Any, kernel: str | None = None
) -> jax.lax.Precision | None:
    """Precision of the attention's q.k and p.v dots for this model and encoding.

    'auto' is the encoding's `dot_precision`: HIGHEST for encodings whose
    logits cancel large products, whatever the compute dtype (their q and k
    stay float32 in bfloat16 runs too, for this very dot), None otherwise.
    The shear-weight kernels (`kernel` 'shear' or 'shear_flash') never form
    those products: 'auto' is the backend's default for them.
    """
    if settings.attention_precision == "auto":
        return None if kernel in SHEAR_KERNELS else encoding.dot_precision
    return _PRECISIONS[settings.attention_precision]


def matmul_precision(settings: AttentionSettings) -> jax.lax.Precision | None:
    """Precision of the projections, the MLP and the output logits."""
    return _PRECISIONS[settings.matmul_precision]


@contextlib.contextmanager
def precision_scope(precision: jax.lax.Precision | None) -> Iterator[None]:
    """Dots traced inside (in library code that takes no precision argument) run at `precision`.

    None leaves the backend's default. Autodiff keeps a dot's precision in
    its transposes, so the backward pass of code traced here gets it too.
    """
    if precision is None:
        yield
        return
    with jax.default_matmul_precision(precision.name.lower()):
        yield
