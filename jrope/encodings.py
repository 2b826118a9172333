"""Positional encodings behind one interface: `transform_qk`, `logit_bias`, `transform_logits`.

`make_encoding(cfg, num_heads, head_dim)` turns a PEConfig into an
`Encoding`, which owns no state: its learnable parameters (gamma, eta, jet
gates, per head and per block) live in a plain dict made by `init_params()`
and passed back in, so the same object serves jit, grad and sharding.

Every variant is a per-position linear map on q and k followed by an
ordinary dot product (docs/mathematics.md, section 3), plus an optional additive bias, so
it works with any attention kernel; the logit soft-cap also maps the logits elementwise, which
the kernels that apply `transform_logits` compute (docs/extending.md).

Shape legend: B batch, T query length, S key length, N heads, H head dim,
nb blocks per head, m chain order.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jrope import pe_math
from jrope.pe_config import PEConfig
from jrope.segments import JordanSegment


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes 2^(-8k/n), k = 1..n, with the standard fill for non-powers of two.

    For n not a power of two: the slopes of the closest smaller power c,
    then every other slope of 2c, up to n. float32 [N].
    """

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * k / closest) for k in range(1, closest + 1)]
    every_other = [2.0 ** (-8.0 * k / (2 * closest)) for k in range(1, 2 * closest + 1, 2)]
    return np.asarray(slopes + every_other[: num_heads - closest], np.float32)


# jrope computes positions in int32; an int64 or uint32 position past this range would wrap.
POSITION_RANGE = (-(2**31), 2**31 - 1)
# Keep q and k float32 (and the attention dots at HIGHEST) once the shear's
# coefficients can sum past this multiple of the rotation (docs/numerics.md, section 3).
FLOAT32_SHEAR_TERM = 1.0

# The features an encoding can have (Encoding.features). Each kernel declares the features it
# supports (jrope.attention.selection.KERNEL_FEATURES) and refuses an encoding with any other by
# name, so that no kernel computes another function than the encoding's.
MAPS = "position maps"  # per-position linear maps of q and k (every variant but NoPE and ALiBi)
DAMPING = "damping"  # a learned damping e^{-gamma |i - j|}
SHEAR = "exponential shear"  # chain coefficients (eta s)^r / r! of one shear time s(p)
GATED_SHEAR = "gated shear"  # the jet mixes: gated coefficients, not one exponential
BIAS = "logit bias"  # ALiBi's additive -slope * max(i - j, 0)
FLOAT32_DOTS = "float32 dots"  # logits that cancel large products (Encoding.keeps_float32)
TEMPERATURE = "logit temperature"  # a learned per-head scale of the queries
LOGITS = "logits transform"  # transform_logits is not the identity (e.g. the logit soft-cap)

# The feature a PEConfig field asks of a kernel when it is away from its default (None: the
# segments' features above carry it). A field missing here is a feature of its own, named after
# the field, which no kernel computes: a new setting is refused everywhere until it is listed.
FIELD_FEATURES = {
    **dict.fromkeys(("name", "layout", "train_context", "theta", "order", "rotate")),
    **dict.fromkeys(("learn_gamma", "gamma_min", "init_gamma", "shear", "shear_time")),
    **dict.fromkeys(("shear_scale", "eta_max", "init_eta", "jet_gates", "jet_base")),
    "jet_gate_max": None,
    "alibi": BIAS,
    "learn_temperature": TEMPERATURE,
    "logit_softcap": LOGITS,
}

# What each family of hooks carries exactly: a kernel that reaches the encoding only through
# one family supports these features (and BIAS where it adds logit_bias, LOGITS where it applies
# transform_logits). A feature added to an encoding joins the families whose hooks compute it,
# and no other.
#   the maps: map_queries, map_keys, move_keys;
MAP_FEATURES = frozenset({MAPS, DAMPING, SHEAR, GATED_SHEAR, FLOAT32_DOTS, TEMPERATURE})
#   the shear terms: shear_terms, term_rates, shear_time (jrope.attention.shear);
TERM_FEATURES = frozenset({MAPS, DAMPING, SHEAR, FLOAT32_DOTS})
#   the closed-form relative operators (Encoding.relative_logits).
RELATIVE_FEATURES = frozenset({MAPS, DAMPING, SHEAR, FLOAT32_DOTS, BIAS})


