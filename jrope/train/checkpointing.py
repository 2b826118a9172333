"""One orbax CheckpointManager for a run's workdir.

Each checkpoint step holds three items: `state` (the train state pytree:
step, params, optimizer state; sharded arrays, restored straight into an
abstract sharded target), `config` (the run's TrainConfig as JSON, so a
workdir says how it was made) and `digests` (a fingerprint of every array of
the state, JSON, jrope.train.digests; checked after every restore by
jrope.train.resume). The data position is the state's `step`: data sources
are pure functions of the step, so resuming at `step` continues the exact
batch sequence.

A step is saved when it is a multiple of checkpoint.every_steps, or when
forced (the last step, a preemption); orbax's own policy would also save the
first step of every start, which nobody asked for.

Saves are atomic (orbax writes to a temporary directory and renames it), so
a run killed mid-save resumes from the previous checkpoint. The directory
may be local or on a bucket (`gs://...`): orbax handles both itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from jrope.data.files import resolved
from jrope.errors import NoCheckpointError
from jrope.train import digests

if TYPE_CHECKING:
    from jrope.train.config import TrainConfig

STATE_ITEM = "state"
CONFIG_ITEM = "config"
DIGESTS_ITEM = "digests"


class Checkpointer:
    """Periodic and final saves, latest-checkpoint restore, config and digests beside the state.

    Args:
      directory: where checkpoints live (created if missing); one subdirectory per step.
      every_steps: a step is saved when it is a multiple of this (or forced).
      max_to_keep: older checkpoints beyond this many are deleted.
      config_json: the run's configuration as a JSON-serialisable dict.
    """

    def __init__(
        self, directory: str, *, every_steps: int, max_to_keep: int, config_json: dict[str, Any]
    ):
        self.directory = resolved(directory)  # a gs:// URI reaches orbax unchanged
        self._config_json = config_json
        self._every_steps = every_steps
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=(STATE_ITEM, CONFIG_ITEM, DIGESTS_ITEM)
        )

    @classmethod
    def for_run(cls, cfg: TrainConfig, workdir: str) -> Checkpointer:
        """The checkpoints of the run in `workdir` (`<workdir>/checkpoints`), as `cfg` sets them."""
        return cls(
            epath.Path(workdir) / "checkpoints",
            every_steps=cfg.checkpoint.every_steps,
            max_to_keep=cfg.checkpoint.max_to_keep,
            config_json=cfg.to_json_dict(),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def should_save(self, step: int) -> bool:
        return step % self._every_steps == 0

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Save `state` as checkpoint `step` when due (or `force`); returns whether it saved.

        Returns once the arrays are copied off the device, so the caller may
        donate `state` to the next step while the files are written.
        """
        if not (force or self.should_save(step)):
            return False
        return self._manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardSave(state),
                    CONFIG_ITEM: ocp.args.JsonSave(self._config_json),
                    DIGESTS_ITEM: ocp.args.JsonSave(digests.state_digests(state)),
                }
            ),
            force=True,
        )

    def restore(self, abstract_state: Any, step: int | None = None) -> Any:
        """The state of checkpoint `step` (default: latest), laid out like `abstract_state`.

        `abstract_state` is a pytree of `jax.ShapeDtypeStruct` with shardings:
        every array is read straight into its shards, never gathered on one device.
        """
        step = self._require_step(step)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state)})
        )
        return restored[STATE_ITEM]

    def restore_config(self, step: int | None = None) -> dict[str, Any]:
        """The configuration saved with checkpoint `step` (default: latest)."""
        return self._restore_json(CONFIG_ITEM, step)

    def restore_digests(self, step: int | None = None) -> dict[str, list[int]] | None:
        """The array digests saved with checkpoint `step` (default: latest); None if it has none."""
        step = self._require_step(step)
        if not (self.directory / str(step) / DIGESTS_ITEM).exists():
            return None  # written before checkpoints carried digests
        return self._restore_json(DIGESTS_ITEM, step)

    def _restore_json(self, item: str, step: int | None) -> dict[str, Any]:
        step = self._require_step(step)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{item: ocp.args.JsonRestore()})
        )
        return restored[item]

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def _require_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
        if step is None or step not in self._manager.all_steps():
            raise NoCheckpointError(
                f"No checkpoint {'' if step is None else step} in {self.directory}; train first "
                "(python train.py --config=... --workdir=...) or point --workdir at a trained run."
            )
        return step


def abstract_with_shardings(abstract_tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs of `abstract_tree` carrying the matching `shardings` (same structure)."""
    return jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
        abstract_tree,
        shardings,
    )
