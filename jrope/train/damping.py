"""The damping bound: model.max_damping against the damping of the parameters being run.

Every attention kernel but the blockwise one maps a whole window from one
origin, which overflows float32 once gamma * positions passes
jrope.attention.selection.SINGLE_ORIGIN_EXPONENT_LIMIT; 'auto' plans for
gamma up to model.max_damping. The harness holds the parameters to it:

- before step 1, a model.max_damping that the blockwise kernel's blocks
  cannot carry is refused with the fix (`bound_problems`); an encoding that
  starts above model.max_damping is followed from the start, said on the
  console (jrope.train.trainer.TrainKernel);
- before an evaluation or decoding step is compiled, and at every checkpoint
  of a training run, the damping of the parameters is read on the host
  (`measure`); past the bound, the model's layers plan their kernels for
  their measured damping (`follow`: Transformer.follow_damping), so a window
  one origin cannot carry runs the blockwise kernel, exact at any length, and
  a KV cache moves its origin often enough (`rebase_bound`);
- a non-finite loss or evaluation names a passed bound before anything else
  (`diagnosis`).

The blockwise kernel measures positions from each query block's first, so its
factors reach e^{gamma (b - 1)} for blocks of b = model.block_size: it is
exact at any length, but only for a damping within the same limit over one
block. The refusal asks for a block size that carries the bound, and past
it `follow` runs the layer in blocks that carry the measured damping (`blockwise_block_size`; the
result is the same, the blocks only change the order of the sums).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jrope.attention import choose_kernel
from jrope.attention.selection import SINGLE_ORIGIN_EXPONENT_LIMIT
from jrope.errors import UsageError
from jrope.train.config import TrainConfig
from jrope.train.setup import model_from_params

# Relative slack of a damping against model.max_damping: float32 rounding (the softplus
# round trip of pe.init_gamma lands an ulp above it) is not a damping past the bound.
ROUNDING_TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class MeasuredDamping:
    """The largest damping gamma of a model's parameters, where it is, and the bound it met.

    per_layer: each layer's largest gamma (0.0: undamped); layer, head: where
    the largest one is (counted from 0); bound: model.max_damping.
    block_size: the smallest block of the blockwise kernel `follow` chose.
    """

    per_layer: tuple[float, ...]
    layer: int
    head: int
    bound: float
    # The blocks the blockwise kernel runs in for this damping (set by `follow`).
    block_size: int | None = None

    @property
    def largest(self) -> float:
        return max(self.per_layer, default=0.0)

    @property
    def passed(self) -> bool:
        """Whether the damping is above model.max_damping (not finite counts as above)."""
        return not self.largest <= self.bound * (1.0 + ROUNDING_TOLERANCE)

    def describe(self) -> str:
        """'layer L, head H has damping gamma = g, above model.max_damping = m'."""
        relation = "above" if self.passed else "within"
        return (
            f"layer {self.layer}, head {self.head} has damping gamma = {self.largest:.4g}, "
            f"{relation} model.max_damping = {self.bound:g}"
        )


def bound_problems(cfg: TrainConfig) -> list[str]:
    """The refusal of a model.max_damping the blockwise kernel's blocks cannot carry, with the fix.

    An encoding that starts above model.max_damping is not refused: the
    kernels follow its own setting from step 1 on (jrope.train.trainer.TrainKernel).
    """
    limit = SINGLE_ORIGIN_EXPONENT_LIMIT
    block_size = cfg.model.block_size
    if cfg.pe.learn_gamma and cfg.model.max_damping * (block_size - 1) > limit:
        return [
            f"model.max_damping = {cfg.model.max_damping:g} with model.block_size = {block_size}: "
            f"the blockwise kernel's factors reach e^(max_damping * (block_size - 1)), past "
            f"float32's range beyond e^{limit:g}; set --config.model.block_size to at most "
            f"{blockwise_block_size(block_size, cfg.model.max_damping)} or lower "
            "model.max_damping."
        ]
    return []


def blockwise_block_size(block_size: int, gamma: float) -> int:
    """The largest block <= block_size whose factors e^{gamma (b - 1)} stay within the limit.

    A power of two where block_size is too large for gamma; block_size where it is not
    (or where gamma is not finite: no block carries it).
    """
    limit = SINGLE_ORIGIN_EXPONENT_LIMIT
    if not math.isfinite(gamma) or gamma * (block_size - 1) <= limit:
        return block_size
    return 2 ** int(math.floor(math.log2(limit / gamma + 1.0)))


def measure(cfg: TrainConfig, params: Any) -> MeasuredDamping:
    """Every layer's largest damping, read on the host from the concrete params (nnx.State)."""
    encoding = cfg.encoding
    per_layer, where, largest = [], (0, 0), -1.0
    for index, pe_params in enumerate(_host_pe_params(params)):
        per_layer.append(encoding.largest_damping(pe_params))
        heads = _head_dampings(encoding, pe_params)
        head = int(np.argmax(heads)) if heads.size else 0
        value = float(heads[head]) if heads.size else 0.0
        if value > largest or not np.isfinite(value):
            where, largest = (index, head), value
    return MeasuredDamping(tuple(per_layer), *where, bound=cfg.model.max_damping)


