"""A KV cache for the Transformer that stays exact at any position, by the group law.

Every encoding is a per-position map of keys and queries (docs/mathematics.md,
section 3), so the cache stores each key already mapped, k2_j = A(-(j - o)) k_j,
from an origin o per batch row, and a decode step maps only its new query
from the same origin: q2_i . k2_j is the encoded score.

With damping, e^{gamma (j - o)} overflows float32 once j - o passes ~88 / gamma
(docs/numerics.md, section 2), so before the newest position gets more than
`rebase_bound` past the origin the whole cache moves to a new origin o' by one
map, Encoding.move_keys: A(-(j - o')) = A(o' - o) A(-(j - o)). ALiBi's bias is
computed from the stored positions.

The raw-shear encodings (Encoding.keeps_float32) keep their mapped keys in
float32 and their dots at dot_precision, HIGHEST; where the model's attention
takes the shear-weight kernels (selection.cache_keeps_shear_terms), the cache
stores each key's shear terms (Encoding.shear_terms) in the compute dtype
instead (docs/numerics.md, section 3b).

Layout (KVCache): per layer, buffers of M slots allocated once, laid out as
the decode step's matmuls read them (docs/performance.md, Decoding). All rows
write the same slot per step: prompts of different lengths are right-padded,
their pad slots EMPTY.

    logits, cache = prefill(model, tokens, lengths, offsets, max_length=M, rebase_bound=R)
    logits, cache = decode_step(model, cache, next_tokens)       # jit once, call per token

The prefill runs the prompt through the model's ordinary forward (any kernel;
a packed prompt row continues its last prompt), each attention layer handing
its keys and values to a LayerCache; a decode step runs the same model code
with the attention replaced by jrope.attention.cached.

Shape legend: B batch, P prompt length (padded), M cache slots, N heads,
H head dim, W the shear terms' widths together, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrope.attention import shear
from jrope.attention.cached import cached_attention
from jrope.attention.packing import segment_starts
from jrope.attention.selection import cache_keeps_shear_terms
from jrope.encodings import (
    BIAS,
    LOGITS,
    MAP_FEATURES,
    Encoding,
    check_positions,
    check_supported,
)
from jrope.model.axes import BATCH, HEAD_DIM, HEADS, LENGTH
from jrope.model.transformer import Transformer

# Position of a slot that holds no key: after every query position, so never visible
# (prefill refuses offsets whose positions would reach it).
EMPTY = int(np.iinfo(np.int32).max)
# Logical axes of the cached keys, values and per-slot positions.
KEY_AXES = (BATCH, HEADS, HEAD_DIM, LENGTH)
VALUE_AXES = (BATCH, HEADS, LENGTH, HEAD_DIM)
SLOT_AXES = (BATCH, LENGTH)
ROW_AXES = (BATCH,)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The cache of every layer (a pytree; rebase_bound is static).

    keys: per layer [B, N, H, M], A(-(j - origin)) k_j for the key at slot j
      (or its shear terms, [B, N, W, M]: keeps_shear_terms).
    values: per layer [B, N, M, H], in the compute dtype.
    positions: int32 [B, M], the position of each slot's key (EMPTY: none).
    origin: int32 [B], where each row's keys are mapped from.
    next_position: int32 [B], the position of each row's next token.
    length: int32 [], slots written so far (the next step writes slot `length`).
    rebase_bound: the cache moves its origin before next_position - origin exceeds this.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    positions: jax.Array
    origin: jax.Array
    next_position: jax.Array
    length: jax.Array
    rebase_bound: int = dataclasses.field(metadata={"static": True})

    @property
    def max_length(self) -> int:
        return self.positions.shape[1]

    def map_arrays(self, fn: Callable) -> KVCache:
        """fn(array, logical_axes) on every array (shardings, constraints, abstract shapes)."""
        return dataclasses.replace(
            self,
            keys=tuple(fn(k, KEY_AXES) for k in self.keys),
            values=tuple(fn(v, VALUE_AXES) for v in self.values),
            positions=fn(self.positions, SLOT_AXES),
            origin=fn(self.origin, ROW_AXES),
            next_position=fn(self.next_position, ROW_AXES),
            length=fn(self.length, ()),
        )


@dataclasses.dataclass
class LayerCache:
    """One layer's share of the cache during one traced forward pass.

    The layer's attention hands it the new raw keys and values (`add`) and,
    in a decode step, calls `attend` instead of its kernel; prefill and
    decode_step collect the updated `keys` and `values` after the forward.
    A decode step attends over the buffers as they were and the new entries
    beside them, then writes the new entries made to depend on the result
    (_after): a buffer read and updated with nothing ordering the two is
    copied whole (docs/performance.md).

    keys, values: one layer's buffers, as KVCache's; slot_positions: int32 [B, M]
    before this step's writes; positions: int32 [B, T] of the T new tokens
    (prompt pads included); origin: int32 [B]; write_index: int32 [] of the
    first new slot; filled: bool [B, T], False for prompt pads (their slots
    are zeroed); shear_terms: see keeps_shear_terms.
    """

    keys: jax.Array
    values: jax.Array
    slot_positions: jax.Array
    positions: jax.Array
    origin: jax.Array
    write_index: jax.Array
    filled: jax.Array
    _: dataclasses.KW_ONLY
    decoding: bool
    shear_terms: bool

    @property
    def kernel(self) -> str | None:
        """The kernel whose dots a decode step computes, for attention_precision."""
        return "shear" if self.shear_terms else None

    def add(self, k: jax.Array, v: jax.Array, encoding: Encoding, params) -> None:
        """Takes the new raw keys and values [B, T, N, H]; a prefill writes them now, a decode
        step in `attend`."""
        filled = self.filled[..., None, None]
        if self.shear_terms:
            origin = self.origin[:, None]
            k2 = jnp.concatenate(
                encoding.shear_terms(params, k, self.positions, origin, queries=False), -1
            )
        else:
            k2 = encoding.map_keys(params, k, self.positions, self.origin)
        k2 = k2.astype(self.keys.dtype)
        self.new_keys = jnp.where(filled, k2, 0)
        self.new_values = jnp.where(filled, v, 0).astype(self.values.dtype)
        if not self.decoding:
            self._write(self.new_keys, self.new_values)

    def attend(
        self, q: jax.Array, encoding: Encoding, params, precision: jax.lax.Precision | None = None
    ) -> jax.Array:
        """Attention of the new raw queries q [B, T, N, H] over the stored keys and their own -> [B, T, N, H]."""
        key_positions = jnp.concatenate([self.slot_positions, self.positions], axis=-1)
        term_widths, time_lag = None, None
        if self.shear_terms:
            origin = self.origin[:, None]
            terms = encoding.shear_terms(params, q, self.positions, origin, queries=True)
            q2 = jnp.concatenate(terms, -1).astype(self.keys.dtype)
            term_widths = tuple(term.shape[-1] for term in terms)
            if len(terms) > 1:
                time_lag = shear.pair_time_lag(encoding, self.positions, key_positions)
        else:
            q2 = encoding.map_queries(params, q, self.positions, self.origin)
        bias = None
        if encoding.has_bias:
            bias = encoding.logit_bias(params, self.positions, key_positions)
        stored = (self.positions, self.keys, self.values, self.new_keys, self.new_values)
        transform = functools.partial(encoding.transform_logits, params)
        y = cached_attention(
            q2, *stored, key_positions, bias, precision, term_widths, time_lag, transform
        )
        self._write(_after(self.new_keys, y), _after(self.new_values, y))
        return y

    def _write(self, k2: jax.Array, v: jax.Array) -> None:
        """Writes mapped keys and values [B, T, N, H] into the slots from write_index on."""
        self.keys = jax.lax.dynamic_update_slice(
            self.keys, jnp.transpose(k2, (0, 2, 3, 1)), (0, 0, 0, self.write_index)
        )
        self.values = jax.lax.dynamic_update_slice(
            self.values, jnp.transpose(v, (0, 2, 1, 3)), (0, 0, self.write_index, 0)
        )


def _after(x: jax.Array, result: jax.Array) -> jax.Array:
    """x [B, T, N, H] unchanged, made to depend on result [B, T, N, H] (x + 0 * a finite part of it)."""
    anchor = result[..., :1].astype(jnp.float32)
    anchor = jnp.where(jnp.isfinite(anchor), anchor, 0.0)
    return x + (0.0 * anchor).astype(x.dtype)


def _attention_layers(model: Transformer):
    return [block.attn for block in model.blocks]


def _pe_params(attention) -> dict[str, jax.Array]:
    return {name: param[...] for name, param in attention.pe_params.items()}


def keeps_shear_terms(model: Transformer) -> bool:
    """Whether the cache stores the keys' shear terms (selection.cache_keeps_shear_terms)."""
    return cache_keeps_shear_terms(model.cfg.attention, _attention_layers(model)[0].encoding)


