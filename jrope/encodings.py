"""Positional encodings behind one interface: `transform_qk` and `logit_bias`.

`make_encoding(cfg, num_heads, head_dim)` turns a PEConfig into an
`Encoding`, which owns no state: its learnable parameters (gamma, eta, jet
gates, per head and per block) live in a plain dict made by `init_params()`
and passed back in, so the same object serves jit, grad and sharding.

Every variant is a per-position linear map on q and k followed by an
ordinary dot product (docs/mathematics.md, section 3), plus an optional additive bias, so
it works with any attention kernel.

Shape legend: B batch, T query length, S key length, N heads, H head dim,
nb blocks per head, m chain order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jrope import pe_math
from jrope.pe_config import PEConfig

# Reference-code margin: a softplus cannot reach zero, so a gamma initialised
# at its floor starts this far above it (and keeps a usable gradient).
_GAMMA_FLOOR_MARGIN = 1e-8
# Reference-code clamp for initialising a tanh-bounded value at its bound.
_TANH_INIT_LIMIT = 0.999999


def _inverse_softplus(value: float) -> float:
    value = max(value, _GAMMA_FLOOR_MARGIN)
    return value + math.log(-math.expm1(-value))


def _inverse_tanh_bounded(value: float, bound: float) -> float:
    return math.atanh(min(max(value / bound, -_TANH_INIT_LIMIT), _TANH_INIT_LIMIT))


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes 2^(-8k/n), k = 1..n, with the standard fill for non-powers of two.

    For n not a power of two: the slopes of the closest smaller power c,
    then every other slope of 2c, up to n. float32 [N].
    """

    def power_of_two(n):
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, np.float32)


def _lead(x: jax.Array, rank: int) -> jax.Array:
    """Prepends `rank` unit axes (explicit broadcasting: rank promotion raises)."""
    x = jnp.asarray(x)
    return x.reshape((1,) * rank + x.shape)


def _as_batched_positions(positions) -> jax.Array:
    """int32 [T] or [B, T] -> int32 [B|1, T]."""
    positions = jnp.asarray(positions)
    if positions.ndim not in (1, 2):
        raise ValueError(f'positions must be [T] or [B, T], got shape {positions.shape}')
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f'positions must be integers, got {positions.dtype}')
    positions = positions.astype(jnp.int32)
    return positions[None] if positions.ndim == 1 else positions


