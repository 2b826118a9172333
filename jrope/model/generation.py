"""Generating tokens from prompts, with the KV cache or by recomputation, in one compiled loop each.

    generator = Generator(graphdef, settings, mesh=mesh, rules=cfg.mesh.rules)
    rows = generator(params, prompts)       # one int32 array of new tokens per prompt

Cached (the default): the prompts go through the model's ordinary forward
once (jrope.model.kv_cache.prefill), then each new token costs one decode
step over the cache. Recomputed (`use_cache=False`, the reference answer):
every new token runs the full forward over the whole sequence again. Both
draw token i with the key fold_in(key(seed), i), so with the same logits
they draw the same tokens; with temperature 0 they must agree.

A batch of prompts of different lengths is right-padded: the causal forward
never lets a real token see a pad, the cache marks pad slots empty, and
each row reads its logits at its own last token. Each new token is at the
row's next position (its prompt starts at `position_offset`).

Both loops are a `lax.while_loop` inside one jitted function (no host round
trip per token), stopping when every row has produced the stop token or
after num_tokens, compiled in two stages: `start` (prompt -> logits of the
first new token) and `finish` (the loop). The recomputed loop runs the
forward over a fixed buffer of P + N - 1 positions so that it compiles once:
by causality the positions after a row's last token change nothing. The
cache is sharded like the activations, by its logical axes and the run's rules.

Sampling: divide by the temperature, keep the k most likely tokens, then the
smallest set of the most likely whose probability reaches p, and draw from
what remains; temperature 0 is greedy (argmax).

Shape legend: B batch, P padded prompt length, N new tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jrope import flops
from jrope.errors import UsageError
from jrope.model import kv_cache
from jrope.model.axes import Rules, logical_to_spec


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How tokens are drawn; every check raises UsageError naming the flag and the fix."""

    temperature: float = 0.0  # 0: greedy decoding; else the logits are divided by it
    top_k: int = 0  # keep the k most likely tokens (0: all)
    top_p: float = 1.0  # keep the most likely tokens up to total probability p (1: all)
    seed: int = 0  # the PRNG seed of the draws (unused when greedy)

    def __post_init__(self):
        problems = []
        if not 0 <= self.temperature < np.inf:
            problems.append(f"--temperature must be finite, >= 0, got {self.temperature}.")
        if self.top_k < 0:
            problems.append(f"--top_k must be >= 0 (0: no top-k filter), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            problems.append(f"--top_p must lie in (0, 1] (1: no nucleus filter), got {self.top_p}.")
        if problems:
            raise UsageError(" ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(logits: jax.Array, settings: SamplingSettings) -> jax.Array:
    """float32 [B, V]: logits / temperature, -inf outside the top-k and the top-p set."""
    logits = logits.astype(jnp.float32) / settings.temperature
    vocab = logits.shape[-1]
    if 0 < settings.top_k < vocab:
        kth = jax.lax.top_k(logits, settings.top_k)[0][..., -1:]  # [B, 1]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if settings.top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # A token stays when the tokens more likely than it hold less than p.
        before = jnp.cumsum(probs, axis=-1)
        before = jnp.concatenate([jnp.zeros_like(before[:, :1]), before[:, :-1]], axis=-1)
        keep_sorted, rows = before < settings.top_p, jnp.arange(logits.shape[0])[:, None]
        keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def next_tokens(logits: jax.Array, key: jax.Array, settings: SamplingSettings) -> jax.Array:
    """int32 [B]: the token drawn for each row of logits [B, V] (argmax when greedy)."""
    if settings.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, settings), axis=-1).astype(jnp.int32)


# Marks the places after a row's stop token in the [B, N] token array.
NO_TOKEN = -1


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """What to generate; every check raises UsageError naming the flag and the fix."""

    num_tokens: int  # new tokens per prompt (fewer when the stop token comes first)
    sampling: SamplingSettings = dataclasses.field(default_factory=SamplingSettings)
    stop_token: int | None = None  # stop a row after it produces this token (None: never)
    position_offset: int = 0  # absolute position of every prompt's first token
    # The cache moves its origin before a position gets further past it (jrope.model.kv_cache);
    # small values only cost time.
    rebase_bound: int = 1024
    use_cache: bool = True  # False recomputes the full forward for every token (the reference)

    def __post_init__(self):
        problems = []
        if self.num_tokens < 1:
            problems.append(f"--num_tokens must be >= 1, got {self.num_tokens}.")
        if self.position_offset < 0:
            problems.append(f"--position_offset must be >= 0, got {self.position_offset}.")
        if self.rebase_bound < 1:
            problems.append(f"--rebase_bound must be >= 1, got {self.rebase_bound}.")
        if problems:
            raise UsageError(" ".join(problems))


