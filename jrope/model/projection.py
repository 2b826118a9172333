"""The model's projections: a contraction of activations with a weight, and its CPU-tuned twin.

A projection function takes x [B, T, *K], a kernel [*K, *M], the number of
contracted axes len(K) and a dot precision, and returns [B, T, *M]. The
Transformer takes one as `projection=`; `contract` (plain autodiff) is its
default, and `cpu_projection` gives the same values and gradients faster on
XLA:CPU.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax

# (x, kernel, num_contracted, precision) -> x contracted with kernel.
ProjectionFn = Callable[[jax.Array, jax.Array, int, "jax.lax.Precision | None"], jax.Array]


def contract(
    x: jax.Array, kernel: jax.Array, num_contracted: int, precision: jax.lax.Precision | None
) -> jax.Array:
    """Contract the last `num_contracted` axes of x with the first of kernel, at `precision`.

    x [B, T, *K], kernel [*K, *M] -> [B, T, *M] (e.g. [B, T, D] x [D, 3, N, H]).
    """
    x_axes = tuple(range(x.ndim - num_contracted, x.ndim))
    return jax.lax.dot_general(
        x, kernel, ((x_axes, tuple(range(num_contracted))), ((), ())), precision=precision
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def cpu_projection(
    x: jax.Array, kernel: jax.Array, num_contracted: int, precision: jax.lax.Precision | None
) -> jax.Array:
    """`contract` with a backward pass laid out for XLA:CPU: same values and gradients.

    Autodiff's kernel gradient contracts over two axes (B, T), for which
    XLA:CPU transposes the output gradient in a copy fused with the
    activation's backward; contracting one flattened B*T axis of both
    operands avoids it (benchmarks: the synthetic CPU train step is about a
    quarter faster). GPU and TPU compilers lay out plain autodiff themselves.
    """
    return contract(x, kernel, num_contracted, precision)


def _cpu_projection_forward(x, kernel, num_contracted, precision):
    return contract(x, kernel, num_contracted, precision), (x, kernel)


def _cpu_projection_backward(num_contracted, precision, residuals, d_out):
    x, kernel = residuals
    num_out = kernel.ndim - num_contracted
    kernel_out_axes = tuple(range(num_contracted, kernel.ndim))
    d_out_axes = tuple(range(d_out.ndim - num_out, d_out.ndim))
    dimensions = ((d_out_axes, kernel_out_axes), ((), ()))
    d_x = jax.lax.dot_general(d_out, kernel, dimensions, precision=precision)
    rows = math.prod(x.shape[: x.ndim - num_contracted])
    x_rows = x.reshape((rows,) + x.shape[x.ndim - num_contracted :])
    d_out_rows = d_out.reshape((rows,) + d_out.shape[d_out.ndim - num_out :])
    d_kernel = jax.lax.dot_general(
        x_rows, d_out_rows, (((0,), (0,)), ((), ())), precision=precision
    )
    return d_x.astype(x.dtype), d_kernel.astype(kernel.dtype)


cpu_projection.defvjp(_cpu_projection_forward, _cpu_projection_backward)