def _scaled(coefficients: list, scale: jax.Array | None) -> list:
    """Chain coefficients times a damping factor; static zeros stay python zeros."""
    if scale is None:
        return coefficients
    return [c if isinstance(c, float) and c == 0.0 else scale * c for c in coefficients]


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
class JordanSegment:
    """Order-m Jordan blocks on head dims [start, start + width).

    The settings come from the PEConfig; RoPE is the order-1 segment with no
    damping and no shear.
    """

    start: int
    width: int
    order: int
    num_heads: int
    cfg: PEConfig

    @property
    def num_blocks(self) -> int:
        return self.width // (2 * self.order)

    @property
    def learn_gamma(self) -> bool:
        return self.cfg.learn_gamma

    @property
    def shear(self) -> str:
        return self.cfg.shear

    def frequencies(self) -> jax.Array:
        """Signed omega [nb] of G(d) = e^{-gamma d} R(omega d) (x) U(d); zero for real Jordan.

        The Jordan maps use A(-p) = e^{-lambda p}, which rotates q and k by
        R(-omega p) and gives the phase e^{+i omega (i - j)}. Standard RoPE (and
        the reference's RotaryEmbedding) rotates by R(+omega p) instead, which is
        the same machinery with omega negated; each keeps its reference's sign.
        """
        omega = pe_math.rotary_frequencies(self.num_blocks, self.width, self.cfg.theta)
        if not self.cfg.rotate:
            return jnp.zeros_like(omega)
        return -omega if self.order == 1 else omega

    def init_params(self) -> dict[str, jax.Array]:
        cfg, shape = self.cfg, (self.num_heads, self.num_blocks)
        params = {}
        if self.learn_gamma:
            params['gamma_raw'] = np.full(shape, _inverse_softplus(cfg.init_gamma - cfg.gamma_min))
        if self.shear == 'eta':
            params['eta_raw'] = np.full(shape, _inverse_tanh_bounded(cfg.init_eta, cfg.eta_max))
        if self.shear == 'jet':
            gates = [_inverse_tanh_bounded(g, cfg.jet_gate_max) for g in cfg.jet_gates]
            params['jet_gates_raw'] = np.broadcast_to(
                np.asarray(gates)[:, None, None], (len(gates),) + shape
            ).copy()
            if cfg.jet_base is not None:
                params['jet_base_raw'] = np.full(
                    shape, _inverse_tanh_bounded(cfg.jet_base, cfg.jet_gate_max)
                )
        return {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}

    def physical_params(self, params) -> dict[str, jax.Array]:
        """gamma, eta, jet gates and alpha_0 from the raw parameters (absent ones omitted)."""
        cfg, out = self.cfg, {}
        if self.learn_gamma:
            out['gamma'] = cfg.gamma_min + jax.nn.softplus(params['gamma_raw'])
        if self.shear == 'eta':
            out['eta'] = cfg.eta_max * jnp.tanh(params['eta_raw'])
        if self.shear == 'jet':
            out['jet_gates'] = cfg.jet_gate_max * jnp.tanh(params['jet_gates_raw'])
            if cfg.jet_base is not None:
                out['jet_base'] = cfg.jet_gate_max * jnp.tanh(params['jet_base_raw'])
        return out

    def shear_time(self, t: jax.Array) -> jax.Array:
        """s(t) / eta: the scaled raw or bounded time, float32."""
        t = jnp.asarray(t, jnp.float32)
        if self.cfg.shear_time == 'bounded':
            t = pe_math.bounded_time(t, self.cfg.train_context)
        return self.cfg.shear_scale * t

    def chain_coefficients(self, physical, t: jax.Array) -> list:
        """c_r of U(t), r < m, each [..., N, nb] for times t [...] (python 1.0 for c_0 = 1)."""
        if self.shear == 'none':
            return [1.0] + [0.0] * (self.order - 1)
        time = self.shear_time(t)[..., None, None]
        if self.shear == 'eta':
            return pe_math.shear_series(_lead(physical['eta'], time.ndim - 2) * time, self.order)
        gates = _lead(physical['jet_gates'], time.ndim - 2)  # [..., m-1, N, nb]
        base = physical.get('jet_base')
        coefficients = [1.0 if base is None else _lead(base, time.ndim - 2)]
        for r in range(1, self.order):
            coefficients.append(gates[..., r - 1, :, :] * time**r / math.factorial(r))
        return coefficients

    def _rotation_and_scale(self, physical, positions, origin, sign):
        """cos, sin [B|1, T, 1, nb] of omega (p - o) and the damping e^{sign gamma (p - o)}.

        Damping and rotation depend only on i - j, so they are measured from
        the origin; the damping is None for encodings without one.
        """
        rel = (positions - origin).astype(jnp.float32)
        angle = rel[..., None, None] * _lead(self.frequencies(), 3)
        scale = None
        if 'gamma' in physical:
            scale = jnp.exp(sign * _lead(physical['gamma'], 2) * rel[..., None, None])
        return jnp.cos(angle), jnp.sin(angle), scale

    def _map_time(self, positions, origin):
        """-p for the shear of U(-p): exact shear reads p - o, stabilized shear the true p."""
        shear_positions = positions - origin if self.cfg.is_translation_invariant else positions
        return -shear_positions.astype(jnp.float32)

    def _blocks(self, x):
        return x.reshape(x.shape[:-1] + (self.num_blocks, self.order, 2)).astype(jnp.float32)

    def map_queries(self, params, q, q_pos, origin):
        """A(-(i - o))^{-T} q on this segment's dims, float32 [B, T, N, width].

        q: [B, T, N, width]; q_pos: int32 [B|1, T]; origin: int32 [B|1, 1].
        """
        physical = self.physical_params(params)
        cos, sin, scale = self._rotation_and_scale(physical, q_pos, origin, -1.0)
        time = self._map_time(q_pos, origin)
        if self.shear == 'eta':
            # U(t) = exp(s(t) N) with s odd: U(-p)^{-1} = U(p), no series inversion needed.
            inverse = self.chain_coefficients(physical, -time)
        else:
            inverse = pe_math.toeplitz_series_inverse(self.chain_coefficients(physical, time))
        # The damping is carried by the chain coefficients, not by cos and sin:
        # the rotation then does not depend on heads or parameters, so one
        # [T, nb] table of it serves every layer (see pe_math.map_tables).
        q2 = pe_math.query_map(self._blocks(q), cos, sin, _scaled(inverse, scale))
        return q2.reshape(q.shape)

    def map_keys(self, params, k, k_pos, origin, *, shear: bool = True):
        """A(-(j - o)) k on this segment's dims, float32 [B, S, N, width].

        k: [B, S, N, width]; k_pos: int32 [B|1, S] (or [B|1, 1], broadcast
        over S); origin: int32 [B|1, 1]. shear=False applies the damped
        rotation alone.
        """
        physical = self.physical_params(params)
        cos, sin, scale = self._rotation_and_scale(physical, k_pos, origin, +1.0)
        if shear:
            coefficients = self.chain_coefficients(physical, self._map_time(k_pos, origin))
        else:
            coefficients = [1.0]
        k2 = pe_math.key_map(self._blocks(k), cos, sin, _scaled(coefficients, scale))
        return k2.reshape(k.shape)

    def relative_operators(self, params, lags: jax.Array) -> jax.Array:
        """Closed-form G(d) for exact segments, [..., N, nb, 2m, 2m] for lags [...]."""
        physical = self.physical_params(params)
        lags = jnp.asarray(lags, jnp.float32)
        gamma = physical.get('gamma', jnp.zeros((self.num_heads, self.num_blocks), jnp.float32))
        omega = _lead(self.frequencies(), lags.ndim + 1)
        d = lags[..., None, None]
        coefficients = self.chain_coefficients(physical, lags)
        return pe_math.real_block_operator(
            omega * d, -_lead(gamma, lags.ndim) * d, coefficients, self.order
        )


