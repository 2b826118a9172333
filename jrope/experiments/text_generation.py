"""Text from a trained byte-level run: its latest checkpoint loaded without its training data.

Every checkpoint keeps the config of the run that wrote it, so a workdir is
all generation needs: the model, the encoding, the vocabulary and the state
layout come from the config, and the corpus is never read. Only runs on
TEXT_SOURCES have text to write (an audio-token run's bytes are not text).
Decoding keeps the run's tensor axis where it divides the devices and puts
every other device on the data axis.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from absl import logging
from jax.sharding import Mesh

from jrope import saved_run_config
from jrope.attention.selection import cache_rebase_bound
from jrope.data.files import resolved
from jrope.data.text_bytes import decode_tokens, encode_text
from jrope.encodings import Encoding
from jrope.errors import UsageError
from jrope.model import damping
from jrope.model.generation import GenerationSettings, Generator, check_request, pad_prompts
from jrope.train import setup
from jrope.train.checkpoints import Checkpointer, restore_compatible
from jrope.train.config import TrainConfig

TEXT_SOURCES = ("wikitext103", "wikitext2", "text")


@dataclasses.dataclass(frozen=True)
class TextRun:
    """A text run's model at one checkpoint, ready to generate."""

    cfg: TrainConfig
    encoding: Encoding
    step: int
    graphdef: Any
    params: Any
    mesh: Mesh

    def generate(self, prompts: Sequence[str], settings: GenerationSettings) -> list[str]:
        """The text generated after each prompt (bytes decoded as UTF-8 with replacement);
        UsageError before compiling when the positions leave int32."""
        vocab_size = self.cfg.data.vocab_size
        encoded = [encode_text(prompt, vocab_size) for prompt in prompts]
        # A request that cannot run is refused alone, before the damping's note.
        check_request(settings, pad_prompts(encoded)[0].shape[1])
        graphdef, settings = self._plan_for_damping(settings)
        generator = Generator(graphdef, settings, mesh=self.mesh, rules=self.cfg.mesh.rules)
        rows = generator(self.params, encoded)
        return [decode_tokens(row, vocab_size) for row in rows]

    def _plan_for_damping(self, settings: GenerationSettings) -> tuple[Any, GenerationSettings]:
        """The graphdef and settings that carry the parameters' damping (jrope.model.damping):
        kernels planned for it, and a cache that moves its origin before e^(gamma * rebase_bound)
        would overflow float32."""
        graphdef, measured = damping.plan(self.cfg.model, self.encoding, self.graphdef, self.params)
        if not measured.passed:
            return graphdef, settings
        rebase_bound = cache_rebase_bound(settings.rebase_bound, measured.largest)
        message = "%s: generating with kernels planned for it and rebase_bound %d."
        logging.warning(message, measured.describe(), rebase_bound)
        return graphdef, dataclasses.replace(settings, rebase_bound=rebase_bound)

    def byte_token(self, byte: int) -> int:
        """The token of a byte value (0..255) in this run's vocabulary."""
        return byte + self.cfg.data.token_offset


def load_text_run(workdir: str, devices: Sequence[jax.Device] | None = None) -> TextRun:
    """The latest finished checkpoint of the text run in `workdir`, on `devices` (default: all).

    Raises CheckpointError (none, or one that cannot be read) or UsageError (not a text run).
    """
    step = int(saved_run_config.saved_config_path(workdir).parent.parent.name)
    cfg = TrainConfig.from_config_dict(saved_run_config.get_config(workdir))
    if cfg.data.source not in TEXT_SOURCES:
        raise UsageError(
            f"--workdir {resolved(workdir)} holds a {cfg.data.source!r} run, whose tokens are no "
            f"text; point it at a run trained with data.source in {TEXT_SOURCES}."
        )
    directory = resolved(workdir) / "checkpoints"
    # Read only: this manager never saves, so it never deletes old checkpoints either.
    checkpointer = Checkpointer(
        directory, every_steps=1, max_to_keep=step, config_json=cfg.to_json_dict()
    )
    with contextlib.closing(checkpointer):
        tensor, num_devices = cfg.mesh.tensor, len(devices or jax.devices())
        tensor = tensor if tensor > 0 and num_devices % tensor == 0 else 1
        mesh_cfg = dataclasses.replace(cfg.mesh, data=-1, fsdp=1, tensor=tensor)
        mesh, encoding = setup.make_mesh(mesh_cfg, devices), setup.run_encoding(cfg)
        optimizer = setup.make_optimizer(
            cfg.opt, setup.learning_rate_schedule(cfg.opt, cfg.num_steps)
        )
        io = {"vocab_size": cfg.data.vocab_size}
        layout = setup.state_layout(cfg, encoding, io, mesh, optimizer)
        state = restore_compatible(checkpointer, layout.abstract, step)
    logging.info("Loaded %s (%s, step %d).", workdir, cfg.pe.name, step)
    return TextRun(cfg, encoding, step, layout.graphdef, state["params"], mesh)
