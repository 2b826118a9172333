"""The orbax wrapper: sharded round trip, the config beside the state, retention, clear failures."""

import jax
import numpy as np
import pytest
from helpers.tiny_config import tiny_config

from jrope.train.checkpointing import Checkpointer
from jrope.train.config import TrainConfig
from jrope.train.setup import set_up_run


def _checkpointer(directory, cfg, every_steps=2, max_to_keep=2):
    return Checkpointer(
        str(directory),
        every_steps=every_steps,
        max_to_keep=max_to_keep,
        config_json=cfg.to_json_dict(),
    )


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
    assert TrainConfig.from_config_dict(checkpointer.restore_config()) == cfg
    checkpointer.close()


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


def test_restore_without_checkpoint_says_what_to_do(tmp_path):
    checkpointer = _checkpointer(tmp_path / "empty", tiny_config())
    with pytest.raises(FileNotFoundError, match="train first"):
        checkpointer.restore({})
    checkpointer.close()