@dataclasses.dataclass(frozen=True)
class Encoding:
    """A positional encoding for `num_heads` heads of width `head_dim`."""

    cfg: PEConfig
    num_heads: int
    head_dim: int
    segments: tuple[JordanSegment, ...]

    @property
    def has_bias(self) -> bool:
        return self.cfg.alibi

    @property
    def keeps_float32(self) -> bool:
        """Whether transform_qk returns float32 whatever the input dtype.

        Shear with an unscaled time makes q1' = q1 + s q0 with s up to eta * L or
        eta * T: the lag term of the score is then a difference of large products
        that bfloat16 cannot resolve (docs/numerics.md, section 3).
        """
        return (
            self.cfg.shear == 'eta'
            and self.cfg.shear_scale == 1.0
            and any(s.order >= 2 for s in self.segments)
        )

    @property
    def dot_precision(self) -> jax.lax.Precision | None:
        """The precision the q.k and p.v dots need to keep this encoding's logits.

        HIGHEST (full float32) where the logits cancel large products
        (`keeps_float32`): on TPU a float32 dot otherwise runs as bfloat16
        passes and on recent NVIDIA GPUs as TF32, which loses the lag term
        inside the dot itself. None (the backend's default) for the others.
        """
        return jax.lax.Precision.HIGHEST if self.keeps_float32 else None

    @property
    def param_logical_axes(self) -> dict[str, tuple[str | None, ...]]:
        axes = {
            'gamma_raw': ('heads', None),
            'eta_raw': ('heads', None),
            'jet_gates_raw': (None, 'heads', None),
            'jet_base_raw': ('heads', None),
        }
        return {name: axes[name] for name in self.init_params()}

    def init_params(self) -> dict[str, jax.Array]:
        """The learnable parameters at their configured initial values (float32)."""
        params = {}
        for segment in self.segments:
            params.update(segment.init_params())
        return params

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
          q: [B, T, N, H]; k: [B, S, N, H].
          q_positions: int32 [T] or [B, T]; k_positions: int32 [S] or [B, S].
          origin: optional int32 scalar or [B]: where positions are measured
            from. Exact variants give the same logits for any origin; the default
            (the window's midpoint) keeps every factor bounded by the span.
        Returns:
          (q2, k2), shaped like q and k; dtype of q and k, or float32 when
          `keeps_float32`.
        """
        if origin is None and self.segments:
            origin = default_origin(
                _as_batched_positions(q_positions), _as_batched_positions(k_positions)
            )
        return (
            self.map_queries(params, q, q_positions, origin),
            self.map_keys(params, k, k_positions, origin),
        )

    def map_queries(self, params, q, q_positions, origin=0):
        """The query half of transform_qk: q2 = A(-(i - o))^{-T} q.

        q: [B, T, N, H]; q_positions: int32 [T] or [B, T]; origin: int32
        scalar or [B]. A query and a key give the encoded score only when both
        are mapped from the same origin; with damping, keep |p - o| below
        ~88 / gamma (float32 range), e.g. the window's first position.
        Returns [B, T, N, H] (float32 when `keeps_float32`, else q's dtype).
        """
        return self._map(
            'q', q, q_positions, origin, lambda seg, x, pos, o: seg.map_queries(params, x, pos, o)
        )

    def map_keys(self, params, k, k_positions, origin=0):
        """The key half of transform_qk: k2 = A(-(j - o)) k.

        k: [B, S, N, H]; k_positions: int32 [S] or [B, S] ([1] or [B, 1]
        broadcast over S); origin: int32 scalar or [B]. Returns [B, S, N, H].
        """
        return self._map(
            'k', k, k_positions, origin, lambda seg, x, pos, o: seg.map_keys(params, x, pos, o)
        )

    def move_keys(self, params, k2, shift):
        """Keys mapped from origin o, re-expressed as mapped from origin o + shift.

        By the group law A(-(j - o - shift)) = A(shift) A(-(j - o)): one map,
        the same for every key of a row. The stabilized variants' shear reads
        absolute positions and ignores the origin, so they move by their
        damped rotation alone, which commutes with the shear.
        k2: [B, S, N, H] from map_keys; shift: int32 scalar or [B].
        Returns [B, S, N, H] like map_keys.
        """
        shear = self.cfg.is_translation_invariant
        displacement = -jnp.asarray(shift, jnp.int32).reshape(-1, 1)
        return self._map(
            'k',
            k2,
            displacement,
            0,
            lambda seg, x, pos, o: seg.map_keys(params, x, pos, o, shear=shear),
        )

    def _map(self, name, x, positions, origin, segment_map):
        """Applies segment_map(segment, x_slice, positions, origin) on every segment's dims."""
        if not self.segments:
            return x
        if x.ndim != 4 or x.shape[-2:] != (self.num_heads, self.head_dim):
            raise ValueError(
                f'{name} must be [B, T, {self.num_heads}, {self.head_dim}], got {x.shape}'
            )
        positions = _as_batched_positions(positions)
        origin = jnp.asarray(origin, jnp.int32).reshape(-1, 1)
        parts = [
            segment_map(
                segment, x[..., segment.start : segment.start + segment.width], positions, origin
            )
            for segment in self.segments
        ]
        mapped = parts[0] if len(parts) == 1 else jnp.concatenate(parts, -1)
        return mapped.astype(jnp.float32 if self.keeps_float32 else x.dtype)

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

    def relative_logits(self, params, q, k, q_positions, k_positions):
        """The O(T^2) relative (oracle) form of attention_logits, for exact variants.

        Builds q_i^T G(i - j) k_j from the closed form over the lag matrix
        (docs/mathematics.md, section 5). q: [B, T, N, H]; k: [B, S, N, H]. Returns [B, N, T, S].
        """
        if not self.cfg.is_translation_invariant:
            raise ValueError(
                f'{self.cfg.name} is not translation invariant: it has no relative form'
            )
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
                'btnh,bsnh->bnts',
                q.astype(jnp.float32),
                k.astype(jnp.float32),
                precision=jax.lax.Precision.HIGHEST,
            )
        logits = logits / math.sqrt(self.head_dim)
        return add_bias(logits, self.logit_bias(params, q_positions, k_positions))


def make_encoding(cfg: PEConfig, num_heads: int, head_dim: int) -> Encoding:
    """Builds the Encoding of `cfg` for heads of width `head_dim`.

    Raises:
      ValueError: when the block size does not divide head_dim (2m for an
        order-m Jordan head, 2 for RoPE, 8 for the direct sum).
    """
    if num_heads <= 0 or head_dim <= 0:
        raise ValueError(f'num_heads and head_dim must be positive, got {num_heads}, {head_dim}')
    if cfg.layout == 'none':
        segments = ()
    elif cfg.layout == 'rope':
        _check_divides(cfg, head_dim, 2, 'RoPE rotates (re, im) pairs')
        segments = (JordanSegment(0, head_dim, 1, num_heads, cfg),)
    elif cfg.layout == 'jordan':
        _check_divides(
            cfg,
            head_dim,
            2 * cfg.order,
            f'an order-{cfg.order} Jordan block spans 2m = {2 * cfg.order} real dims',
        )
        segments = (JordanSegment(0, head_dim, cfg.order, num_heads, cfg),)
    else:
        _check_divides(
            cfg,
            head_dim,
            8,
            'the direct sum splits the head into a RoPE half and an '
            'order-2 real Jordan half of 4-dim blocks',
        )
        half = head_dim // 2
        rope = dataclasses.replace(cfg, layout='rope', learn_gamma=False, shear='none')
        real_jordan = dataclasses.replace(cfg, layout='jordan', order=2, rotate=False)
        segments = (
            JordanSegment(0, half, 1, num_heads, rope),
            JordanSegment(half, half, 2, num_heads, real_jordan),
        )
    return Encoding(cfg, num_heads, head_dim, segments)


def _check_divides(cfg: PEConfig, head_dim: int, block: int, why: str) -> None:
    if head_dim % block:
        raise ValueError(
            f'{cfg.name}: head_dim {head_dim} is not divisible by {block} ({why}); '
            f'choose d_model / num_heads as a multiple of {block}'
        )


def attention_logits(
    enc: Encoding, params, q, k, q_positions, k_positions, *, precision=None
) -> jax.Array:
    """Encoded attention logits before mask and softmax, float32 [B, N, T, S].

    q2 . k2 / sqrt(H) + bias, with q: [B, T, N, H] and k: [B, S, N, H].
    precision: of the q.k dot (a jax.lax.Precision); default: enc.dot_precision.
    """
    q2, k2 = enc.transform_qk(params, q, k, q_positions, k_positions)
    logits = jnp.einsum(
        'btnh,bsnh->bnts',
        q2,
        k2,
        preferred_element_type=jnp.float32,
        precision=enc.dot_precision if precision is None else precision,
    )
    logits = logits / math.sqrt(enc.head_dim)
    return add_bias(logits, enc.logit_bias(params, q_positions, k_positions))


def add_bias(logits: jax.Array, bias: jax.Array | None) -> jax.Array:
    """logits [B, N, T, S] + bias [N, T, S] or [B, N, T, S] (None: unchanged)."""
    if bias is None:
        return logits
    return logits + (bias[None] if bias.ndim == 3 else bias)