def check_positions(
    positions, what: str = "positions", *, packed: bool = False, causal: bool = False
) -> None:
    """Raises ValueError for concrete positions jrope cannot take (traced ones pass).

    positions: integers [T] or [B, T]. Refused: values outside int32 (they
    would wrap), and rows whose positions go back down.
    causal: also repeats (kernels decide what a query sees by position).
    packed: positions restart at each segment (jrope.attention.packing checks those).
    """
    if isinstance(positions, jax.core.Tracer):
        return
    values = np.asarray(positions)
    if not np.issubdtype(values.dtype, np.integer):
        return
    low, high = values.min(), values.max()
    if low < POSITION_RANGE[0] or high > POSITION_RANGE[1]:
        raise ValueError(
            f"{what} span [{low}, {high}], beyond int32 {list(POSITION_RANGE)}: jrope computes "
            "positions in int32 and would wrap them. Translation-invariant encodings depend only "
            "on differences, so subtract a common offset; stabilized ones need positions in int32."
        )
    if packed:
        return
    rows = values.reshape(-1, values.shape[-1]).astype(np.int64)
    steps = np.diff(rows, axis=-1)
    falls = np.argwhere(steps <= 0 if causal else steps < 0)
    if len(falls):
        row, index = falls[0]
        raise ValueError(
            f"{what} must {'increase' if causal else 'not go back down'} along a row, got "
            f"{rows[row, index]} -> {rows[row, index + 1]} at index {index + 1}: give each "
            "sequence its own row (or pass segment_ids for packed rows), one position per token."
        )


def _as_batched_positions(positions, packed: bool = False) -> jax.Array:
    """int32 [T] or [B, T] -> int32 [B|1, T] (packed: see check_positions)."""
    check_positions(positions, packed=packed)
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be integers, got {positions.dtype}")
    positions = positions.astype(jnp.int32)
    return positions[None] if positions.ndim == 1 else positions


