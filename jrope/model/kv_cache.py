"""A KV cache for the Transformer that stays exact at any position, by the group law.

Every encoding is a per-position map of keys and queries (docs/mathematics.md,
section 3), so the cache stores each key already mapped, k2_j = A(-(j - o)) k_j,
from an origin o per batch row, and a decode step maps only its new query
from the same origin: q2_i . k2_j is the encoded score, with no per-key
cos, sin or exp per step.

Why an origin, and why it moves: with damping, the key factor
e^{gamma (j - o)} overflows float32 once j - o passes ~88 / gamma, and the
query factor e^{-gamma (i - o)} underflows (docs/numerics.md, section 2).
Before the newest position gets more than `rebase_bound` past the origin,
the whole cache is moved to a new origin o' (the newest position) by one
map, Encoding.move_keys: A(-(j - o')) = A(o' - o) A(-(j - o)), exact for
every translation-invariant encoding; the stabilized ones (shear on absolute
positions) move by their damped rotation alone, which commutes with their
shear. Keys far behind the origin get factors e^{-gamma (o - j)} that may
underflow to zero, which is their true contribution to float32 accuracy.
ALiBi's bias is computed from the stored positions.

Layout: per layer, keys [B, M, N, H] (float32 when the encoding keeps
mapped keys in float32, Encoding.keeps_float32, else the compute dtype) and
values [B, M, N, H] in a buffer of M slots allocated once; per row the
origin, the position of the next token and the position held by each slot
(EMPTY for a slot without a key: after every query, so never visible). All
rows write the same slot per step (`dynamic_update_slice`): prompts of
different lengths are right-padded, and a shorter prompt's pad slots stay
EMPTY. The arrays carry logical axis names (KVCache.map_arrays) so that a
harness shards them like the activations: batch over data, heads over tensor.

    logits, cache = prefill(model, tokens, lengths, offsets, max_length=M, rebase_bound=R)
    logits, cache = decode_step(model, cache, next_tokens)       # jit once, call per token

The prefill runs the prompt through the model's ordinary forward (any
attention kernel); each attention layer stores its keys and values into a
LayerCache on the way. A decode step runs the same model code with the
attention replaced by jrope.attention.cached.

Shape legend: B batch, P prompt length (padded), M cache slots, N heads,
H head dim, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jrope.attention.cached import cached_attention
from jrope.encodings import Encoding
from jrope.model.axes import BATCH, HEAD_DIM, HEADS, LENGTH
from jrope.model.transformer import Transformer

# Position of a slot that holds no key: after every query position, so never visible.
EMPTY = int(np.iinfo(np.int32).max)
# Logical axes of the cached keys and values, and of the per-slot positions.
KV_AXES = (BATCH, LENGTH, HEADS, HEAD_DIM)
SLOT_AXES = (BATCH, LENGTH)
ROW_AXES = (BATCH,)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The cache of every layer (a pytree; rebase_bound is static).

    keys: per layer [B, M, N, H], A(-(j - origin)) k_j for the key at slot j.
    values: per layer [B, M, N, H], in the compute dtype.
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
            keys=tuple(fn(k, KV_AXES) for k in self.keys),
            values=tuple(fn(v, KV_AXES) for v in self.values),
            positions=fn(self.positions, SLOT_AXES),
            origin=fn(self.origin, ROW_AXES),
            next_position=fn(self.next_position, ROW_AXES),
            length=fn(self.length, ()),
        )


class LayerCache:
    """One layer's share of the cache during one traced forward pass.

    The model passes it to its layer's attention, which calls `store` with
    the new raw keys and values and, in a decode step, `attend` instead of
    its attention kernel. Mutable on purpose: `store` replaces `keys` and
    `values` by the updated buffers, which prefill and decode_step collect
    after the forward. It lives inside one traced function and never crosses
    a JAX transformation.

    keys, values: [B, M, N, H] buffers; slot_positions: int32 [B, M] after
    this step's writes; positions: int32 [B, T] of the T new tokens (prompt
    pads included); origin: int32 [B]; write_index: int32 [] of the first new
    slot; filled: bool [B, T], False for prompt pads (their slots are zeroed);
    decoding: attend over the cache (decode step) or leave attention to the
    model's kernel (prefill).
    """

    def __init__(
        self, keys, values, slot_positions, positions, origin, write_index, filled, *, decoding
    ):
        self.keys = keys
        self.values = values
        self.slot_positions = slot_positions
        self.positions = positions
        self.origin = origin
        self.write_index = write_index
        self.filled = filled
        self.decoding = decoding

    def store(self, k: jax.Array, v: jax.Array, encoding: Encoding, params) -> None:
        """Maps the new raw keys k [B, T, N, H] from the origin and writes them and v into the buffers."""
        k2 = encoding.map_keys(params, k, self.positions, self.origin).astype(self.keys.dtype)
        filled = self.filled[..., None, None]
        k2 = jnp.where(filled, k2, 0)
        v = jnp.where(filled, v, 0).astype(self.values.dtype)
        start = (0, self.write_index, 0, 0)
        self.keys = jax.lax.dynamic_update_slice(self.keys, k2, start)
        self.values = jax.lax.dynamic_update_slice(self.values, v, start)

    def attend(self, q: jax.Array, encoding: Encoding, params) -> jax.Array:
        """Attention of the new raw queries q [B, T, N, H] over every stored key -> [B, T, N, H]."""
        q2 = encoding.map_queries(params, q, self.positions, self.origin)
        bias = None
        if encoding.has_bias:
            bias = encoding.logit_bias(params, self.positions, self.slot_positions)
        return cached_attention(
            q2, self.keys, self.values, self.positions, self.slot_positions, bias
        )


def _attention_layers(model: Transformer):
    return [block.attn for block in model.blocks]


def _pe_params(attention) -> dict[str, jax.Array]:
    return {name: param[...] for name, param in attention.pe_params.items()}


def key_dtype(model: Transformer) -> jnp.dtype:
    """The dtype of the cached keys: the one the encoding's map_keys returns in this model."""
    if _attention_layers(model)[0].encoding.keeps_float32:
        return jnp.dtype(jnp.float32)
    return jnp.dtype(model.cfg.compute_dtype)


