"""One run of Jordan blocks on a slice of the head: its parameters and its maps of q and k.

An Encoding (jrope.encodings) is one or two segments side by side: RoPE is
the order-1 segment without damping or shear, a Jordan head one order-m
segment, the direct sum a RoPE half beside a real-Jordan half. A segment
turns positions into the factors of docs/mathematics.md, section 3 (the
rotation, the damping, the chain coefficients of U(t)) and applies them with
jrope.pe_math's map tables.

Shape legend: B batch, T query length, S key length, N heads, nb blocks per
segment, m chain order.
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


# The smallest |alpha_0| of jetmixfull, as a fraction of jet_gate_max: the query map divides
# by alpha_0, so one that crosses zero would give NaN logits and gradients (docs/numerics.md,
# section 8: a departure from the reference).
JET_BASE_FLOOR_FRACTION = 0.05


def floored_jet_base(alpha_0: jax.Array, jet_gate_max: float) -> jax.Array:
    """alpha_0 with its magnitude held at least JET_BASE_FLOOR_FRACTION * jet_gate_max, sign kept."""
    floor = JET_BASE_FLOOR_FRACTION * jet_gate_max
    sign = jnp.where(alpha_0 < 0, -1.0, 1.0)
    return jnp.where(jnp.abs(alpha_0) < floor, sign * floor, alpha_0)


def _lead(x: jax.Array, rank: int) -> jax.Array:
    """Prepends `rank` unit axes (explicit broadcasting: rank promotion raises)."""
    x = jnp.asarray(x)
    return x.reshape((1,) * rank + x.shape)


def _scaled(coefficients: list, scale: jax.Array | None) -> list:
    """Chain coefficients times a damping factor; static zeros stay python zeros."""
    if scale is None:
        return coefficients
    return [c if isinstance(c, float) and c == 0.0 else scale * c for c in coefficients]


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

    def parameters(self) -> dict[str, tuple[np.ndarray, tuple[str | None, ...]]]:
        """Each learnable parameter's initial value, float32 [N, nb] ([m - 1, N, nb] for the jet
        gates), with its logical axes (jrope.model.axes), by name."""
        cfg, shape = self.cfg, (self.num_heads, self.num_blocks)
        per_head = ("heads", None)
        params = {}
        if self.learn_gamma:
            gamma = _inverse_softplus(cfg.init_gamma - cfg.gamma_min)
            params["gamma_raw"] = (np.full(shape, gamma), per_head)
        if self.shear == "eta":
            params["eta_raw"] = (
                np.full(shape, _inverse_tanh_bounded(cfg.init_eta, cfg.eta_max)),
                per_head,
            )
        if self.shear == "jet":
            gates = [_inverse_tanh_bounded(g, cfg.jet_gate_max) for g in cfg.jet_gates]
            gates = np.broadcast_to(np.asarray(gates)[:, None, None], (len(gates),) + shape)
            params["jet_gates_raw"] = (gates.copy(), (None, "heads", None))
            if cfg.jet_base is not None:
                base = _inverse_tanh_bounded(cfg.jet_base, cfg.jet_gate_max)
                params["jet_base_raw"] = (np.full(shape, base), per_head)
        return {name: (value.astype(np.float32), axes) for name, (value, axes) in params.items()}

    def physical_params(self, params) -> dict[str, jax.Array]:
        """gamma, eta, jet gates and alpha_0 from the raw parameters (absent ones omitted)."""
        cfg, out = self.cfg, {}
        if self.learn_gamma:
            out["gamma"] = cfg.gamma_min + jax.nn.softplus(params["gamma_raw"])
        if self.shear == "eta":
            out["eta"] = cfg.eta_max * jnp.tanh(params["eta_raw"])
        if self.shear == "jet":
            out["jet_gates"] = cfg.jet_gate_max * jnp.tanh(params["jet_gates_raw"])
            if cfg.jet_base is not None:
                out["jet_base"] = floored_jet_base(
                    cfg.jet_gate_max * jnp.tanh(params["jet_base_raw"]), cfg.jet_gate_max
                )
        return out

    def largest_shear_term(self, max_length: int) -> float:
        """The largest sum of |c_r|, 1 <= r < m, that positions within max_length can reach.

        The shear's chain coefficients against c_0 = 1: their size is how
        far a map's entries exceed the rotation's, so how much a score's
        terms cancel (docs/numerics.md, section 3). Stabilized (bounded)
        time reads the absolute position and approaches L at any offset;
        raw time is measured from an origin inside the window, at most
        max_length away. Jet coefficients are bounded by jet_gate_max, and a
        learned alpha_0, inverted in the query map, by its floor.
        """
        cfg = self.cfg
        if self.shear == "none" or self.order < 2:
            return 0.0
        clock = cfg.clock
        time = clock.scale * (clock.train_context if clock.bounded else max_length)
        if self.shear == "eta":
            return sum((cfg.eta_max * time) ** r / math.factorial(r) for r in range(1, self.order))
        total = sum(cfg.jet_gate_max * time**r / math.factorial(r) for r in range(1, self.order))
        if cfg.jet_base is not None:
            total /= JET_BASE_FLOOR_FRACTION * cfg.jet_gate_max
        return total

    def chain_coefficients(self, physical, t: jax.Array) -> list:
        """c_r of U(t), r < m, each [..., N, nb] for times t [...] (python 1.0 for c_0 = 1)."""
        if self.shear == "none":
            return [1.0] + [0.0] * (self.order - 1)
        time = self.cfg.clock(t, pe_math.real_dtype(t))[..., None, None]  # s(t) / eta
        if self.shear == "eta":
            return pe_math.shear_series(_lead(physical["eta"], time.ndim - 2) * time, self.order)
        gates = _lead(physical["jet_gates"], time.ndim - 2)  # [..., m-1, N, nb]
        base = physical.get("jet_base")
        coefficients = [1.0 if base is None else _lead(base, time.ndim - 2)]
        for r in range(1, self.order):
            coefficients.append(gates[..., r - 1, :, :] * time**r / math.factorial(r))
        return coefficients

    def _rotation_and_scale(self, physical, positions, origin, sign, dtype):
        """cos, sin [B|1, T, 1, nb] of omega (p - o) and the damping e^{sign gamma (p - o)}.

        Damping and rotation depend only on i - j, so they are measured from
        the origin; the damping is None for encodings without one. dtype: of
        the arithmetic (float32; float64 for the oracle).
        """
        rel = (positions - origin).astype(dtype)
        angle = rel[..., None, None] * _lead(self.frequencies().astype(dtype), 3)
        scale = None
        if "gamma" in physical:
            scale = jnp.exp(sign * _lead(physical["gamma"], 2) * rel[..., None, None])
        return jnp.cos(angle), jnp.sin(angle), scale

    def _map_time(self, positions, origin, dtype):
        """-p for the shear of U(-p): exact shear reads p - o, stabilized shear the true p."""
        shear_positions = positions - origin if self.cfg.is_translation_invariant else positions
        return -shear_positions.astype(dtype)

    def _blocks(self, x):
        """x [..., width] -> [..., nb, m, 2] in the maps' arithmetic (pe_math.real_dtype)."""
        blocks = x.reshape(x.shape[:-1] + (self.num_blocks, self.order, 2))
        return blocks.astype(pe_math.real_dtype(x))

    def map_queries(self, params, q, q_pos, origin, *, shear: bool = True):
        """A(-(i - o))^{-T} q on this segment's dims, float32 (float64 for float64 q) [B, T, N, width].

        q: [B, T, N, width]; q_pos: int32 [B|1, T]; origin: int32 [B|1, 1].
        shear=False applies the damped rotation alone.
        """
        physical, dtype = self.physical_params(params), pe_math.real_dtype(q)
        cos, sin, scale = self._rotation_and_scale(physical, q_pos, origin, -1.0, dtype)
        time = self._map_time(q_pos, origin, dtype)
        if not shear:
            inverse = [1.0]
        elif self.shear == "eta":
            # U(t) = exp(s(t) N) with s odd: U(-p)^{-1} = U(p), no series inversion needed.
            inverse = self.chain_coefficients(physical, -time)
        else:
            inverse = pe_math.toeplitz_series_inverse(self.chain_coefficients(physical, time))
        # The damping rides on the coefficients: one rotation table serves every layer (map_tables).
        q2 = pe_math.query_map(self._blocks(q), cos, sin, _scaled(inverse, scale))
        return q2.reshape(q.shape)

    def map_keys(self, params, k, k_pos, origin, *, shear: bool = True):
        """A(-(j - o)) k on this segment's dims, float32 (float64 for float64 k) [B, S, N, width].

        k: [B, S, N, width]; k_pos: int32 [B|1, S] (or [B|1, 1], broadcast
        over S); origin: int32 [B|1, 1]. shear=False applies the damped
        rotation alone.
        """
        physical, dtype = self.physical_params(params), pe_math.real_dtype(k)
        cos, sin, scale = self._rotation_and_scale(physical, k_pos, origin, +1.0, dtype)
        if shear:
            coefficients = self.chain_coefficients(physical, self._map_time(k_pos, origin, dtype))
        else:
            coefficients = [1.0]
        k2 = pe_math.key_map(self._blocks(k), cos, sin, _scaled(coefficients, scale))
        return k2.reshape(k.shape)

    def relative_operators(self, params, lags: jax.Array) -> jax.Array:
        """Closed-form G(d) for exact segments, [..., N, nb, 2m, 2m] for lags [...]."""
        physical = self.physical_params(params)
        lags = jnp.asarray(lags, jnp.float32)
        gamma = physical.get("gamma", jnp.zeros((self.num_heads, self.num_blocks), jnp.float32))
        omega = _lead(self.frequencies(), lags.ndim + 1)
        d = lags[..., None, None]
        coefficients = self.chain_coefficients(physical, lags)
        angle, log_scale = omega * d, -_lead(gamma, lags.ndim) * d
        return pe_math.real_block_operator(angle, log_scale, coefficients, self.order)
