"""jrope.train.checkpoints: saves with digests, damage found on restore, the workdir lock."""

import os
import socket

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.tiny_config import tiny_config

from jrope.errors import WorkdirBusy
from jrope.train.checkpoints import (
    CONFIG_ITEM,
    LOCK_FILE,
    Checkpointer,
    WorkdirLock,
    mismatches,
    state_digests,
)
from jrope.train.config import TrainConfig
from jrope.train.setup import set_up_run


def _checkpointer(directory, cfg, every_steps=2, max_to_keep=2):
    return Checkpointer(
        str(directory),
        every_steps=every_steps,
        max_to_keep=max_to_keep,
        config_json=cfg.to_json_dict(),
    )


@pytest.mark.slow
def test_sharded_state_round_trip_into_the_abstract_target(tmp_path):
    cfg = tiny_config(**{"model.num_heads": 4, "mesh.data": 2, "mesh.fsdp": 4})
    run = set_up_run(cfg)
    layout = run.layout
    state = run.init_state()
    checkpointer = _checkpointer(tmp_path, cfg)
    assert checkpointer.save(2, state)
    checkpointer.wait_until_finished()

    restored = checkpointer.restore(layout.abstract)
    saved_leaves, restored_leaves = jax.tree.leaves(state), jax.tree.leaves(restored)
    target_leaves = jax.tree.leaves(layout.abstract)
    assert len(saved_leaves) == len(restored_leaves) == len(target_leaves)
    for saved, loaded, target in zip(saved_leaves, restored_leaves, target_leaves, strict=False):
        np.testing.assert_array_equal(np.asarray(loaded), np.asarray(saved))
        assert loaded.sharding == target.sharding  # read straight into its shards
    # The embedding [3, 32] is split 4 ways over fsdp on its embed axis.
    embedding = restored["params"]["embedding"][...]
    assert embedding.addressable_shards[0].data.shape == (3, 8)

    # The config saved beside the state converts back to the same run config.
    assert TrainConfig.from_config_dict(checkpointer.restore_json(CONFIG_ITEM)) == cfg
    checkpointer.close()


@pytest.mark.slow
def test_periodic_saves_keep_the_latest_ones(tmp_path):
    cfg = tiny_config()
    state = set_up_run(cfg, devices=jax.devices()[:1]).init_state()
    checkpointer = _checkpointer(tmp_path, cfg, every_steps=3, max_to_keep=2)
    saved = [step for step in range(1, 11) if checkpointer.save(step, state)]
    checkpointer.wait_until_finished()
    # Every third step (not the first: nobody asked for it); the final step is forced.
    assert saved == [3, 6, 9]
    assert checkpointer.save(10, state, force=True)
    checkpointer.wait_until_finished()
    assert checkpointer.latest_step() == 10
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [9, 10]
    checkpointer.close()


def test_restore_without_checkpoint_is_refused(tmp_path):
    checkpointer = _checkpointer(tmp_path / "empty", tiny_config())
    with pytest.raises(FileNotFoundError, match="No steps found in .*empty"):
        checkpointer.restore({})
    checkpointer.close()


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


def test_a_second_holder_is_refused_with_the_first_ones_host_and_pid(tmp_path):
    with WorkdirLock(str(tmp_path / "run")) as lock:
        assert lock.previous_holder is None
        with pytest.raises(WorkdirBusy) as refused:
            WorkdirLock(str(tmp_path / "run")).__enter__()
        message = str(refused.value)
        assert f"(training by process {os.getpid()} on {socket.gethostname()} since " in message
        assert message.endswith("wait, or use another --workdir.")
    assert (tmp_path / "run" / LOCK_FILE).read_text() == ""  # released cleanly
    with WorkdirLock(str(tmp_path / "run")) as lock:  # and free again
        assert lock.previous_holder is None


def test_the_lock_of_a_process_that_died_is_taken_over(tmp_path):
    # What a killed run leaves: the file with its holder, but no lock (the kernel dropped it).
    holder = "training by process 12345 on elsewhere since 2026-12-01 10:00:00"
    (tmp_path / LOCK_FILE).write_text(holder + "\n")
    with WorkdirLock(str(tmp_path)) as lock:
        assert lock.previous_holder == holder
        assert f"process {os.getpid()} on" in (tmp_path / LOCK_FILE).read_text()


def test_only_the_enabled_process_locks_and_object_stores_are_not_locked(tmp_path):
    with WorkdirLock(str(tmp_path), enabled=False):
        with WorkdirLock(str(tmp_path)):  # another process of the same run: no conflict
            pass
    with WorkdirLock("gs://bucket/run") as lock:  # warns; nothing to lock
        assert lock.previous_holder is None