def prefill(
    model: Transformer,
    tokens: jax.Array,
    lengths: jax.Array,
    offsets: jax.Array,
    *,
    max_length: int,
    rebase_bound: int,
) -> tuple[jax.Array, KVCache]:
    """Runs the prompts through the model's forward and returns a cache holding them.

    Args:
      model: the Transformer (any attention kernel; readout is always 'all' here).
      tokens: int32 [B, P], each row's prompt right-padded to P.
      lengths: int32 [B], each prompt's length (1 <= length <= P).
      offsets: int32 [B], each prompt's first absolute position.
      max_length: M >= P, cache slots (the prompt's padded length plus the tokens to decode).
      rebase_bound: positive; see KVCache.
    Returns:
      (float32 [B, V] logits at each row's last prompt token, the cache); the
      origin is each row's last prompt position.
    """
    batch, prompt_length = tokens.shape
    if max_length < prompt_length or rebase_bound < 1:
        raise ValueError(
            f"need max_length >= the padded prompt length {prompt_length} and rebase_bound >= 1, "
            f"got max_length={max_length}, rebase_bound={rebase_bound}."
        )
    lengths = jnp.asarray(lengths, jnp.int32)
    offsets = jnp.asarray(offsets, jnp.int32)
    positions = offsets[:, None] + jnp.arange(prompt_length, dtype=jnp.int32)[None]  # [B, P]
    filled = jnp.arange(prompt_length)[None] < lengths[:, None]
    origin = offsets + lengths - 1
    slot_positions = jnp.full((batch, max_length), EMPTY, jnp.int32)
    slot_positions = slot_positions.at[:, :prompt_length].set(jnp.where(filled, positions, EMPTY))
    attentions = _attention_layers(model)
    shape = (batch, max_length, attentions[0].encoding.num_heads, attentions[0].encoding.head_dim)
    layers = [
        LayerCache(
            jnp.zeros(shape, key_dtype(model)),
            jnp.zeros(shape, model.cfg.compute_dtype),
            slot_positions,
            positions,
            origin,
            jnp.int32(0),
            filled,
            decoding=False,
        )
        for _ in attentions
    ]
    logits = model(tokens, positions, cache=layers)  # [B, P, V]
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
    cache = KVCache(
        keys=tuple(layer.keys for layer in layers),
        values=tuple(layer.values for layer in layers),
        positions=slot_positions,
        origin=origin,
        next_position=offsets + lengths,
        length=jnp.int32(prompt_length),
        rebase_bound=rebase_bound,
    )
    return last, cache


def rebase(model: Transformer, cache: KVCache) -> KVCache:
    """Moves the origin of each row whose next position is more than rebase_bound past it.

    The moved rows' origin becomes their next position; every layer's keys
    are re-expressed by Encoding.move_keys. Runs the move (one map of the
    whole cache) only on the steps that need it (lax.cond).
    """
    due = cache.next_position - cache.origin > cache.rebase_bound  # [B]

    def move(cache: KVCache) -> KVCache:
        origin = jnp.where(due, cache.next_position, cache.origin)
        shift = origin - cache.origin  # 0 for rows that stay
        keys = tuple(
            attention.encoding.move_keys(_pe_params(attention), keys, shift).astype(keys.dtype)
            for attention, keys in zip(_attention_layers(model), cache.keys)
        )
        return dataclasses.replace(cache, keys=keys, origin=origin)

    return jax.lax.cond(jnp.any(due), move, lambda cache: cache, cache)


def decode_step(model: Transformer, cache: KVCache, tokens: jax.Array) -> tuple[jax.Array, KVCache]:
    """Appends one token per row and returns the logits for the token after it.

    tokens: int32 [B], each at its row's next_position. Returns (float32
    [B, V], the cache one slot longer). Jit it once: the shapes never change.
    A step past the last slot returns NaN logits (the buffer is full; size it
    with prefill's max_length).
    """
    cache = rebase(model, cache)
    positions = cache.next_position[:, None]  # [B, 1]
    slot_positions = jax.lax.dynamic_update_slice(cache.positions, positions, (0, cache.length))
    layers = [
        LayerCache(
            keys,
            values,
            slot_positions,
            positions,
            cache.origin,
            cache.length,
            jnp.ones(positions.shape, bool),
            decoding=True,
        )
        for keys, values in zip(cache.keys, cache.values)
    ]
    logits = model(tokens[:, None], positions, cache=layers)[:, 0]
    logits = jnp.where(cache.length < cache.max_length, logits, jnp.nan)
    return logits, dataclasses.replace(
        cache,
        keys=tuple(layer.keys for layer in layers),
        values=tuple(layer.values for layer in layers),
        positions=slot_positions,
        next_position=cache.next_position + 1,
        length=cache.length + 1,
    )
