"""Random bytes in place of a text corpus, for the benchmarks that time byte-level steps.

A step's cost does not depend on which bytes it sees, so the WikiText-shape
benchmarks run on uniform random tokens and need no corpus on disk.
"""

import numpy as np

from jrope.train.config import TrainConfig


class RandomBytes:
    """A byte-level language-model source (jrope.data.source's contract) of uniform random tokens.

    train_batch(step): 'inputs', 'targets' int32 [B, T] (targets: the next
    token) and 'weights' float32 [B, T] of ones, B the config's batch size and
    T its data.seq_len; tokens drawn from [data.token_offset, data.vocab_size),
    a pure function of (seed, step).
    """

    task = "language_model"
    num_classes = None

    def __init__(self, cfg: TrainConfig):
        self._cfg = cfg
        self.vocab_size = cfg.data.vocab_size

    def train_batch(self, step: int) -> dict[str, np.ndarray]:
        b, t = self._cfg.batch_size, self._cfg.data.seq_len
        rng = np.random.default_rng([self._cfg.seed, step])
        window = rng.integers(
            self._cfg.data.token_offset, self.vocab_size, (b, t + 1), dtype=np.int32
        )
        return {
            "inputs": window[:, :-1],
            "targets": window[:, 1:],
            "weights": np.ones((b, t), np.float32),
        }
