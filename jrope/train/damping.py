"""The damping bound: model.max_damping against the damping of the parameters being run.

Every attention kernel but the blockwise one maps a whole window from one
origin, which overflows float32 once gamma * positions passes
jrope.attention.selection.SINGLE_ORIGIN_EXPONENT_LIMIT; 'auto' plans for
gamma up to model.max_damping. The harness holds the parameters to it:

- before step 1, an encoding whose initial damping is above model.max_damping
  is refused with the fix (`initial_damping_problems`);
- before an evaluation step is compiled, and at every checkpoint of a
  training run, the damping of the parameters is read on the host
  (`measure`); past the bound, the model's layers plan their kernels for
  their measured damping (`follow`: Transformer.follow_damping), so a window
  one origin cannot carry runs the blockwise kernel, exact at any length;
- a non-finite loss or evaluation names a passed bound before anything else
  (`diagnosis`).
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class MeasuredDamping:
    """The largest damping gamma of a model's parameters, where it is, and the bound it met.

    per_layer: each layer's largest gamma (0.0: undamped); layer, head: where
    the largest one is (counted from 0); bound: model.max_damping.
    """

    per_layer: tuple[float, ...]
    layer: int
    head: int
    bound: float

    @property
    def largest(self) -> float:
        return max(self.per_layer, default=0.0)

    @property
    def passed(self) -> bool:
        """Whether the damping is above model.max_damping (not finite counts as above)."""
        return not self.largest <= self.bound

    def describe(self) -> str:
        """'layer L, head H has damping gamma = g, above model.max_damping = m'."""
        relation = "above" if self.passed else "within"
        return (
            f"layer {self.layer}, head {self.head} has damping gamma = {self.largest:.4g}, "
            f"{relation} model.max_damping = {self.bound:g}"
        )


def initial_damping_problems(cfg: TrainConfig) -> list[str]:
    """The refusal of an encoding that starts above model.max_damping, with the fix (or none)."""
    try:
        encoding = cfg.encoding
    except ValueError:
        return []  # the encoding's own problem is reported by the config
    initial = encoding.largest_damping(encoding.init_params())
    if initial <= cfg.model.max_damping:
        return []
    return [
        f"pe.init_gamma: {cfg.pe.name} starts with damping gamma = {initial:.4g}, above "
        f"model.max_damping = {cfg.model.max_damping:g}, the largest damping the attention "
        f"kernels plan for (one map origin overflows float32 past gamma * length = "
        f"{SINGLE_ORIGIN_EXPONENT_LIMIT:g}); raise --config.model.max_damping to at least "
        f"{initial:.4g} (windows longer than {SINGLE_ORIGIN_EXPONENT_LIMIT / initial:.0f} "
        "positions then run the blockwise kernel, exact at any length), or lower pe.init_gamma."
    ]


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
    choose their kernels for their measured damping.
    """
    measured = measure(cfg, params)
    if not measured.passed:
        return graphdef, measured
    model = model_from_params(graphdef, _with_host_pe_params(params))
    model.follow_damping()
    followed, _ = nnx.split(model, nnx.Param)
    return followed, measured


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
    return [block["attn"]["pe_params"] for _, block in sorted(params["blocks"].items())]


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
