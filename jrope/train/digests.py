"""Content digests of the train state's arrays: damage in a checkpoint is found, not trained on.

A flipped bit or a garbled block in a checkpoint's data files restores
without any error (the files' own framing stays intact) and silently
changes parameters or optimizer moments. So every save records, per array,
a small fingerprint of its contents, and every restore recomputes it from
the restored arrays and compares (jrope.train.resume).

The fingerprint is computed where the data already are: one jitted pass over
the sharded state on its devices, whose result (two uint32 per array) is all
that reaches the host. It reads each array's bits as uint32 words x_i
(16- and 8-bit types widened) and takes, modulo 2^32,

    sum_i x_i        and        sum_i (2 i + 1) x_i.

A change of any one bit changes the first sum (by +-2^k, never 0 mod 2^32);
the odd weights keep that true for the second and make it see moved words
too. Integer sums are exact in any order, so the digest is the same however
the array is sharded. It is a check against damage, not a cryptographic
hash.

Its cost is one read of the state per checkpoint; benchmarks/checkpoint_digest.py
measures it against the train step (README, Performance).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def array_name(path: tuple) -> str:
    """A pytree key path as 'params/blocks/0/attn/qkv/value'."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _words(array: jax.Array) -> jax.Array:
    """The array's bits as uint32 [n] (n = its size; 16- and 8-bit elements widened)."""
    flat = array.reshape(-1)
    if flat.dtype == jnp.bool_:
        return flat.astype(jnp.uint32)
    unsigned = {4: jnp.uint32, 2: jnp.uint16, 1: jnp.uint8}[flat.dtype.itemsize]
    return jax.lax.bitcast_convert_type(flat, unsigned).astype(jnp.uint32)


def _fingerprint(array: jax.Array) -> jax.Array:
    """uint32 [2]: the plain and the odd-weighted sum of the array's words, mod 2^32."""
    words = _words(array)
    weights = 2 * jnp.arange(words.shape[0], dtype=jnp.uint32) + 1
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weights, dtype=jnp.uint32)])


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_fingerprint(leaf) for leaf in leaves]


def state_digests(state: Any) -> dict[str, list[int]]:
    """Array name -> [sum, weighted sum] of every array of `state` (a pytree of jax.Arrays).

    Blocks until the state is computed (it reads the values).
    """
    paths_and_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    fingerprints = jax.device_get(_fingerprints([leaf for _, leaf in paths_and_leaves]))
    return {
        array_name(path): [int(value) for value in np.asarray(fingerprint)]
        for (path, _), fingerprint in zip(paths_and_leaves, fingerprints, strict=False)
    }


def mismatches(saved: dict[str, list[int]], restored: dict[str, list[int]]) -> list[str]:
    """Names of the arrays whose restored digest differs from the saved one (or is missing)."""
    return sorted(
        name for name in saved.keys() | restored.keys() if saved.get(name) != restored.get(name)
    )
