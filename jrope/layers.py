"""Jordan-RoPE (or any jrope encoding) inside another model's attention.

`PositionalEncoding` is a Flax NNX module that owns one attention layer's
encoding parameters (`nnx.Param` tagged with their logical axes) and maps q
and k. It fits any attention that holds q and k as [B, T, N, H] between its
projections and its kernel, such as MaxText's or the Flax Gemma example's:
map q and k there, then use the model's own kernel under the rules below or
one of the two helpers:

  dot_product_attention   jax.nn.dot_product_attention on the mapped q, k:
                          any mask, cross attention, padding.
  causal_self_attention   the jrope kernels (jrope.attention): causal
                          self-attention, long sequences blockwise.

A kernel of one's own follows the rules of docs/library.md, section 1 (scale,
bias, dtype, precision); fused kernels cannot serve the `keeps_float32` encodings.

Shape legend: B batch, T query length, S key length, N heads, H head dim.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrope import attention
from jrope.attention.precision import precision_scope
from jrope.attention.selection import (
    SINGLE_ORIGIN_EXPONENT_LIMIT,
    blockwise_block_size,
    damping_bound,
    single_origin_is_safe,
)
from jrope.attention.shear import shear_attention
from jrope.encodings import (
    BIAS,
    MAP_FEATURES,
    Encoding,
    attention_logits,
    check_floating,
    check_positions_fit,
    check_supported,
)
from jrope.model.axes import LOGICAL_AXES_KEY
from jrope.model.transformer import concrete_span
from jrope.pe_config import PEConfig

# Bytes of the stored encoding description: one shape for every encoding, so that any
# checkpoint restores into any module and the check below, not a shape error, names the
# difference.
RECORD_BYTES = 2048


class EncodingRecord(nnx.Variable):
    """The encoding a PositionalEncoding was built with, as uint8 JSON [RECORD_BYTES] (zero
    padded): saved with the module's state (nnx.state, orbax), not a parameter."""


def encoding_description(encoding: Encoding) -> dict:
    """What makes an encoding's maths: its config (name and every field) and its head shape."""
    config = dataclasses.asdict(encoding.cfg)
    return {
        "config": json.loads(json.dumps(config)),  # tuples as lists, as they read back
        "num_heads": encoding.num_heads,
        "head_dim": encoding.head_dim,
        "max_length": encoding.max_length,
    }


def _differences(stored: dict, built: dict, prefix: str = "") -> list[str]:
    lines = []
    for key in sorted(set(stored) | set(built)):
        was, now = stored.get(key), built.get(key)
        if isinstance(was, dict) and isinstance(now, dict):
            lines += _differences(was, now, f"{prefix}{key}.")
        elif was != now:
            lines.append(f"{prefix}{key} is {was!r} in the state, {now!r} in this module")
    return lines


class PositionalEncoding(nnx.Module):
    """One attention layer's positional encoding: its parameters and its maps of q and k.

    Attributes:
      encoding: the stateless jrope Encoding (make_encoding) holding the maths.
      record: EncodingRecord of the encoding, saved with the state (check_record).
      params: nnx.Dict of float32 nnx.Param, one per `encoding.init_params()`
        entry, its logical axes as `out_sharding` and LOGICAL_AXES_KEY.
    """

    def __init__(self, encoding: Encoding):
        self.encoding = encoding
        text = json.dumps(encoding_description(encoding), sort_keys=True).encode()
        if len(text) > RECORD_BYTES:
            raise ValueError(
                f"The encoding's description takes {len(text)} > {RECORD_BYTES} bytes."
            )
        record = np.frombuffer(text.ljust(RECORD_BYTES, b"\0"), np.uint8)
        self.record = EncodingRecord(jnp.asarray(record))
        axes = encoding.param_logical_axes
        # Flax shards a parameter on creation where a mesh is set (its default); without one
        # the parameters stay plain arrays, sharded later from their partition specs.
        eager = nnx.using_eager_sharding() and not jax.sharding.get_abstract_mesh().empty
        params = {}
        for name, value in encoding.init_params().items():
            tags = {"out_sharding": axes[name], LOGICAL_AXES_KEY: axes[name]}
            params[name] = nnx.Param(value, eager_sharding=eager, **tags)
        self.params = nnx.Dict(params)

    def check_record(self) -> None:
        """Raises ValueError, naming each difference, where the stored record (e.g. restored from
        a checkpoint) describes another encoding than this module's. Runs on every call outside
        jit; inside jit the record is abstract: call it after restoring."""
        stored = self.record.get_value()
        if isinstance(stored, jax.core.Tracer):
            return
        description = json.loads(np.asarray(stored).tobytes().rstrip(b"\0"))
        # A record written before a PEConfig field existed holds that field's default.
        fields = dataclasses.fields(PEConfig)
        defaults = {f.name: f.default for f in fields if f.default is not dataclasses.MISSING}
        description["config"] = {**json.loads(json.dumps(defaults)), **description["config"]}
        differences = _differences(description, encoding_description(self.encoding))
        if differences:
            raise ValueError(
                "This PositionalEncoding's state was saved from another encoding: "
                + "; ".join(differences)
                + ". Build the module with the encoding the checkpoint was trained with."
            )

    def param_values(self) -> dict[str, jax.Array]:
        """The parameters as the plain dict the Encoding's functions take (the record checked)."""
        self.check_record()
        return {name: param[...] for name, param in self.params.items()}

    def __call__(self, q, k, q_positions, k_positions, origin=None):
        """(q2, k2) = encoding.transform_qk: q2 . k2 is the encoded score (before 1/sqrt(H)).

        q: [B, T, N, H]; k: [B, S, N, H]; positions int32 [T] / [S] or [B, T] / [B, S].
        origin: as Encoding.transform_qk (default: the window's midpoint).
        Returns q2, k2 shaped like q, k; float32 when `encoding.keeps_float32`,
        else the inputs' dtype.
        """
        params = self.param_values()
        return self.encoding.transform_qk(params, q, k, q_positions, k_positions, origin)

    def map_queries(self, q, q_positions, origin=0):
        """The query half alone (decoding with a KV cache of mapped keys); see Encoding.map_queries."""
        return self.encoding.map_queries(self.param_values(), q, q_positions, origin)

    def map_keys(self, k, k_positions, origin=0):
        """The key half alone; keys and queries must share `origin`. See Encoding.map_keys."""
        return self.encoding.map_keys(self.param_values(), k, k_positions, origin)

    def logit_bias(self, q_positions, k_positions):
        """The ALiBi bias float32 [N, T, S] ([B, N, T, S] for batched positions), or None."""
        return self.encoding.logit_bias(self.param_values(), q_positions, k_positions)

    def logits(self, q, k, q_positions, k_positions):
        """jrope.attention_logits: float32 [B, N, T, S], scaled by 1/sqrt(H), bias added."""
        return attention_logits(self.encoding, self.param_values(), q, k, q_positions, k_positions)


