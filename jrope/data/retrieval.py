"""Key-value retrieval: find a key's value far back in a sequence of filler (the paper's retrieval task).

A sequence of length ``T`` holds ``num_pairs`` (key, value) token pairs, each
at two adjacent positions, scattered over filler, and ends with the query:

    position 0          BOS
    1 .. T-3            filler, with the pairs starting at non-overlapping random
                        positions of 1 .. T-5
    T-2, T-1            QUERY, the key of one pair (the target pair)

The label is the target pair's value token, predicted at the last position
with a cross-entropy over the whole vocabulary (the 'classification' task of
jrope.data.source, readout at the last position). The keys of a sequence are
distinct (drawn without replacement from ``num_keys``), values are drawn
with replacement from ``num_values``. The key-to-query distance is
``T - 1 - s`` for the target pair at position ``s``: in training and in the
plain evaluation ``s`` is uniform over the pair positions ``1 .. T-5`` (the
distance over ``4 .. T-2``); the evaluation at a chosen distance ``d`` puts
the target pair at ``s = T - 1 - d``, for each of ``eval_distances`` with
``4 <= d < T - 2`` (the reference evaluates d < T - 2).

Vocabulary (the reference's layout): 0 PAD, 1 BOS, 2 QUERY, 3 NOISE, then the
``num_keys`` key tokens, then the ``num_values`` value tokens. Filler is drawn
uniformly from all four special tokens, as the reference draws it: BOS and
QUERY therefore also occur inside the filler, and the model has to find the
query by its place at ``T - 2`` rather than by its token alone.

The other pairs are placed greedily: candidate positions in a random order,
each taken when neither it nor its neighbour is taken yet. Every pair blocks
at most three candidates, so ``3 num_pairs <= T - 5`` guarantees room and is
checked.

Randomness: every sequence has its own PCG64 generator seeded with
``(seed, stream, step, row)`` for training and ``(eval_seed, stream, length[,
distance], sequence index)`` for evaluation: training, plain evaluation and
each distance's evaluation are disjoint streams (jrope.data.source).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from jrope.data.source import DEFAULT_EVAL_SEED, ProcessShare
from jrope.fields import PARAMETERS, RESULT, Declared, setting

PAD = 0
BOS = 1
QUERY = 2
NOISE = 3
FIRST_KEY = 4
FILLER = (PAD, BOS, QUERY, NOISE)  # the reference's filler tokens
MIN_DISTANCE = 4  # the target pair lies before QUERY and its key, after BOS

_TRAIN_STREAM = 0
_EVAL_STREAM = 1
_DISTANCE_STREAM = 2


@dataclasses.dataclass(frozen=True)
class RetrievalConfig(Declared):
    """Everything that determines the retrieval data.

    Attributes:
      source: 'retrieval' (the data section's source name).
      seq_len: training length T.
      seed: data seed; every training batch is a pure function of it (evaluation
        batches are of the evaluation seed).
      num_pairs: (key, value) pairs per sequence.
      num_keys: key tokens; the pairs of a sequence have distinct keys.
      num_values: value tokens.
      eval_distances: key-to-query distances evaluated at every evaluation
        length they fit in (4 <= d < length - 2), besides the plain evaluation.
    """

    section = "data"

    seq_len: int = setting(ge=1)
    source: str = setting("retrieval", choices=("retrieval",), defines=PARAMETERS)
    seed: int = setting(0, le=2**32 - 1, defines=RESULT)  # follows seed, which checks its floor
    num_pairs: int = setting(32, ge=1, le="num_keys", defines=RESULT)  # distinct keys
    num_keys: int = setting(128, ge=1, defines=PARAMETERS)
    num_values: int = setting(128, ge=1, defines=PARAMETERS)
    eval_distances: tuple[int, ...] = setting((), ge=MIN_DISTANCE)

    def __post_init__(self):
        object.__setattr__(self, "eval_distances", tuple(self.eval_distances))
        super().__post_init__()
        check_room(self.seq_len, self.num_pairs)

    @property
    def vocab_size(self) -> int:
        return FIRST_KEY + self.num_keys + self.num_values

    def key_token(self, key):
        """The token(s) of key index (array) `key` in [0, num_keys)."""
        return FIRST_KEY + np.asarray(key)

    def value_token(self, value):
        """The token(s) of value index (array) `value` in [0, num_values)."""
        return FIRST_KEY + self.num_keys + np.asarray(value)


def check_room(length: int, num_pairs: int) -> None:
    """ValueError unless sequences of `length` surely have room for `num_pairs` pairs."""
    if length < 8 or 3 * num_pairs > length - 5:
        raise ValueError(
            f"sequences of length {length} have no sure room for {num_pairs} pairs "
            f"(need length >= max(8, 3 num_pairs + 5) = {max(8, 3 * num_pairs + 5)}); "
            "lower data.num_pairs or use longer sequences."
        )


def make_sequence(
    cfg: RetrievalConfig, rng: np.random.Generator, length: int, distance: int | None
) -> tuple[np.ndarray, int, int]:
    """One sequence: (tokens int32 [length], label token, key-to-query distance).

    distance: where the target pair goes (None: uniformly random).
    """
    last_start = length - 5  # pair starts lie in 1 .. length - 5
    if distance is None:
        target_start = int(rng.integers(1, last_start + 1))
    else:
        target_start = length - 1 - distance
    keys = rng.choice(cfg.num_keys, size=cfg.num_pairs, replace=False)
    values = rng.integers(0, cfg.num_values, size=cfg.num_pairs)
    tokens = rng.choice(np.asarray(FILLER, np.int32), size=length)
    tokens[0] = BOS
    taken = np.zeros(length, bool)
    starts = [target_start]
    taken[target_start : target_start + 2] = True
    for start in rng.permutation(np.arange(1, last_start + 1)):
        if len(starts) == cfg.num_pairs:
            break
        if not (taken[start] or taken[start + 1]):
            taken[start : start + 2] = True
            starts.append(int(start))
    starts = np.asarray(starts)
    tokens[starts] = cfg.key_token(keys)
    tokens[starts + 1] = cfg.value_token(values)
    tokens[length - 2] = QUERY
    tokens[length - 1] = cfg.key_token(keys[0])
    return tokens, int(cfg.value_token(values[0])), length - 1 - target_start


class RetrievalSource:
    """Data source of the retrieval task (jrope.data.source's contract; DistanceEvaluation too).

    Batches: 'inputs' int32 [b, T], 'targets' int32 [b, T] (the value token at
    the last position, 0 elsewhere), 'weights' float32 [b, T] (1 at the last
    position, 0 elsewhere).
    """

    task = "classification"

    def __init__(
        self,
        data_cfg: RetrievalConfig,
        global_batch_size: int,
        process_index: int,
        process_count: int,
    ):
        self.data_cfg = data_cfg
        self.vocab_size = self.num_classes = data_cfg.vocab_size  # every token's logit competes
        self.share = ProcessShare(global_batch_size, process_index, process_count)

    def train_batch(self, step: int) -> dict:
        """This process's rows of the global training batch of ``step`` (length T)."""
        rngs = self.share.train_generators(self.data_cfg.seed, _TRAIN_STREAM, step)
        return self._make_batch(rngs, self.data_cfg.seq_len, None)

    def eval_batches(
        self, length: int, num_sequences: int, batch_size: int, seed: int = DEFAULT_EVAL_SEED
    ) -> Iterator[dict]:
        """This process's share of ``num_sequences`` fixed sequences of ``length``, random distances.

        ``seed``: the evaluation seed (not the data config's).
        """
        check_room(length, self.data_cfg.num_pairs)
        words = (seed, _EVAL_STREAM, length)
        for rngs in self.share.eval_generators(words, length, num_sequences, batch_size, 8):
            yield self._make_batch(rngs, length, None)

    def eval_distances(self, length: int) -> tuple[int, ...]:
        """The configured distances that fit in sequences of ``length`` (d < length - 2)."""
        return tuple(d for d in self.data_cfg.eval_distances if d < length - 2)

    def distance_eval_batches(
        self,
        length: int,
        distance: int,
        num_sequences: int,
        batch_size: int,
        seed: int = DEFAULT_EVAL_SEED,
    ) -> Iterator[dict]:
        """Like eval_batches, with every target pair ``distance`` positions before the query's key."""
        check_room(length, self.data_cfg.num_pairs)
        if not MIN_DISTANCE <= distance <= length - 2:
            raise ValueError(
                f"distance {distance} does not fit in length {length}: "
                f"it must lie in [{MIN_DISTANCE}, {length - 2}]."
            )
        words = (seed, _DISTANCE_STREAM, length, distance)
        for rngs in self.share.eval_generators(words, length, num_sequences, batch_size, 8):
            yield self._make_batch(rngs, length, distance)

    def _make_batch(self, rngs: list[np.random.Generator], length: int, distance) -> dict:
        sequences = [make_sequence(self.data_cfg, rng, length, distance) for rng in rngs]
        inputs = np.stack([tokens for tokens, _, _ in sequences])
        targets = np.zeros((len(rngs), length), np.int32)
        targets[:, -1] = [label for _, label, _ in sequences]
        weights = np.zeros((len(rngs), length), np.float32)
        weights[:, -1] = 1.0
        return {"inputs": inputs, "targets": targets, "weights": weights}
