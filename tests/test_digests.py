"""Array digests: any flipped bit is seen, and the digest does not depend on the sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrope.train.digests import mismatches, state_digests


@pytest.mark.parametrize("dtype", [np.float32, np.int32, jnp.bfloat16])
def test_every_single_bit_flip_changes_the_digest(dtype):
    values = np.random.default_rng(0).normal(size=(3, 5)).astype(dtype)
    saved = state_digests({"w": jnp.asarray(values)})
    words = values.view(np.uint16 if values.dtype.itemsize == 2 else np.uint32).reshape(-1)
    for index in range(words.size):
        for bit in range(8 * values.dtype.itemsize):
            flipped = words.copy()
            flipped[index] ^= 1 << bit
            damaged = {"w": jnp.asarray(flipped.view(values.dtype).reshape(values.shape))}
            assert mismatches(saved, state_digests(damaged)) == ["w"]


def test_swapped_values_are_seen_and_names_follow_the_tree():
    state = {"params": {"a": jnp.arange(6.0)}, "step": jnp.int32(3)}
    saved = state_digests(state)
    assert sorted(saved) == ["params/a", "step"]
    swapped = {"params": {"a": jnp.asarray([1.0, 0.0, 2.0, 3.0, 4.0, 5.0])}, "step": jnp.int32(3)}
    assert mismatches(saved, state_digests(swapped)) == ["params/a"]
    assert mismatches(saved, {"step": saved["step"]}) == ["params/a"]  # a missing array


def test_the_digest_is_the_same_however_the_array_is_sharded():
    values = jnp.asarray(np.random.default_rng(1).normal(size=(8, 16)).astype(np.float32))
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    sharded = jax.device_put(values, jax.NamedSharding(mesh, jax.P("a", "b")))
    assert state_digests({"w": sharded}) == state_digests({"w": jax.device_get(values)})
