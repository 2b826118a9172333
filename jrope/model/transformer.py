"""Decoder-only Transformer (Flax NNX) with a pluggable positional encoding.

The paper's model: pre-norm blocks (RMSNorm, eps 1e-6), causal
self-attention without biases, a GELU MLP (hidden = mlp_ratio * d_model,
no biases), tied input/output embeddings, no dropout by default
(`model.dropout_rate` adds residual dropout with masks drawn from a key the
caller passes: the train step's per-step key; evaluation passes none).
Positions are always passed in (no table sized at construction), so a model
trained at length L evaluates at any length.

Initialisation is the reference's: embedding N(0, 1); projections
U(-1/sqrt(fan_in), 1/sqrt(fan_in)); norm scales 1; the encoding's `init_params()`.

Numerics: parameters float32; activations and matmuls in
`model.compute_dtype`; RMSNorm statistics, positional maths, softmax and the
output logits in float32. The attention's dots run at
`model.attention_precision` and every other matmul at
`model.matmul_precision` (jrope.attention.precision).

Shape legend: B batch, T length, D d_model, N heads, H head dim, F MLP hidden,
V vocabulary.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrope import attention
from jrope.attention.packing import largest_segment_span
from jrope.attention.selection import blockwise_block_size
from jrope.encodings import Encoding
from jrope.model.axes import EMBED, HEAD_DIM, HEADS, LOGICAL_AXES_KEY, MLP, VOCAB
from jrope.model.config import ModelConfig
from jrope.model.projection import ProjectionFn, contract


class LayerCache(Protocol):
    """One attention layer's share of a KV cache (jrope.model.kv_cache.LayerCache, which
    imports this module): what the layer calls."""

    decoding: bool  # a decode step (attend over the cache), else a prefill
    kernel: str | None  # 'shear' when the keys are stored as shear terms (attention_precision)

    def add(self, k: jax.Array, v: jax.Array, encoding: Encoding, params) -> None: ...

    def attend(
        self, q: jax.Array, encoding: Encoding, params, precision: jax.lax.Precision | None
    ) -> jax.Array: ...


NORM_EPS = 1e-6
# A power of two that brings float32's largest values (3.4e38) to squares float32 holds.
OVERFLOW_ROW_FACTOR = 2.0**-100

_REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _param(value: jax.Array, logical_axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, **{LOGICAL_AXES_KEY: tuple(logical_axes)})


def _uniform_fan_in(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    bound = 1.0 / jnp.sqrt(jnp.float32(fan_in))
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int):
        self.scale = _param(jnp.ones((dim,), jnp.float32), (EMBED,))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> same shape and dtype; statistics in float32."""
        x32 = x.astype(jnp.float32)
        mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        # Entries past ~1.8e19 square to inf, and rsqrt(inf) = 0 would zero a finite row: such
        # rows are scaled by 2^-100 first (exact; other rows by 1.0), so they normalize instead.
        factor = jnp.where(jnp.isfinite(mean_square), 1.0, OVERFLOW_ROW_FACTOR)
        scaled = x32 * factor
        mean_square = jnp.mean(jnp.square(scaled), axis=-1, keepdims=True)
        normed = scaled * jax.lax.rsqrt(mean_square + NORM_EPS * jnp.square(factor))
        scale = self.scale[...].reshape((1,) * (x.ndim - 1) + (-1,))
        return (normed * scale).astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Fused q/k/v projection, the encoding's hooks, causal attention, output projection."""

    def __init__(
        self,
        cfg: ModelConfig,
        encoding: Encoding,
        *,
        rngs: nnx.Rngs,
        projection: ProjectionFn = contract,
    ):
        self.cfg = cfg
        self.encoding = encoding
        self.projection = projection
        # The largest damping of this layer's parameters as last measured on the host
        # (Transformer.follow_damping); None: plan for model.max_damping alone.
        self.measured_damping: float | None = None
        d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
        # One [D, 3, N, H] kernel: a single matmul yields q, k and v already in
        # the [B, T, N, H] layout attention wants (no reshape or transpose).
        qkv = _uniform_fan_in(rngs.params(), (d, 3, n, h), d)
        self.qkv = _param(qkv, (EMBED, None, HEADS, HEAD_DIM))
        self.out = _param(_uniform_fan_in(rngs.params(), (n, h, d), d), (HEADS, HEAD_DIM, EMBED))
        axes = encoding.param_logical_axes
        self.pe_params = nnx.Dict(
            {name: _param(value, axes[name]) for name, value in encoding.init_params().items()}
        )

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        num_queries: int | None = None,
        cache: LayerCache | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """x [B, S, D], positions int32 [S] or [B, S] -> [B, T, D].

        The output covers the last T = num_queries positions (default: all S).
        cache: this layer's share of a KV cache (generation, jrope.model.kv_cache).
        segment_ids: optional int32 [B, S] of packed rows (jrope.attention.packing).
        """
        if segment_ids is not None and cache is not None and cache.decoding:
            raise ValueError(
                "a decode step continues one sequence per row and takes no segment ids; pass "
                "them to kv_cache.prefill, which keeps each row's last sequence."
            )
        qkv, settings = self.qkv[...].astype(x.dtype), self.cfg.attention
        precision = attention.matmul_precision(settings)
        with jax.named_scope("qkv_projection"):
            if num_queries is None:
                # [B, S, 3, N, H]: the matmul's natural output layout. unstack
                # (not indexing) so that the backward pass concatenates the three
                # gradients instead of padding each to full size and summing.
                q, k, v = jnp.unstack(self.projection(x, qkv, 1, precision), axis=2)
            else:
                q = self.projection(x[:, x.shape[1] - num_queries :], qkv[:, 0], 1, precision)
                k, v = jnp.unstack(self.projection(x, qkv[:, 1:], 1, precision), axis=2)
        pe_params = {name: param[...] for name, param in self.pe_params.items()}
        if cache is not None:
            # Generation: the cache keeps the keys and values; a prefill runs the kernel below.
            cache.add(k, v, self.encoding, pe_params)
        if cache is not None and cache.decoding:
            # A decode step attends over all the cache holds.
            dots = attention.attention_precision(settings, self.encoding, cache.kernel)
            y = cache.attend(q, self.encoding, pe_params, dots)
        else:
            # The damping the kernel must survive: measured now where the parameters are concrete.
            traced = any(isinstance(value, jax.core.Tracer) for value in pe_params.values())
            damping = self.measured_damping if traced else self.encoding.largest_damping(pe_params)
            if segment_ids is not None:
                attention.check_segments(positions, segment_ids, k.shape[0], k.shape[1])
            span, packed = concrete_span(positions, segment_ids), segment_ids is not None
            window = dict(length=k.shape[1], num_queries=q.shape[1], span=span, packed=packed)
            kernel = attention.choose_kernel(settings, self.encoding, **window, damping=damping)
            blocks = blockwise_block_size(self.cfg.block_size, damping)
            dots = attention.attention_precision(settings, self.encoding, kernel)
            inputs = dict(enc=self.encoding, params=pe_params, positions=positions, kernel=kernel)
            options = dict(block_size=blocks, precision=dots, segment_ids=segment_ids)
            y = attention.causal_attention(q, k, v, **inputs, **options)
        with jax.named_scope("out_projection"):
            return self.projection(y.astype(x.dtype), self.out[...].astype(x.dtype), 2, precision)