def key_dtype(model: Transformer) -> jnp.dtype:
    """The dtype of the cached keys: the one the encoding's map_keys returns in this model,
    or the compute dtype for shear terms."""
    if _attention_layers(model)[0].encoding.keeps_float32 and not keeps_shear_terms(model):
        return jnp.dtype(jnp.float32)
    return jnp.dtype(model.cfg.compute_dtype)


def key_width(model: Transformer) -> int:
    """The cached keys' width: the head dim, or the shear terms' widths together."""
    attention = _attention_layers(model)[0]
    if not keeps_shear_terms(model):
        return attention.encoding.head_dim
    rates = attention.encoding.term_rates(_pe_params(attention))
    return sum(2 * omega.shape[-1] for _, omega in rates)


def prefill(
    model: Transformer,
    tokens: jax.Array,
    lengths: jax.Array,
    offsets: jax.Array,
    *,
    max_length: int,
    rebase_bound: int,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, KVCache]:
    """Runs the prompts through the model's forward and returns a cache holding them.

    A row may pack several prompts (segment_ids), each attending to itself
    from the row's offset; the cache continues the row's last prompt alone.

    Args:
      model: the Transformer (any attention kernel; readout is always 'all' here).
      tokens: int32 [B, P], each row's prompt right-padded to P.
      lengths: int32 [B], each row's filled length (1 <= length <= P).
      offsets: int32 [B], the first absolute position of each row's prompts.
      max_length: M >= P, cache slots (the prompt's padded length plus the tokens to decode).
      rebase_bound: positive; see KVCache.
      segment_ids: optional int32 [B, P], each packed prompt one contiguous run of an id
        (jrope.attention.packing); the pads after `lengths` continue the last prompt's id
        or take one of their own.
    Returns:
      (float32 [B, V] logits at each row's last prompt token, the cache); the
      origin is each row's last prompt position.
    """
    batch, prompt_length = tokens.shape
    _check_offsets(offsets, max_length)
    # A decode step computes the maps' features (or the shear terms'), the bias and the logits'.
    supported = shear.FEATURES if keeps_shear_terms(model) else MAP_FEATURES | {BIAS, LOGITS}
    check_supported(_attention_layers(model)[0].encoding, supported, "the KV cache")
    lengths = jnp.asarray(lengths, jnp.int32)
    offsets = jnp.asarray(offsets, jnp.int32)
    slots = jnp.arange(prompt_length, dtype=jnp.int32)[None]  # [1, P]
    if segment_ids is None:
        starts = jnp.zeros((batch, prompt_length), jnp.int32)
    else:
        segment_ids = jnp.asarray(segment_ids, jnp.int32)
        starts = segment_starts(segment_ids)  # [B, P]: the slot where each slot's prompt starts
    positions = offsets[:, None] + slots - starts  # [B, P], restarting with each prompt
    last_start = jnp.take_along_axis(starts, (lengths - 1)[:, None], axis=1)  # [B, 1]
    filled = (slots >= last_start) & (slots < lengths[:, None])  # the last prompt's slots
    origin = offsets + lengths - 1 - last_start[:, 0]
    empty = jnp.full((batch, max_length), EMPTY, jnp.int32)
    attentions = _attention_layers(model)
    heads, head_dim = attentions[0].encoding.num_heads, attentions[0].encoding.head_dim
    flags = dict(decoding=False, shear_terms=keeps_shear_terms(model))

    def new_layer() -> LayerCache:
        keys = jnp.zeros((batch, heads, key_width(model), max_length), key_dtype(model))
        values = jnp.zeros((batch, heads, max_length, head_dim), model.cfg.compute_dtype)
        return LayerCache(keys, values, empty, positions, origin, jnp.int32(0), filled, **flags)

    layers = [new_layer() for _ in attentions]
    logits = model(tokens, positions, cache=layers, segment_ids=segment_ids)  # [B, P, V]
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    cache = KVCache(
        keys=tuple(layer.keys for layer in layers),
        values=tuple(layer.values for layer in layers),
        positions=empty.at[:, :prompt_length].set(jnp.where(filled, positions, EMPTY)),
        origin=origin,
        next_position=origin + 1,
        length=jnp.int32(prompt_length),
        rebase_bound=rebase_bound,
    )
    return last, cache


