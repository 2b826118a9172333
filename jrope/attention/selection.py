"""Which attention kernel runs: one function of the model config, the encoding, the length and the backend.

The model, the run checks, the train step's compiler options and the
evaluation step all ask `choose_kernel`, so they cannot disagree.

'auto' chooses, in this order:
  1. blockwise where one map origin would overflow: the other kernels map
     all S positions (the span plus one) from one origin, so the products of
     masked pairs reach e^{gamma S}, and float32 overflows past e^{88.7}. With
     gamma the larger of model.max_damping and the measured damping, one
     origin serves only while gamma * S <= 80 (e^{8.7} ~ 6000 left for
     |q||k|); the blockwise kernel's factors stay below e^{gamma * block_size}
     (`blockwise_block_size` gives blocks that carry a measured damping).
  2. the backend's fused kernel where it applies: splash on TPU, cuDNN on
     GPU (see fused_kernel_problem for when they do not; never for packed
     rows, whose segment ids they do not take);
  3. on TPU and GPU, for the encodings whose maps would need float32 q, k
     and HIGHEST dots (Encoding.keeps_float32) and whose shear is an exact
     per-pair weight (jrope.attention.shear): the shear kernel, below
     model.blockwise_min_length, whose dots run in the compute dtype at the
     backend's default precision, and from it on its Pallas flash form
     (memory linear in length; no ALiBi bias, which goes blockwise);
  4. otherwise: blockwise from model.blockwise_min_length on
     (memory linear in length); below it, on CPU the einsum kernel (its train
     step is faster there than xla's; jrope.attention.dense), elsewhere xla's
     attention, or einsum for the encodings xla does not take (a bias).
Every kernel computes the encoding features KERNEL_FEATURES lists for it; an
encoding with another is refused on it, by its feature's name. An explicit
attention_impl is taken as asked, or refused with the reason.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jrope import encodings
from jrope.attention import cudnn, shear, shear_flash, splash
from jrope.attention.precision import attention_precision
from jrope.attention.settings import ATTENTION_IMPLS, AttentionSettings  # noqa: F401 (jrope.check)
from jrope.attention.shear_flash import BLOCK as SHEAR_FLASH_BLOCK

# The concrete kernels `choose_kernel` returns.
KERNELS = ("xla", "einsum", "blockwise", "cudnn", "splash", "shear", "shear_flash")
# The encoding features each kernel computes (jrope.encodings); it refuses any other.
_MAPS, _BIAS = encodings.MAP_FEATURES, frozenset({encodings.BIAS})
_LOGITS = frozenset({encodings.LOGITS})  # the kernels that apply Encoding.transform_logits
KERNEL_FEATURES = {
    "xla": _MAPS,  # jax.nn.dot_product_attention on the mapped q, k: no bias, no logits transform
    "einsum": _MAPS | _BIAS | _LOGITS,
    "blockwise": _MAPS | _BIAS | _LOGITS,  # maps per block and moves keys (Encoding.move_keys)
    # The fused kernels run their dots at their own precision: not for FLOAT32_DOTS.
    "cudnn": _MAPS - {encodings.FLOAT32_DOTS} | _BIAS,
    "splash": _MAPS - {encodings.FLOAT32_DOTS},  # no bias
    "shear": shear.FEATURES,
    "shear_flash": shear_flash.FEATURES,
}
# The kernels that take segment ids of packed rows (jrope.attention.packing).
PACKING_KERNELS = ("xla", "einsum", "blockwise", "shear", "shear_flash")
# Largest gamma * S for which one map origin is used (float32 overflows past e^88.7).
SINGLE_ORIGIN_EXPONENT_LIMIT = 80.0
# The fused kernel of each accelerator backend.
_FUSED_KERNEL = {"tpu": "splash", "gpu": "cudnn"}


def choose_kernel(
    settings: AttentionSettings,
    encoding: Any,
    *,
    length: int,
    num_queries: int | None = None,
    backend: str | None = None,
    span: int | None = None,
    damping: float | None = None,
    packed: bool = False,
) -> str:
    """The kernel (one of KERNELS) for attention of `num_queries` queries over `length` keys.

    encoding: a jrope Encoding (has_bias, keeps_float32, dot_precision, cfg).
    num_queries: the queries are the last of the keys (default: all of them;
      1 for the last-position readout).
    backend: 'cpu', 'gpu' or 'tpu' (default: JAX's default backend).
    span: max - min of the key positions of any row (default length - 1,
      contiguous positions); one map origin must cover span + 1 positions.
      Packed rows: the largest span of one segment's positions (each
      sequence is mapped from an origin of its own).
    damping: the parameters' largest damping measured on the host
      (Encoding.largest_damping); 'auto' plans for the larger of it and
      model.max_damping, and an explicit single-origin kernel it would
      overflow is refused.
    packed: the rows hold packed sequences (segment ids): only the
      PACKING_KERNELS run them; 'auto' picks one of them.

    Raises:
      ValueError: the requested kernel cannot run this encoding here; the
        message says why and what to set instead.
    """
    backend = backend or jax.default_backend()
    num_queries = length if num_queries is None else num_queries
    impl = settings.attention_impl
    extent = length if span is None else max(length, span + 1)  # the positions one origin covers
    bound = damping_bound(settings, damping)
    if impl == "auto":
        window = (extent, bound, num_queries, length, backend, packed)
        kernel = _auto_kernel(settings, encoding, *window)
        refusal = feature_refusal(kernel, encoding)
        if refusal:  # a feature that no kernel 'auto' considers here computes
            raise ValueError(f"attention_impl='auto' found no kernel: {refusal}")
        return kernel
    refusal = feature_refusal(impl, encoding)
    if refusal:
        raise ValueError(f"attention_impl={impl!r} does not apply: {refusal}")
    if packed and impl not in PACKING_KERNELS:
        raise ValueError(
            f"attention_impl={impl!r} does not take segment ids (packed rows); use 'auto' or one "
            f"of {PACKING_KERNELS}, or give each sequence a row of its own."
        )
    if (
        impl != "blockwise"
        and damping is not None
        and not single_origin_is_safe(encoding, damping, extent)
    ):
        raise ValueError(
            f"attention_impl={impl!r} maps {extent} positions from one origin, and a damping of "
            f"{damping:.4g} overflows float32 there (damping * positions > "
            f"{SINGLE_ORIGIN_EXPONENT_LIMIT:g}); use 'blockwise' or 'auto'."
        )
    if impl in ("cudnn", "splash"):
        window = (length, num_queries, backend, extent, bound)
        problem = fused_kernel_problem(impl, settings, encoding, *window)
        if problem:
            raise ValueError(f"attention_impl={impl!r} does not apply: {problem}; use 'auto'.")
    return impl


def feature_refusal(kernel: str, encoding: Any) -> str | None:
    """The sentence refusing `encoding` on `kernel`: its first feature the kernel does not
    compute, and the kernels that take the encoding (None: the kernel takes every feature)."""
    if kernel not in KERNEL_FEATURES:
        return f"unknown attention kernel {kernel!r}; choose one of {KERNELS}."
    missing = encodings.unsupported_features(encoding, KERNEL_FEATURES[kernel])
    if not missing:
        return None
    takers = [name for name in KERNELS if encoding.features <= KERNEL_FEATURES[name]]
    return (
        f"the {kernel} kernel does not compute {encoding.name}'s {missing[0]}; "
        f"the kernels that do: {', '.join(takers) or 'none'}."
    )


def damping_bound(settings: AttentionSettings, damping: float | None) -> float:
    """The damping a kernel must survive: model.max_damping, or the measured one where larger."""
    return settings.max_damping if damping is None else max(settings.max_damping, damping)


def single_origin_is_safe(encoding: Any, damping: float, extent: int) -> bool:
    """Whether mapping `extent` positions from one origin keeps every factor finite at `damping`."""
    if not encoding.learns_damping:
        return True
    return damping * extent <= SINGLE_ORIGIN_EXPONENT_LIMIT


def blockwise_block_size(block_size: int, damping: float | None) -> int:
    """The blocks the blockwise kernel runs in at `damping`: block_size, or a smaller power of two.

    It measures positions from each query block's first, so its factors reach
    e^{damping (b - 1)} in blocks of b: block_size where that stays within
    SINGLE_ORIGIN_EXPONENT_LIMIT (or where damping is None or not finite, which
    no block carries), else the largest power of two that does.
    """
    limit = SINGLE_ORIGIN_EXPONENT_LIMIT
    if damping is None or not math.isfinite(damping) or damping * (block_size - 1) <= limit:
        return block_size
    return 2 ** math.floor(math.log2(limit / damping + 1.0))


def cache_rebase_bound(rebase_bound: int, damping: float) -> int:
    """A KV cache's rebase_bound (jrope.model.kv_cache) lowered to what `damping` allows.

    The cache maps keys from an origin, so their factors reach
    e^{damping * rebase_bound}: at most SINGLE_ORIGIN_EXPONENT_LIMIT / damping (and >= 1).
    """
    limit = SINGLE_ORIGIN_EXPONENT_LIMIT
    if not math.isfinite(damping) or damping * rebase_bound <= limit:
        return rebase_bound
    return max(1, int(limit / damping))


def cache_keeps_shear_terms(
    settings: AttentionSettings, encoding: Any, backend: str | None = None
) -> bool:
    """Whether a KV cache (jrope.model.kv_cache) stores the shear kernels' key terms.

    Where the model's attention takes the shear-weight kernels for an
    encoding that would otherwise need float32 q, k and HIGHEST dots: an
    explicit 'shear' or 'shear_flash', or 'auto' on TPU and GPU (step 3
    above). The decode step's dots then run in the compute dtype at the
    backend's default precision; elsewhere the cache stores the mapped keys.
    """
    if not encoding.keeps_float32 or feature_refusal("shear", encoding):
        return False
    impl = settings.attention_impl
    backend = backend or jax.default_backend()
    return impl in ("shear", "shear_flash") or (impl == "auto" and backend in _FUSED_KERNEL)


def fused_kernel_problem(
    kernel: str,
    settings: AttentionSettings,
    encoding: Any,
    length: int,
    num_queries: int,
    backend: str,
    extent: int,
    bound: float,
) -> str | None:
    """Why the fused `kernel` ('cudnn' or 'splash') cannot run this attention (None: it can).

    extent, bound: the positions one origin covers and the damping to survive (choose_kernel).
    """
    wanted = next(platform for platform, fused in _FUSED_KERNEL.items() if fused == kernel)
    if backend != wanted:
        return f"it runs on {wanted.upper()} only and this run is on {backend}"
    if num_queries != length:
        return f"it attends full sequences, not the last {num_queries} of {length} positions"
    if not single_origin_is_safe(encoding, bound, extent):
        return (
            f"one map origin over {extent} positions may overflow float32 for a damping up to "
            f"{bound:.4g} (model.max_damping={settings.max_damping} or the measured one; "
            f"damping * positions > {SINGLE_ORIGIN_EXPONENT_LIMIT:g}); the blockwise kernel "
            "keeps the factors bounded"
        )
    refusal = feature_refusal(kernel, encoding)
    if refusal:
        return refusal.rstrip(".")
    if kernel == "splash":
        if length % splash.LENGTH_MULTIPLE:
            return f"the length {length} is not a multiple of {splash.LENGTH_MULTIPLE}"
        if attention_precision(settings, encoding) is not None:
            return (
                f"its dots run at the kernel's own precision, not model.attention_precision="
                f"{settings.attention_precision!r}"
            )
        return None
    if jnp.dtype(settings.compute_dtype) != jnp.bfloat16:
        return (
            "cuDNN flash attention takes bfloat16 or float16 only; set "
            "model.compute_dtype='bfloat16'"
        )
    head_dim = settings.head_dim
    if head_dim % cudnn.HEAD_DIM_MULTIPLE or head_dim > cudnn.MAX_HEAD_DIM:
        return (
            f"head dim {head_dim} is not a multiple of {cudnn.HEAD_DIM_MULTIPLE} up to "
            f"{cudnn.MAX_HEAD_DIM}"
        )
    if encoding.has_bias and length % 2:
        return f"with a bias, cuDNN trains only even lengths, not {length}"
    return None


def _auto_kernel(settings, encoding, extent, bound, num_queries, length, backend, packed) -> str:
    """Steps 1 to 4 of 'auto' (the module docstring)."""
    flash = (
        backend in _FUSED_KERNEL
        and encoding.keeps_float32
        and not feature_refusal("shear_flash", encoding)
        and bound * (SHEAR_FLASH_BLOCK - 1) <= SINGLE_ORIGIN_EXPONENT_LIMIT
    )
    if not single_origin_is_safe(encoding, bound, extent):
        # The flash kernel measures positions from each block's first, as blockwise does.
        return "shear_flash" if flash else "blockwise"
    # The fused kernels take no segment ids; every other kernel below does.
    fused = None if packed else _FUSED_KERNEL.get(backend)
    if fused and not fused_kernel_problem(
        fused, settings, encoding, length, num_queries, backend, extent, bound
    ):
        return fused
    if (
        backend in _FUSED_KERNEL
        and encoding.keeps_float32
        and not feature_refusal("shear", encoding)
    ):
        if length < settings.blockwise_min_length:
            return "shear"
        if flash:
            return "shear_flash"
    if length >= settings.blockwise_min_length:
        return "blockwise"
    if backend == "cpu" or feature_refusal("xla", encoding):
        return "einsum"
    return "xla"
