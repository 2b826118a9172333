"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus).

Pure, jittable functions of the logits and a PRNG key; the settings are a
frozen dataclass, static under jit. The filters apply in the usual order:
divide by the temperature, keep the k most likely tokens, then keep the
smallest set of the most likely tokens whose probability reaches p (the
most likely token always stays), and draw from what remains. Temperature 0
is greedy (argmax), which draws nothing.

Shape legend: B batch, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """How tokens are drawn; every check raises ValueError naming the flag and the fix.

    temperature: 0 for greedy decoding, else the logits are divided by it.
    top_k: keep the k most likely tokens (0: all).
    top_p: keep the most likely tokens up to total probability p (1: all).
    seed: the PRNG seed of the draws (unused when greedy).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        problems = []
        if not self.temperature >= 0:
            problems.append(f"--temperature must be >= 0 (0: greedy), got {self.temperature}.")
        if self.top_k < 0:
            problems.append(f"--top_k must be >= 0 (0: no top-k filter), got {self.top_k}.")
        if not 0 < self.top_p <= 1:
            problems.append(f"--top_p must lie in (0, 1] (1: no nucleus filter), got {self.top_p}.")
        if problems:
            raise ValueError(" ".join(problems))

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
        keep_sorted = before < settings.top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(logits.shape[0])[:, None], order]
            .set(keep_sorted)
        )
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def next_tokens(logits: jax.Array, key: jax.Array, settings: SamplingSettings) -> jax.Array:
    """int32 [B]: the token drawn for each row of logits [B, V] (argmax when greedy)."""
    if settings.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, settings), axis=-1).astype(jnp.int32)