def _check_offsets(offsets, max_length: int) -> None:
    """Refuses concrete offsets whose slots would reach EMPTY (traced ones are the caller's
    care): such a key would read as an empty slot, and positions past int32 would wrap."""
    if isinstance(offsets, jax.core.Tracer):
        return
    offsets = np.asarray(offsets)
    check_positions(offsets.reshape(-1, 1), "offsets")
    last = int(offsets.max(initial=0)) + max_length - 1
    if last >= EMPTY:
        raise ValueError(
            f"offsets up to {int(offsets.max())} with max_length {max_length} reach position "
            f"{last}, but the cache marks empty slots with {EMPTY}: every position must stay "
            f"below it; lower the offsets (translation-invariant encodings depend only on "
            "differences) or max_length."
        )


def rebase(model: Transformer, cache: KVCache) -> KVCache:
    """Moves the origin of each row whose next position is more than rebase_bound past it to
    that position, on the steps that need it (lax.cond)."""
    due = cache.next_position - cache.origin > cache.rebase_bound  # [B]

    def move(cache: KVCache) -> KVCache:
        origin = jnp.where(due, cache.next_position, cache.origin)
        shift = origin - cache.origin  # 0 for rows that stay
        move = _move_terms if keeps_shear_terms(model) else _move
        keys = tuple(
            move(attention.encoding, _pe_params(attention), keys, shift)
            for attention, keys in zip(_attention_layers(model), cache.keys, strict=False)
        )
        return dataclasses.replace(cache, keys=keys, origin=origin)

    return jax.lax.cond(jnp.any(due), move, lambda cache: cache, cache)