def check_floating(name: str, x) -> None:
    """Raises ValueError where `x` (q, k or v) is not floating point (the maps would truncate)."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"{name} must be floating point (float32, bfloat16 or float16), got {dtype}: the maps "
            f"have real coefficients and would truncate their result to {dtype}. Cast it first, "
            f"e.g. {name}.astype(jnp.float32)."
        )


def check_positions_fit(name: str, positions, x_name: str, batch_and_length) -> None:
    """Raises ValueError naming `name` where positions [T|1] or [B|1, T|1] do not fit `x_name`'s
    leading [B, T]."""
    rows, length = batch_and_length
    shape = tuple(jnp.shape(positions))
    if len(shape) not in (1, 2):
        raise ValueError(f"{name} must be [T] or [B, T], got shape {shape}.")
    if shape[-1] not in (1, length) or (len(shape) == 2 and shape[0] not in (1, rows)):
        raise ValueError(
            f"{name} has shape {shape} but {x_name} is [B, T, N, H] = "
            f"[{rows}, {length}, ...]: give {name} as [{length}] (shared by every row) or "
            f"[{rows}, {length}] (one row of positions per row of {x_name})."
        )


def default_origin(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """Midpoint of all positions per batch row, int32 [B|1, 1].

    Exact variants are invariant to the origin; measuring positions from the
    middle of the window bounds e^{+-gamma (p - origin)} and the raw shear by
    half the window span instead of the absolute position (docs/numerics.md, section 2).
    """
    lo = jnp.minimum(q_positions.min(-1), k_positions.min(-1))
    hi = jnp.maximum(q_positions.max(-1), k_positions.max(-1))
    return (lo + (hi - lo) // 2)[:, None]


@dataclasses.dataclass(frozen=True)
class Encoding:
    """A positional encoding for `num_heads` heads of width `head_dim`."""

    cfg: PEConfig
    num_heads: int
    head_dim: int
    segments: tuple[JordanSegment, ...]
    # The longest window (key length) the encoding is made for: with the
    # shear it decides keeps_float32 and dot_precision.
    max_length: int

    @property
    def has_bias(self) -> bool:
        return self.cfg.alibi

    @property
    def largest_shear_term(self) -> float:
        """The largest sum of shear coefficients any segment reaches within `max_length`.

        Its size is how much a score's terms cancel (segments.JordanSegment.largest_shear_term).
        """
        return max((s.largest_shear_term(self.max_length) for s in self.segments), default=0.0)

    @property
    def keeps_float32(self) -> bool:
        """Whether transform_qk returns float32 whatever the input dtype.

        Shear makes q1' = q1 + s q0: once its coefficients can grow past the
        rotation (largest_shear_term > FLOAT32_SHEAR_TERM), the score's lag term
        is a difference of larger products, which bfloat16 cannot resolve
        (docs/numerics.md, section 3).
        """
        return self.largest_shear_term > FLOAT32_SHEAR_TERM

    @property
    def dot_precision(self) -> jax.lax.Precision | None:
        """The q.k and p.v dots' precision: HIGHEST where the logits cancel large products
        (`keeps_float32`; TPUs and GPUs otherwise run bfloat16 passes or TF32), else None."""
        return jax.lax.Precision.HIGHEST if self.keeps_float32 else None

    @property
    def name(self) -> str:
        return self.cfg.name

    @functools.cached_property
    def features(self) -> frozenset[str]:
        """What a kernel must compute for this encoding: what its segments and its logits hook
        compute, and the feature of each PEConfig field away from its default (FIELD_FEATURES)."""
        features = set()
        for segment in self.segments:
            features.add(MAPS)
            if segment.learn_gamma:
                features.add(DAMPING)
            features |= {"none": set(), "eta": {SHEAR}, "jet": {GATED_SHEAR}}[segment.shear]
        if self.keeps_float32:
            features.add(FLOAT32_DOTS)
        for field in dataclasses.fields(self.cfg):
            value = getattr(self.cfg, field.name)
            if field.default is dataclasses.MISSING or value != field.default:
                features.add(FIELD_FEATURES.get(field.name, field.name))
        # What transform_logits computes, traced once: an identity leaves its input as it is.
        probe = jax.ShapeDtypeStruct((1, self.num_heads, 1, 1), jnp.float32)
        params = {
            name: jax.ShapeDtypeStruct(v.shape, v.dtype)
            for name, (v, _) in self._parameters().items()
        }
        traced = jax.make_jaxpr(self.transform_logits)(params, probe).jaxpr
        if traced.outvars != traced.invars[-1:]:
            features.add(LOGITS)
        return frozenset(features - {None})

    @property
    def has_maps(self) -> bool:
        """Whether q and k are mapped at all (False for NoPE and ALiBi)."""
        return bool(self.segments)

    @property
    def learns_damping(self) -> bool:
        return any(segment.learn_gamma for segment in self.segments)

    @property
    def shear_time(self) -> pe_math.ShearTime | None:
        """The shear's time s(p) / eta of every shearing segment (None without a shear)."""
        return self.cfg.clock

    @property
    def param_logical_axes(self) -> dict[str, tuple[str | None, ...]]:
        """Each parameter's logical axes (jrope.model.axes), by name."""
        return {name: axes for name, (_, axes) in self._parameters().items()}

    def _parameters(self) -> dict[str, tuple[np.ndarray, tuple[str | None, ...]]]:
        """Every learnable parameter's initial value and logical axes, by name."""
        params = {name: p for segment in self.segments for name, p in segment.parameters().items()}
        if self.cfg.learn_temperature:
            params["temperature"] = (np.zeros(self.num_heads, np.float32), ("heads",))
        return params

    def head_dampings(self, params) -> np.ndarray:
        """The largest damping gamma of each head, float64 [N] on the host (zeros: undamped).

        params: this encoding's parameter dict, concrete arrays (not tracers).
        """
        heads = np.zeros(self.num_heads)
        # Inside a trace jnp would stage even concrete parameters' arithmetic; evaluate eagerly.
        with jax.ensure_compile_time_eval():
            for segment in self.segments:
                if segment.learn_gamma:
                    gamma = np.asarray(segment.physical_params(params)["gamma"], np.float64)
                    heads = np.maximum(heads, gamma.reshape(gamma.shape[0], -1).max(axis=1))
        return heads

    def largest_damping(self, params) -> float:
        """The largest damping gamma of one layer's concrete parameters, a host float (0: undamped):
        what a single-origin kernel must survive (jrope.attention.choose_kernel's damping)."""
        return float(np.max(self.head_dampings(params), initial=0.0))

    def init_params(self) -> dict[str, jax.Array]:
        """The learnable parameters at their configured initial values (float32)."""
        return {name: jnp.asarray(value) for name, (value, _) in self._parameters().items()}

    def physical_params(self, params) -> dict[str, jax.Array]:
        """gamma, eta, jet gates, alpha_0 as the model sees them."""
        out = {}
        for segment in self.segments:
            out.update(segment.physical_params(params))
        return out

    def transform_qk(self, params, q, k, q_positions, k_positions, origin=None):
        """Per-position maps so that q2 . k2 is the encoded score.

        Args:
          params: from init_params().
          q: [B, T, N, H]; k: [B, S, N, H]; floating point.
          q_positions: int32 [T] or [B, T]; k_positions: int32 [S] or [B, S].
          origin: optional int32 scalar or [B] where positions are measured from;
            exact variants do not depend on it, and the default (the window's
            midpoint) keeps every factor bounded by the span.
        Returns:
          (q2, k2) shaped like q and k, in their dtype (float32 when `keeps_float32`).
        """
        if jnp.ndim(q) == jnp.ndim(k) == 4 and q.shape[0] != k.shape[0]:
            raise ValueError(
                f"q and k must have the same batch size B: q is {tuple(q.shape)}, k is "
                f"{tuple(k.shape)}."
            )
        if origin is None and self.segments:
            for name, x, positions in (("q", q, q_positions), ("k", k, k_positions)):
                if jnp.ndim(x) == 4:
                    check_positions_fit(f"{name}_positions", positions, name, x.shape[:2])
            origin = default_origin(
                _as_batched_positions(q_positions), _as_batched_positions(k_positions)
            )
        return (
            self.map_queries(params, q, q_positions, origin),
            self.map_keys(params, k, k_positions, origin),
        )

    def map_queries(self, params, q, q_positions, origin=0, *, packed=False):
        """The query half of transform_qk: q2 = A(-(i - o))^{-T} q.

        q: floating [B, T, N, H]; q_positions: int32 [T] or [B, T]; origin: int32
        scalar, [B], or [B|1, T] (one per query, for packed rows). A query and a
        key give the encoded score only when mapped from the same origin; with
        damping, keep |p - o| below ~88 / gamma (float32 range).
        packed: the rows hold packed sequences whose positions restart (else
        refused); the caller masks by segment.
        Returns [B, T, N, H] (float32 when `keeps_float32`, else q's dtype).
        """
        q2 = self._map("q", q, q_positions, origin, params, "map_queries", packed)
        if self.cfg.learn_temperature:  # e^{t_h} q: the logits of head h times e^{t_h}
            q2 = (q2 * jnp.exp(params["temperature"]).reshape(1, 1, -1, 1)).astype(q2.dtype)
        return q2

    def map_keys(self, params, k, k_positions, origin=0, *, packed=False):
        """The key half of transform_qk: k2 = A(-(j - o)) k.

        k: floating [B, S, N, H]; k_positions: int32 [S] or [B, S] ([1] or [B, 1]
        broadcast over S); origin: int32 scalar, [B], or [B|1, S] (one per key).
        packed: as in map_queries. Returns [B, S, N, H].
        """
        return self._map("k", k, k_positions, origin, params, "map_keys", packed)

    def move_keys(self, params, k2, shift):
        """Keys mapped from origin o, re-expressed as mapped from origin o + shift.

        By the group law A(-(j - o - shift)) = A(shift) A(-(j - o)): one map,
        the same for every key of a row. The stabilized variants' shear reads
        absolute positions and ignores the origin, so they move by their
        damped rotation alone, which commutes with the shear.
        k2: [B, S, N, H] from map_keys; shift: int32 scalar or [B].
        Returns [B, S, N, H] like map_keys.
        """
        displacement = -jnp.asarray(shift, jnp.int32).reshape(-1, 1)
        shear = self.cfg.is_translation_invariant
        return self._map("k", k2, displacement, 0, params, "map_keys", shear=shear)

    @property
    def shear_order(self) -> int:
        """The shear kernels' number of terms: the largest chain order that shears (1: none)."""
        return max((s.order for s in self.segments if s.shear == "eta"), default=1)

    def shear_terms(self, params, x, positions, origin, *, queries: bool) -> tuple[jax.Array, ...]:
        """One side's terms of the shear kernels' score sum_r lag^r q_r . k_r (jrope.attention.shear).

        Term 0 is the whole damped-rotated head (the maps without the shear);
        term r >= 1, per shearing segment, the damped-rotated chain elements
        a < m - r times eta^r / r! (queries) or the elements a + r (keys).
        x: [B, L, N, H]; positions int32 [B|1, L]; origin: int32 [B|1, 1] or one
        per token [B|1, L]. Returns float32 (float64 for float64 x) [B, L, N, d_r] per term.
        """
        if not self.segments:
            return (x.astype(pe_math.real_dtype(x)),)
        heads_0, shifted = [], [[] for _ in range(self.shear_order)]
        for segment in self.segments:
            window = x[..., segment.start : segment.start + segment.width]
            apply = segment.map_queries if queries else segment.map_keys
            rotated = apply(params, window, positions, origin, shear=False)
            heads_0.append(rotated)
            if segment.shear != "eta":
                continue
            m = segment.order
            blocks = rotated.reshape(rotated.shape[:-1] + (segment.num_blocks, m, 2))
            eta = segment.physical_params(params)["eta"]  # [N, nb]
            for r in range(1, m):
                if queries:
                    weight = (eta**r / math.factorial(r)).reshape((1, 1) + eta.shape + (1, 1))
                    part = blocks[..., : m - r, :] * weight
                else:
                    part = blocks[..., r:, :]
                shifted[r].append(part.reshape(part.shape[:3] + (-1,)))
        return (_concat(heads_0), *[_concat(parts) for parts in shifted[1:]])

    def term_rates(self, params) -> list[tuple[jax.Array, jax.Array]]:
        """Per shear term, the damping and frequency of each (re, im) pair of its dims.

        Laid out as shear_terms lays out the term's dims: (gamma float32 [N, d_r / 2],
        omega float32 [d_r / 2]). Moving a key mapped from origin o_k to origin o
        multiplies each pair by e^{gamma (o_k - o)} R(-omega (o_k - o)).
        """
        if not self.segments:
            half = self.head_dim // 2
            return [(jnp.zeros((self.num_heads, half)), jnp.zeros((half,)))]
        rates = [([], []) for _ in range(self.shear_order)]
        for segment in self.segments:
            heads, blocks, m = segment.num_heads, segment.num_blocks, segment.order
            physical = segment.physical_params(params)
            gamma = physical.get("gamma", jnp.zeros((heads, blocks), jnp.float32))
            gamma = jnp.broadcast_to(gamma[..., None], (heads, blocks, m))
            omega = jnp.broadcast_to(segment.frequencies()[:, None], (blocks, m))
            for r in range(min(m, self.shear_order) if segment.shear == "eta" else 1):
                rates[r][0].append(gamma[..., r:].reshape(heads, -1))
                rates[r][1].append(omega[..., r:].reshape(-1))
        return [(_concat(g), _concat(w)) for g, w in rates]

    def _map(self, name, x, positions, origin, params, method, packed=False, **options):
        """Applies each segment's `method` (map_queries or map_keys) on its dims of x."""
        check_floating(name, x)
        if not self.segments:
            return x
        if x.ndim != 4 or x.shape[-2:] != (self.num_heads, self.head_dim):
            raise ValueError(
                f"{name} must be [B, T, {self.num_heads}, {self.head_dim}], got {x.shape}"
            )
        check_positions_fit(f"{name}_positions", positions, name, x.shape[:2])
        positions = _as_batched_positions(positions, packed)
        origin = jnp.asarray(origin, jnp.int32)
        # A scalar or one origin per row [B] -> [B|1, 1]; one per position stays [B|1, T].
        origin = origin if origin.ndim == 2 else origin.reshape(-1, 1)
        parts = []
        for segment in self.segments:
            window = x[..., segment.start : segment.start + segment.width]
            parts.append(getattr(segment, method)(params, window, positions, origin, **options))
        return _concat(parts).astype(
            jnp.promote_types(x.dtype, jnp.float32) if self.keeps_float32 else x.dtype
        )

    def logit_bias(self, params, q_positions, k_positions):
        """ALiBi: -slope_h * max(i - j, 0), float32 [N, T, S] ([B, N, T, S] for batched positions).

        None for variants without a bias.
        """
        del params  # the slopes are fixed
        if not self.cfg.alibi:
            return None
        q_positions = jnp.asarray(q_positions, jnp.int32)
        k_positions = jnp.asarray(k_positions, jnp.int32)
        lag = jnp.maximum(q_positions[..., :, None] - k_positions[..., None, :], 0)
        slopes = jnp.asarray(alibi_slopes(self.num_heads))
        slopes = slopes.reshape((1,) * (lag.ndim - 2) + (self.num_heads, 1, 1))
        return -slopes * lag[..., None, :, :].astype(jnp.float32)

    def transform_logits(self, params, logits):
        """The logits after the encoding's elementwise map of each head's scaled logits (bias
        added), before the mask and the softmax: float [B, N, T, S] -> [B, N, T, S].

        The identity (the logits themselves, no op) but for the logit soft-cap
        cap * tanh(logits / cap). A kernel that applies it declares LOGITS.
        """
        if not self.cfg.logit_softcap:
            return logits
        cap = self.cfg.logit_softcap
        return cap * jnp.tanh(logits / cap)

    def relative_logits(self, params, q, k, q_positions, k_positions):
        """The O(T^2) relative (oracle) form of attention_logits, for exact variants.

        Builds q_i^T G(i - j) k_j from the closed form over the lag matrix
        (docs/mathematics.md, section 5). q: [B, T, N, H]; k: [B, S, N, H]. Returns [B, N, T, S].
        """
        if not self.cfg.is_translation_invariant:
            raise ValueError(
                f"{self.cfg.name} is not translation invariant: it has no relative form"
            )
        check_supported(self, RELATIVE_FEATURES, "relative_logits")
        q_pos = _as_batched_positions(q_positions)
        k_pos = _as_batched_positions(k_positions)
        lags = q_pos[:, :, None] - k_pos[:, None, :]
        logits = jnp.zeros((q.shape[0], self.num_heads, q.shape[1], k.shape[1]), jnp.float32)
        covered = 0
        for segment in self.segments:
            window = slice(segment.start, segment.start + segment.width)
            shape = (segment.num_blocks, 2 * segment.order)
            qs = q[..., window].reshape(q.shape[:3] + shape)
            ks = k[..., window].reshape(k.shape[:3] + shape)
            operators = segment.relative_operators(params, lags)
            logits = logits + pe_math.relative_block_logits(qs, ks, operators)
            covered += segment.width
        if covered < self.head_dim:  # no rotary part: a plain dot product
            logits = logits + jnp.einsum(
                "btnh,bsnh->bnts",
                q.astype(jnp.float32),
                k.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST,
            )
        logits = logits / math.sqrt(self.head_dim)
        return add_bias(logits, self.logit_bias(params, q_positions, k_positions))