def dot_product_attention(
    pe: PositionalEncoding,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    k_positions: jax.Array,
    *,
    mask: jax.Array | None = None,
    is_causal: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """jax.nn.dot_product_attention of raw q, k, v with `pe` applied, at the dtype and precision it needs.

    Maps q and k, passes the encoding's bias, runs v in the mapped q's dtype
    and the dots at `pe.encoding.dot_precision`. Encodings whose maps would
    need float32 q, k and HIGHEST dots and whose shear is an exact per-pair
    weight run the shear kernel instead (jrope.attention.shear), with the
    same mask and bias, dots in q's dtype at the default precision.

    Args:
      q: [B, T, N, H]; k, v: [B, S, N, H] (raw: not yet position-encoded).
      q_positions: int32 [T] or [B, T]; k_positions: int32 [S] or [B, S].
      mask: optional bool [B|1, N|1, T, S], True where a query sees a key.
      is_causal: jax's causal mask (query t sees keys <= t, counted from 0).
      implementation: None or 'xla' (XLA's attention), or 'cudnn'.
    Returns:
      [B, T, N, H] in v's dtype. ValueError naming an argument that does not
      fit, or a concrete damping that overflows one map origin.
    """
    encoding = pe.encoding
    check_floating("v", v)
    _check_shapes(q, k, v, q_positions=(q_positions, "q", q), k_positions=(k_positions, "k", k))
    damping = _concrete_damping(pe)
    extent = _positions_extent(max(q.shape[1], k.shape[1]), q_positions, k_positions)
    if damping is not None and not single_origin_is_safe(encoding, damping, extent):
        limit = SINGLE_ORIGIN_EXPONENT_LIMIT
        raise ValueError(
            f"dot_product_attention maps all {extent} positions from one origin, and "
            f"{encoding.cfg.name}'s damping gamma = {damping:.4g} overflows float32 there "
            f"(gamma * positions > {limit:g}). For causal self-attention use "
            "jrope.causal_self_attention, whose blockwise kernel carries this damping; otherwise "
            f"attend over windows of at most {int(limit / damping)} positions."
        )
    shear_kernel = attention.feature_refusal("shear", encoding) is None
    if implementation in (None, "xla") and encoding.keeps_float32 and shear_kernel:
        # The maps would need float32 q, k and HIGHEST dots; the shear as an exact per-pair
        # weight needs neither (jrope.attention.shear): dots in q's dtype, default precision.
        visible = mask
        if is_causal:
            causal = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, None]
            visible = causal if mask is None else mask & causal
        shear = dict(enc=encoding, params=pe.param_values(), causal=False, mask=visible)
        return shear_attention(q, k, v, q_positions=q_positions, k_positions=k_positions, **shear)
    check_supported(encoding, MAP_FEATURES | {BIAS}, "dot_product_attention")
    q2, k2 = pe(q, k, q_positions, k_positions)
    bias = pe.logit_bias(q_positions, k_positions)
    if bias is not None:
        bias = bias[None] if bias.ndim == 3 else bias  # jax wants [B|1, N, T, S]
        if implementation == "cudnn":
            # cuDNN adds the bias in the inputs' dtype; the slopes hold no parameters.
            bias = jax.lax.stop_gradient(bias).astype(v.dtype)
    common = jnp.promote_types(q2.dtype, v.dtype)
    options = dict(bias=bias, mask=mask, is_causal=is_causal, implementation=implementation)
    with precision_scope(encoding.dot_precision):
        qkv = [x.astype(common) for x in (q2, k2, v)]
        out = jax.nn.dot_product_attention(*qkv, **options)
    return out.astype(v.dtype)