def _move(encoding: Encoding, params, keys: jax.Array, shift: jax.Array) -> jax.Array:
    """Cached keys [B, N, H, M] moved by `shift` [B] (Encoding.move_keys), in their layout.

    The move is one linear map per row and head: move_keys of the H unit
    vectors gives its [H, H] matrix, and one batched matmul applies it
    without transposing the cache (docs/performance.md, Decoding). At
    HIGHEST: a bfloat16 pass would round the raw shear's float32 keys at
    every rebase (once per rebase, not per token).
    """
    batch, heads, head_dim, _ = keys.shape
    eye = jnp.eye(head_dim, dtype=jnp.float32)[None, :, None, :]
    units = jnp.broadcast_to(eye, (batch, head_dim, heads, head_dim))  # [B, i, N, H]: e_i per head
    columns = encoding.move_keys(params, units, shift)  # [B, i, N, H]: A(shift) e_i
    options = dict(precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    moved = jnp.einsum(
        "bino,bnis->bnos", columns.astype(jnp.float32), keys.astype(jnp.float32), **options
    )
    return moved.astype(keys.dtype)


def _move_terms(encoding: Encoding, params, keys: jax.Array, shift: jax.Array) -> jax.Array:
    """Cached shear terms [B, N, W, M] moved by `shift` [B]: each (re, im) pair
    (Encoding.term_rates' layout) times the damped rotation e^{-gamma shift} R(omega shift).
    The shear needs no move: its lag comes from the positions."""
    rates = encoding.term_rates(params)
    gamma = jnp.concatenate([g for g, _ in rates], -1)[None, :, :, None]  # [1, N, W/2, 1]
    omega = jnp.concatenate([w for _, w in rates], -1)[None, None, :, None]  # [1, 1, W/2, 1]
    shift = shift.astype(jnp.float32)[:, None, None, None]  # [B, 1, 1, 1]
    decay = jnp.exp(-gamma * shift)
    cos, sin = decay * jnp.cos(omega * shift), -decay * jnp.sin(omega * shift)
    pairs = keys.astype(jnp.float32).reshape(keys.shape[:2] + (-1, 2) + keys.shape[3:])
    re, im = pairs[:, :, :, 0], pairs[:, :, :, 1]  # [B, N, W/2, M]
    moved = jnp.stack([cos * re + sin * im, cos * im - sin * re], axis=3)
    return moved.reshape(keys.shape).astype(keys.dtype)


def decode_step(model: Transformer, cache: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
    """tokens int32 [B], each at its row's next_position -> (float32 [B, V] logits of the next
    token, the cache one slot longer); NaN logits past the last slot. Jit it once."""
    cache = rebase(model, cache)
    positions = cache.next_position[:, None]  # [B, 1]
    flags = dict(decoding=True, shear_terms=keeps_shear_terms(model))
    slots = (cache.positions, positions, cache.origin, cache.length)
    layers = [
        LayerCache(keys, values, *slots, jnp.ones(positions.shape, bool), **flags)
        for keys, values in zip(cache.keys, cache.values, strict=False)
    ]
    logits = model(tokens[:, None], positions, cache=layers)[:, 0]
    logits = jnp.where(cache.length < cache.max_length, logits, jnp.nan)
    return logits, dataclasses.replace(
        cache,
        keys=tuple(layer.keys for layer in layers),
        values=tuple(layer.values for layer in layers),
        positions=jax.lax.dynamic_update_slice(cache.positions, positions, (0, cache.length)),
        next_position=cache.next_position + 1,
        length=cache.length + 1,
    )