def unsupported_features(encoding: Encoding, supported: frozenset[str]) -> list[str]:
    """The encoding's features that a kernel supporting `supported` does not take, sorted."""
    return sorted(encoding.features - supported)


def check_supported(encoding: Encoding, supported: frozenset[str], kernel: str) -> None:
    """Raises ValueError naming the first feature of `encoding` that `kernel` does not take."""
    missing = unsupported_features(encoding, supported)
    if missing:
        raise ValueError(
            f"{kernel} does not take {encoding.name}'s {missing[0]}; run it with "
            "jrope.attention.causal_attention on a kernel that choose_kernel accepts."
        )


def make_encoding(
    cfg: PEConfig, num_heads: int, head_dim: int, *, max_length: int | None = None
) -> Encoding:
    """Builds the Encoding of `cfg` for heads of width `head_dim`.

    max_length: the longest window the encoding will see (training context or
      longest evaluation length, whichever is larger); default 8 * train_context.
      Encodings whose shear can outgrow the rotation within it keep float32 q and
      k and ask for full-precision attention dots (Encoding.keeps_float32).
    """
    if head_dim % cfg.head_block:
        raise ValueError(
            f"{cfg.name}: head_dim {head_dim} is not divisible by {cfg.head_block} "
            f"(PEConfig.head_block); choose d_model / num_heads as a multiple of {cfg.head_block}"
        )
    if cfg.layout == "none":
        segments = ()
    elif cfg.layout in ("rope", "jordan"):
        order = 1 if cfg.layout == "rope" else cfg.order
        segments = (JordanSegment(0, head_dim, order, num_heads, cfg),)
    else:
        half = head_dim // 2
        rope = dataclasses.replace(cfg, layout="rope", learn_gamma=False, shear="none")
        real_jordan = dataclasses.replace(cfg, layout="jordan", order=2, rotate=False)
        segments = (
            JordanSegment(0, half, 1, num_heads, rope),
            JordanSegment(half, half, 2, num_heads, real_jordan),
        )
    max_length = 8 * cfg.train_context if max_length is None else max_length
    return Encoding(cfg, num_heads, head_dim, segments, max_length)


def attention_logits(
    enc: Encoding, params, q, k, q_positions, k_positions, *, precision=None
) -> jax.Array:
    """Encoded attention logits before mask and softmax, float32 [B, N, T, S].

    transform_logits(q2 . k2 / sqrt(H) + bias), with q: [B, T, N, H] and k: [B, S, N, H].
    precision: of the q.k dot (a jax.lax.Precision); default: enc.dot_precision.
    """
    q2, k2 = enc.transform_qk(params, q, k, q_positions, k_positions)
    dots = enc.dot_precision if precision is None else precision
    logits = jnp.einsum(
        "btnh,bsnh->bnts", q2, k2, preferred_element_type=jnp.float32, precision=dots
    )
    logits = add_bias(
        logits / math.sqrt(enc.head_dim), enc.logit_bias(params, q_positions, k_positions)
    )
    return enc.transform_logits(params, logits)


def add_bias(logits: jax.Array, bias: jax.Array | None) -> jax.Array:
    """logits [B, N, T, S] + bias [N, T, S] or [B, N, T, S] (None: unchanged)."""
    if bias is None:
        return logits
    return logits + (bias[None] if bias.ndim == 3 else bias)


def _concat(parts: list[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, -1)