def causal_self_attention(
    pe: PositionalEncoding,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    *,
    kernel: str = "auto",
    block_size: int = 512,
    blockwise_min_length: int = 4096,
    max_damping: float = 0.02,
    backend: str | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention of raw q, k, v through a jrope kernel, chosen as the jrope model chooses.

    Args:
      q: [B, T, N, H], the last T of the S positions; k, v: [B, S, N, H],
        float32 or bfloat16.
      positions: int32 [S] or [B, S], the key positions.
      kernel: 'auto' or one of jrope.attention.KERNELS; 'auto' chooses as the
        jrope model does (jrope.attention.selection).
      block_size: query/key block length of the blockwise kernel.
      blockwise_min_length: 'auto' takes a memory-linear kernel from this many keys on.
      max_damping: the largest learned damping gamma 'auto' plans for; concrete
        parameters' own damping is read on the host and planned for where larger.
      backend: 'cpu', 'gpu' or 'tpu' for the choice (default: JAX's).
      segment_ids: optional int32 [B, S] of packed rows (jrope.attention.packing);
        positions [B, S] restart per segment.
    Returns:
      [B, T, N, H] in v's dtype. ValueError where the kernel cannot run this
      encoding here, v is neither float32 nor bfloat16, or a shape does not fit.
    """
    encoding = pe.encoding
    dtype = jnp.dtype(v.dtype)
    if dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"jrope's kernels run float32 or bfloat16, got {dtype}; cast q, k, v.")
    _check_shapes(q, k, v, positions=(positions, "k", k))
    fields = dict(head_dim=encoding.head_dim, compute_dtype=dtype.name, attention_impl=kernel)
    fields.update(blockwise_min_length=blockwise_min_length, block_size=block_size)
    settings = attention.AttentionSettings(**fields, max_damping=max_damping)
    damping = _concrete_damping(pe)
    if segment_ids is not None:
        attention.check_segments(positions, segment_ids, k.shape[0], k.shape[1])
    span = concrete_span(positions, segment_ids)
    window = dict(length=k.shape[1], num_queries=q.shape[1], backend=backend, span=span)
    packed = segment_ids is not None
    chosen = attention.choose_kernel(settings, encoding, **window, damping=damping, packed=packed)
    # Blocks that carry the damping planned for (the blockwise kernel's factors reach
    # e^(gamma * (block_size - 1))).
    blocks = blockwise_block_size(block_size, damping_bound(settings, damping))
    precision = attention.attention_precision(settings, encoding, chosen)
    inputs = dict(enc=encoding, params=pe.param_values(), positions=positions, kernel=chosen)
    options = dict(segment_ids=segment_ids, block_size=blocks, precision=precision)
    return attention.causal_attention(q, k, v, **inputs, **options)


def _concrete_damping(pe: PositionalEncoding) -> float | None:
    """The layer's largest damping read on the host, or None where its parameters are traced."""
    params = pe.param_values()
    if any(isinstance(value, jax.core.Tracer) for value in params.values()):
        return None
    return pe.encoding.largest_damping(params)


def _positions_extent(length: int, *positions) -> int:
    """How many positions one map origin covers: the widest row's span of concrete positions
    ([T] or [B, T] each; a row's origin covers its own) plus one, at least `length` (traced
    positions: assumed contiguous)."""
    if any(isinstance(p, jax.core.Tracer) for p in positions):
        return length
    rows = [np.atleast_2d(np.asarray(p, np.int64)) for p in positions]
    if not all(row.size for row in rows):
        return length
    lows = np.stack(np.broadcast_arrays(*[row.min(-1) for row in rows]))  # [len(positions), B]
    highs = np.stack(np.broadcast_arrays(*[row.max(-1) for row in rows]))
    return max(length, int((highs.max(0) - lows.min(0)).max()) + 1)


def _check_shapes(q, k, v, **positions) -> None:
    """ValueError naming the argument whose shape does not fit q [B, T, N, H], k, v [B, S, N, H]."""
    shapes = [tuple(jnp.shape(x)) for x in (q, k, v)]
    if (
        {len(s) for s in shapes} != {4}
        or not q.shape[0] == k.shape[0] == v.shape[0]
        or (k.shape[1] != v.shape[1])
    ):
        raise ValueError(
            f"q must be [B, T, N, H] and k, v [B, S, N, H] (one B, one S): q is {shapes[0]}, "
            f"k {shapes[1]}, v {shapes[2]}."
        )
    for name, (values, x_name, x) in positions.items():
        check_positions_fit(name, values, x_name, x.shape[:2])