def concrete_span(positions: jax.Array, segment_ids: jax.Array | None) -> int | None:
    """max - min of concrete positions over every row, or over every segment of packed rows
    (None under jit: assumed contiguous, a row's span below its length)."""
    if isinstance(positions, jax.core.Tracer) or isinstance(segment_ids, jax.core.Tracer):
        return None
    attention.check_positions(positions, packed=segment_ids is not None, causal=True)
    if segment_ids is not None:
        return largest_segment_span(positions, segment_ids)
    # numpy, not jnp: inside a trace jnp would stage even a constant's arithmetic.
    positions = np.asarray(positions, np.int64)
    return int(np.max(positions[..., -1] - positions[..., 0]))


class MLPBlock(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, projection: ProjectionFn = contract):
        self.projection = projection
        d, f = cfg.d_model, cfg.mlp_ratio * cfg.d_model
        self.up = _param(_uniform_fan_in(rngs.params(), (d, f), d), (EMBED, MLP))
        self.down = _param(_uniform_fan_in(rngs.params(), (f, d), f), (MLP, EMBED))
        self.precision = attention.matmul_precision(cfg.attention)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]; exact (erf) GELU as in the reference."""
        with jax.named_scope("mlp"):
            up = self.projection(x, self.up[...].astype(x.dtype), 1, self.precision)
            hidden = jax.nn.gelu(up, approximate=False)
            return self.projection(hidden, self.down[...].astype(x.dtype), 1, self.precision)


class TransformerBlock(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        encoding: Encoding,
        *,
        rngs: nnx.Rngs,
        projection: ProjectionFn = contract,
    ):
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg, encoding, rngs=rngs, projection=projection)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = MLPBlock(cfg, rngs=rngs, projection=projection)
        self.dropout_rate = cfg.dropout_rate

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        num_queries: int | None = None,
        dropout_key: jax.Array | None = None,
        cache: LayerCache | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """x [B, S, D] -> [B, T, D] for the last T = num_queries positions (default: all).

        dropout_key: drops each branch output with probability model.dropout_rate
        before it joins the residual stream; None (evaluation) drops nothing.
        cache, segment_ids: as CausalSelfAttention takes them.
        """
        residual = x if num_queries is None else x[:, x.shape[1] - num_queries :]
        attn_key, mlp_key = (None, None) if dropout_key is None else jax.random.split(dropout_key)
        x = residual + self._dropout(
            self.attn(self.attn_norm(x), positions, num_queries, cache, segment_ids), attn_key
        )
        return x + self._dropout(self.mlp(self.mlp_norm(x)), mlp_key)

    def _dropout(self, y: jax.Array, key: jax.Array | None) -> jax.Array:
        """y with each element zeroed with probability dropout_rate, the rest scaled up to keep the mean."""
        if key is None or self.dropout_rate == 0.0:
            return y
        keep = jax.random.bernoulli(key, 1.0 - self.dropout_rate, y.shape)
        return jnp.where(keep, y / (1.0 - self.dropout_rate), 0.0).astype(y.dtype)


def _run_block(block: TransformerBlock, x, positions, dropout_key, segment_ids) -> jax.Array:
    return block(x, positions, dropout_key=dropout_key, segment_ids=segment_ids)


class Transformer(nnx.Module):
    """Tokens -> float32 logits over the vocabulary, or real-valued signals -> float32 predictions.

    Each layer has its own encoding parameters; the stateless `encoding`
    (jrope.make_encoding for cfg.num_heads of cfg.head_dim) is shared.
    Token models (`vocab_size`) embed their inputs and read out through the
    tied embedding. Signal models (`input_channels` and `output_channels`,
    the regression task) project their inputs [B, T, C_in] in by [C_in, D]
    and read out through a regression head [D, C_out], both without bias.

    projection: the function of every projection (jrope.model.projection):
    `contract`, or `cpu_projection`, whose backward pass is laid out for
    XLA:CPU (a harness passes it on CPU only).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        encoding: Encoding,
        vocab_size: int | None,
        *,
        rngs: nnx.Rngs,
        input_channels: int | None = None,
        output_channels: int | None = None,
        projection: ProjectionFn = contract,
    ):
        if (encoding.num_heads, encoding.head_dim) != (cfg.num_heads, cfg.head_dim):
            raise ValueError(
                f"the encoding is made for {encoding.num_heads} heads of {encoding.head_dim}, the "
                f"model has {cfg.num_heads} of {cfg.head_dim}; make it with "
                "jrope.make_encoding(pe_config, num_heads=cfg.num_heads, head_dim=cfg.head_dim)."
            )
        signal = (input_channels, output_channels)
        if (vocab_size is None) == (None in signal) or (vocab_size is None and min(signal) < 1):
            raise ValueError(
                "give a model either vocab_size (token inputs, tied logits) or positive "
                f"input_channels and output_channels (signals), got vocab_size={vocab_size}, "
                f"input_channels={input_channels}, output_channels={output_channels}."
            )
        self.cfg = cfg
        self.projection = projection
        # True for a signal model (input projection and regression head), False for tokens.
        self.reads_signals = vocab_size is None
        d = cfg.d_model
        if not self.reads_signals:
            embedding = jax.random.normal(rngs.params(), (vocab_size, d), jnp.float32)
            self.embedding = _param(embedding, (VOCAB, EMBED))
        else:
            inputs = _uniform_fan_in(rngs.params(), (input_channels, d), input_channels)
            self.input_projection = _param(inputs, (None, EMBED))
            head = _uniform_fan_in(rngs.params(), (d, output_channels), d)
            self.regression_head = _param(head, (EMBED, None))
        block = functools.partial(TransformerBlock, cfg, encoding, rngs=rngs, projection=projection)
        self.blocks = nnx.List([block() for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model)

    def __call__(
        self,
        inputs: jax.Array,
        positions: jax.Array,
        *,
        dropout_key: jax.Array | None = None,
        cache: Sequence[LayerCache] | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """tokens int32 [B, T] or signals [B, T, C_in], positions int32 [T] or [B, T] ->
        logits float32 [B, T', V] or predictions float32 [B, T', C_out] (see decode)."""
        options = dict(dropout_key=dropout_key, cache=cache, segment_ids=segment_ids)
        return self.decode(self.embed(inputs), positions, **options)

    def follow_damping(self) -> float:
        """Reads every layer's largest damping on the host (outside jit, before compiling an
        evaluation or decoding step), so that each layer plans its kernel for the larger of it
        and model.max_damping; returns the largest (0.0: undamped)."""
        largest = 0.0
        for block in self.blocks:
            attn = block.attn
            pe_params = {name: param[...] for name, param in attn.pe_params.items()}
            attn.measured_damping = attn.encoding.largest_damping(pe_params)
            largest = max(largest, attn.measured_damping)
        return largest

    def embed(self, inputs: jax.Array) -> jax.Array:
        """tokens int32 [B, T] (or signals [B, T, C_in]) -> [B, T, D] in the compute dtype."""
        dtype = self.cfg.compute_dtype
        if self.reads_signals:
            kernel = self.input_projection[...].astype(dtype)
            precision = attention.matmul_precision(self.cfg)
            return self.projection(inputs.astype(dtype), kernel, 1, precision)
        return jnp.take(self.embedding[...], inputs, axis=0).astype(dtype)

    def decode(
        self,
        x: jax.Array,
        positions: jax.Array,
        *,
        dropout_key: jax.Array | None = None,
        cache: Sequence[LayerCache] | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Embedded inputs [B, T, D] -> the blocks, final norm and readout: float32 [B, T', V | C_out].

        The readout is the tied embedding (logits) or the regression head.
        T' = T, or 1 with `readout='last'`: then the last block computes its
        queries, MLP and the output at the last position only (the keys and
        values still cover every position), which is all a loss on the last
        position needs.

        cache: one LayerCache per block (jrope.model.kv_cache): every
        position is computed, without remat.
        segment_ids: optional int32 [B, T] of packed rows (jrope.attention.packing):
        every position gives what its own sequence alone in a row would; on
        the PACKING_KERNELS, and with a KV cache in a prefill only.
        """
        dtype = jnp.dtype(self.cfg.compute_dtype)
        x = x.astype(dtype)
        run_block = _run_block
        if self.cfg.remat != "none":
            run_block = nnx.remat(_run_block, policy=_REMAT_POLICIES[self.cfg.remat])
        last = len(self.blocks) - 1
        for index, block in enumerate(self.blocks):
            # Each block draws its dropout masks from its own stream.
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
            if cache is not None:
                x = block(x, positions, cache=cache[index], segment_ids=segment_ids)
            elif index == last and self.cfg.readout == "last":
                x = block(x, positions, num_queries=1, dropout_key=key, segment_ids=segment_ids)
            else:
                x = run_block(block, x, positions, key, segment_ids)
        x = self.final_norm(x)
        # The tied output projection (or the regression head); accumulated in float32.
        if self.reads_signals:
            spec, readout = "btd,dc->btc", self.regression_head
        else:
            spec, readout = "btd,vd->btv", self.embedding
        precision, weights = attention.matmul_precision(self.cfg), readout[...].astype(dtype)
        return jnp.einsum(spec, x, weights, preferred_element_type=jnp.float32, precision=precision)