def follow(cfg: TrainConfig, graphdef: Any, params: Any) -> tuple[Any, MeasuredDamping]:
    """The graphdef to compile with for `params`, and their measured damping.

    Within model.max_damping: `graphdef` itself (nothing recompiles). Past it:
    the graphdef of the model after Transformer.follow_damping, whose layers
    choose their kernels for their measured damping, each running the
    blockwise kernel in blocks that carry it (`blockwise_block_size`).
    """
    measured = measure(cfg, params)
    if not measured.passed:
        return graphdef, measured
    model = model_from_params(graphdef, _with_host_pe_params(params))
    model.follow_damping()
    block_sizes = []
    for block in model.blocks:
        attn = block.attn
        size = blockwise_block_size(attn.cfg.block_size, attn.measured_damping)
        if size != attn.cfg.block_size:
            attn.cfg = dataclasses.replace(attn.cfg, block_size=size)
        block_sizes.append(attn.cfg.block_size)
    followed, _ = nnx.split(model, nnx.Param)
    return followed, dataclasses.replace(measured, block_size=min(block_sizes))


def kernel(cfg: TrainConfig, length: int, platform: str, measured: MeasuredDamping | None) -> str:
    """choose_kernel at `length` for the measured damping.

    Raises UsageError naming the layer, the head's damping and model.max_damping
    where the measured damping rules out an explicit model.attention_impl.
    """
    damping = None if measured is None or not measured.passed else measured.largest
    try:
        return choose_kernel(
            cfg.model, cfg.encoding, length=length, backend=platform, damping=damping
        )
    except ValueError as err:
        if damping is None:
            raise
        raise UsageError(f"{measured.describe()}: {err}") from err


def rebase_bound(bound: int, gamma: float) -> int:
    """The KV cache's rebase_bound, lowered where e^(gamma * bound) would pass the limit."""
    limit = SINGLE_ORIGIN_EXPONENT_LIMIT
    if not math.isfinite(gamma) or gamma * bound <= limit:
        return bound
    return max(1, int(limit / gamma))


def diagnosis(measured: MeasuredDamping | None) -> str:
    """The sentence a non-finite loss or evaluation starts with where the bound was passed ('')."""
    if measured is None or not measured.passed:
        return ""
    return (
        f"The damping passed its bound: {measured.describe()}; windows that one map origin "
        "cannot carry at this damping ran the blockwise kernel, whose factors still reach "
        "e^(gamma * model.block_size). Bound the damping (a lower pe.init_gamma or "
        "opt.learning_rate) before blaming the rest of the model. "
    )


def _pe_paths(params: Any) -> list[Any]:
    """The blocks' encoding parameter dicts of an nnx.State of the Transformer's params."""
    layers = [block["attn"] for _, block in sorted(params["blocks"].items())]
    # An encoding without parameters (RoPE, none) leaves no pe_params in the state.
    return [attn["pe_params"] if "pe_params" in attn else {} for attn in layers]


def _host_pe_params(params: Any) -> list[dict[str, np.ndarray]]:
    """Each layer's encoding parameters as host arrays (gathered from every process)."""
    layers = []
    for pe_params in _pe_paths(params):
        layers.append(
            {
                name: np.asarray(multihost_utils.process_allgather(_value(leaf), tiled=True))
                for name, leaf in pe_params.items()
            }
        )
    return layers


def _with_host_pe_params(params: Any) -> Any:
    """`params` with each layer's encoding parameters replaced by their host copies."""

    def host(path, leaf):
        if any(getattr(key, "key", None) == "pe_params" for key in path):
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return leaf

    return jax.tree_util.tree_map_with_path(host, params)


def _value(leaf: Any) -> Any:
    return leaf[...] if isinstance(leaf, nnx.Variable) else leaf


def _head_dampings(encoding: Any, pe_params: dict[str, np.ndarray]) -> np.ndarray:
    """The largest gamma of each head [N] (zeros where undamped)."""
    heads = np.zeros(encoding.num_heads)
    for segment in encoding.segments:
        if segment.learn_gamma:
            gamma = np.asarray(segment.physical_params(pe_params)["gamma"], np.float64)
            heads = np.maximum(heads, gamma.reshape(gamma.shape[0], -1).max(axis=1))
    return heads
