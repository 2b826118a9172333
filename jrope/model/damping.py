"""The damping bound: model.max_damping held against the damping of the parameters being run.

Before training, a bound the blockwise kernel's blocks cannot carry is refused
(`bound_problems`). Before a run's first step, and before decoding, the damping
is read on the host (`measure`); past the bound the model's layers plan their
kernels and blocks for it (`plan`). A run's steps compile once for that
`KernelPlan`; at each checkpoint the run asks whether the plan still carries
the damping learned since (`KernelPlan.carries`). A non-finite loss or
evaluation names a passed bound first (`diagnosed`). Each function takes the
model's config and its Encoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jrope.attention import choose_kernel
from jrope.attention.selection import SINGLE_ORIGIN_EXPONENT_LIMIT, blockwise_block_size
from jrope.encodings import Encoding
from jrope.errors import UsageError
from jrope.model.config import ModelConfig

# Relative slack of a damping against model.max_damping: float32 rounding (the softplus
# round trip of pe.init_gamma lands an ulp above it) is not a damping past the bound.
ROUNDING_TOLERANCE = 1e-5


@dataclasses.dataclass(frozen=True)
class MeasuredDamping:
    """Each layer's largest damping gamma (0.0: undamped); layer, head: where the largest is
    (from 0); bound: model.max_damping; block_size: the smallest block the layers run in."""

    per_layer: tuple[float, ...]
    layer: int
    head: int
    bound: float
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
        return (
            f"layer {self.layer}, head {self.head} has damping gamma = {self.largest:.4g}, "
            f"{'above' if self.passed else 'within'} model.max_damping = {self.bound:g}"
        )


def bound_problems(model: ModelConfig, encoding: Encoding) -> list[str]:
    """The refusal of a model.max_damping the blockwise kernel's blocks cannot carry, with the fix."""
    limit, block_size = SINGLE_ORIGIN_EXPONENT_LIMIT, model.block_size
    if not encoding.learns_damping or model.max_damping * (block_size - 1) <= limit:
        return []
    return [
        f"model.max_damping = {model.max_damping:g} with model.block_size = {block_size}: "
        f"the blockwise kernel's factors reach e^(max_damping * (block_size - 1)), past "
        f"float32's range beyond e^{limit:g}; set --config.model.block_size to at most "
        f"{blockwise_block_size(block_size, model.max_damping)} or lower model.max_damping."
    ]


def measure(model: ModelConfig, encoding: Encoding, params: Any) -> MeasuredDamping:
    """Every layer's largest damping, read on the host from the concrete params (nnx.State)."""
    blocks = _host_pe_params(params)["blocks"]
    heads = [_head_dampings(encoding, block["attn"]) for _, block in sorted(blocks.items())]
    per_layer = tuple(float(np.max(layer)) for layer in heads)
    # argmax takes the first NaN, so a non-finite damping is the one named.
    layer = int(np.argmax(per_layer))
    head = int(np.argmax(heads[layer]))
    block_size = min(blockwise_block_size(model.block_size, g) for g in per_layer)
    return MeasuredDamping(per_layer, layer, head, bound=model.max_damping, block_size=block_size)


def plan(
    model: ModelConfig, encoding: Encoding, graphdef: Any, params: Any
) -> tuple[Any, MeasuredDamping]:
    """The graphdef to compile with for `params` (after Transformer.follow_damping where the
    damping passed model.max_damping; else `graphdef`, nothing recompiles), and the damping."""
    measured = measure(model, encoding, params)
    if not measured.passed:
        return graphdef, measured
    transformer = nnx.merge(graphdef, _host_pe_params(params))
    transformer.follow_damping()
    return nnx.split(transformer, nnx.Param)[0], measured


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """The kernels a run's steps compile with at `lengths` (the training length first): for
    model.max_damping, or (`for_params`) for the damping `measured` of the parameters a run starts
    from, which `graphdef`'s layers follow past the bound (Transformer.follow_damping)."""

    model: ModelConfig
    encoding: Encoding
    platform: str
    lengths: tuple[int, ...]
    graphdef: Any
    measured: MeasuredDamping | None = None

    def for_params(self, params: Any) -> KernelPlan:
        """This plan made for the damping of `params` (the graphdef follows it past the bound)."""
        graphdef, measured = plan(self.model, self.encoding, self.graphdef, params)
        return dataclasses.replace(self, graphdef=graphdef, measured=measured)

    def kernel(self, length: int) -> str:
        """choose_kernel at `length` for the largest damping; UsageError naming the layer, the
        head's damping and model.max_damping where it rules out an explicit attention_impl."""
        if self.measured is None or not self.measured.passed:
            return self._choose(length, None)
        try:
            return self._choose(length, self.measured.largest)
        except ValueError as err:
            raise UsageError(f"{self.measured.describe()}: {err}") from err

    def measure(self, params: Any) -> MeasuredDamping:
        return measure(self.model, self.encoding, params)

    def carries(self, measured: MeasuredDamping) -> bool:
        """Whether every layer runs, at every length, the kernel and blocks that a plan for
        `measured` would choose: the steps compiled for this plan then compute what steps
        planned for `measured` would."""
        return self._choices(self.measured) == self._choices(measured)

    def _choose(self, length: int, damping: float | None) -> str:
        window = dict(length=length, backend=self.platform, damping=damping)
        return choose_kernel(self.model.attention, self.encoding, **window)

    def _choices(self, measured: MeasuredDamping | None) -> list:
        passed = measured is not None and measured.passed
        choices = []
        for damping in measured.per_layer if passed else (None,) * self.model.num_layers:
            for length in self.lengths:
                try:
                    name = self._choose(length, damping)
                except ValueError:
                    name = None  # refused: the plan for `measured` says why
                blocks = blockwise_block_size(self.model.block_size, damping)
                choices.append((name, blocks if name == "blockwise" else None))
        return choices


def diagnosed(error: Exception, measured: MeasuredDamping | None) -> Exception:
    """`error` (a non-finite loss or evaluation) with, first, the diagnosis of a passed bound."""
    if measured is None or not measured.passed:
        return error
    return type(error)(
        f"The damping passed its bound: {measured.describe()}; windows that one map origin "
        "cannot carry at this damping ran the blockwise kernel, whose factors still reach "
        "e^(gamma * model.block_size). Bound the damping (a lower pe.init_gamma or "
        f"opt.learning_rate) before blaming the rest of the model. {error}"
    )


def _host_pe_params(params: Any) -> Any:
    """`params` with each layer's encoding parameters gathered from every process to the host."""

    def host(path, leaf):
        if any(getattr(key, "key", None) == "pe_params" for key in path):
            return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        return leaf

    return jax.tree_util.tree_map_with_path(host, params)


def _head_dampings(encoding: Any, attn: Any) -> np.ndarray:
    """The largest gamma of each head [N] of one layer's attention state (zeros: undamped)."""
    # An encoding without parameters (RoPE, none) leaves no pe_params in the state.
    pe_params = attn["pe_params"] if "pe_params" in attn else {}
    values = {
        name: leaf[...] if isinstance(leaf, nnx.Variable) else leaf
        for name, leaf in pe_params.items()
    }
    return encoding.head_dampings(values)