def pad_prompts(prompts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Prompts (int token arrays, each non-empty) -> right-padded int32 [B, P] and lengths int32 [B]."""
    if not prompts or any(len(prompt) == 0 for prompt in prompts):
        raise UsageError("every prompt needs at least one token; pass a non-empty --prompt.")
    lengths = np.asarray([len(prompt) for prompt in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    return tokens, lengths


def check_request(settings: GenerationSettings, prompt_length: int) -> None:
    """UsageError naming the flags where the last new token's position, offset +
    prompt_length + num_tokens - 1, would reach the cache's empty marker (int32's largest)."""
    most = kv_cache.EMPTY - 1 - prompt_length - settings.position_offset
    if settings.num_tokens > most:
        raise UsageError(
            f"--num_tokens={settings.num_tokens} after a prompt of {prompt_length} tokens at "
            f"--position_offset={settings.position_offset} puts positions past the int32 range; "
            f"at most {max(most, 0)} new tokens fit, or an offset of at most "
            f"{settings.position_offset + most - settings.num_tokens}."
        )


class Generator:
    """Compiled generation for one model's graphdef (its params passed per call) and one
    GenerationSettings; the cache is sharded over `mesh` by the logical-to-mesh `rules`."""

    def __init__(self, graphdef: Any, settings: GenerationSettings, *, mesh: Mesh, rules: Rules):
        self.settings = settings
        self._graphdef = graphdef
        self._mesh = mesh
        self._rules = rules
        self.start = jax.jit(self._start)
        self.finish = jax.jit(self._finish)

    def __call__(self, params: Any, prompts: Sequence[np.ndarray]) -> list[np.ndarray]:
        """The new tokens of each prompt: int32 [n], n <= num_tokens, ending at the stop token if drawn."""
        tokens, lengths = pad_prompts(prompts)
        check_request(self.settings, tokens.shape[1])
        offsets = np.full(lengths.shape, self.settings.position_offset, np.int32)
        key = jax.random.key(self.settings.sampling.seed)
        with jax.set_mesh(self._mesh):
            start = self.start.lower(params, tokens, lengths, offsets).compile()
            finish = self.finish.lower(params, *start.out_info, key).compile()
            what = f"--num_tokens={self.settings.num_tokens}: generating"
            flops.require_memory(start, finish, what=what, fix="lower --num_tokens or the prompts")
            logits, state = start(params, tokens, lengths, offsets)
            new_tokens = np.asarray(finish(params, logits, state, key))
        return [row[row != NO_TOKEN] for row in new_tokens]

    def _start(self, params, tokens, lengths, offsets):
        """(float32 [B, V] logits after each prompt, the loop's state)."""
        model = nnx.merge(self._graphdef, params)
        prompt_length = tokens.shape[1]
        length = prompt_length + self.settings.num_tokens - 1
        if self.settings.use_cache:
            sizes = dict(max_length=length, rebase_bound=self.settings.rebase_bound)
            logits, cache = kv_cache.prefill(model, tokens, lengths, offsets, **sizes)
            return logits, self._constrain(cache)
        buffer = jnp.zeros((tokens.shape[0], length), jnp.int32).at[:, :prompt_length].set(tokens)
        positions = offsets[:, None] + jnp.arange(length, dtype=jnp.int32)[None]
        logits = _logits_at(model(buffer, positions), lengths - 1)
        return logits, (buffer, positions, lengths)

    def _finish(self, params, logits, state, key):
        """int32 [B, N] new tokens (NO_TOKEN after a row's stop token)."""
        model = nnx.merge(self._graphdef, params)
        if self.settings.use_cache:

            def advance(cache, tokens):
                logits, cache = kv_cache.decode_step(model, cache, tokens)
                return logits, self._constrain(cache)
        else:

            def advance(state, tokens):
                buffer, positions, write = state
                rows = jnp.arange(buffer.shape[0])
                buffer = buffer.at[rows, write].set(tokens)
                return _logits_at(model(buffer, positions), write), (buffer, positions, write + 1)

        return _sampling_loop(logits, state, advance, key, self.settings)

    def _constrain(self, cache: kv_cache.KVCache) -> kv_cache.KVCache:
        """The cache with its sharding pinned: batch and heads split as the rules say."""

        def constrain(array, logical_axes):
            spec = logical_to_spec(logical_axes, array.shape, self._rules, self._mesh)
            return jax.lax.with_sharding_constraint(array, NamedSharding(self._mesh, spec))

        return cache.map_arrays(constrain)


def _logits_at(logits: jax.Array, index: jax.Array) -> jax.Array:
    """logits [B, T, V] at index[b] of each row -> [B, V]."""
    return jnp.take_along_axis(logits, index[:, None, None], axis=1)[:, 0]


def _sampling_loop(
    logits: jax.Array,
    state: Any,
    advance: Callable[[Any, jax.Array], tuple[jax.Array, Any]],
    key: jax.Array,
    settings: GenerationSettings,
) -> jax.Array:
    """Draws up to N tokens per row: token 0 from `logits`, token i from advance(state, token i-1).

    Stops early once every row has drawn the stop token. Returns int32 [B, N].
    """
    batch, num_tokens = logits.shape[0], settings.num_tokens

    def draw(index, logits, out, done):
        token = next_tokens(logits, jax.random.fold_in(key, index), settings.sampling)
        out = out.at[:, index].set(jnp.where(done, NO_TOKEN, token))
        if settings.stop_token is not None:
            done = done | (token == settings.stop_token)
        return token, out, done

    out = jnp.full((batch, num_tokens), NO_TOKEN, jnp.int32)
    token, out, done = draw(0, logits, out, jnp.zeros((batch,), bool))

    def not_finished(carry):
        index, _, _, _, done = carry
        return (index < num_tokens) & ~jnp.all(done)

    def step(carry):
        index, token, state, out, done = carry
        logits, state = advance(state, token)
        token, out, done = draw(index, logits, out, done)
        return index + 1, token, state, out, done

    return jax.lax.while_loop(not_finished, step, (1, token, state, out, done))[3]
