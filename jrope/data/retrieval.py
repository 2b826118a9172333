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

Every sequence has a generator of its own (jrope.data.source.SeededSource);
each distance's evaluation draws from a stream of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from jrope.data.source import DEFAULT_EVAL_SEED, SeededSource, last_position_batch
from jrope.fields import PARAMETERS, RESULT, Declared, setting

PAD = 0
BOS = 1
QUERY = 2
NOISE = 3
FIRST_KEY = 4
FILLER = (PAD, BOS, QUERY, NOISE)  # the reference's filler tokens
MIN_DISTANCE = 4  # the target pair lies before QUERY and its key, after BOS

_DISTANCE_STREAM = 2  # after jrope.data.source's train and eval streams


@dataclasses.dataclass(frozen=True)
class RetrievalConfig(Declared):
    """Everything that determines the retrieval data."""

    section = "data"

    seq_len: int = setting(ge=1)  # training length T
    source: str = setting("retrieval", choices=("retrieval",), defines=PARAMETERS)
    seed: int = setting(0, le=2**32 - 1, defines=RESULT)  # follows seed, which checks its floor
    num_pairs: int = setting(32, ge=1, le="num_keys", defines=RESULT)  # distinct keys
    num_keys: int = setting(128, ge=1, defines=PARAMETERS)  # key tokens
    num_values: int = setting(128, ge=1, defines=PARAMETERS)  # value tokens
    # Key-to-query distances evaluated at every evaluation length they fit in
    # (4 <= d < length - 2), besides the plain evaluation.
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


class RetrievalSource(SeededSource):
    """Data source of the retrieval task (DistanceEvaluation too): 'inputs' int32 [b, T], the
    value token the target of the last position, the only one weighted (last_position_batch)."""

    task = "classification"
    min_eval_length = 8

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Every token's logit competes.
        self.vocab_size = self.num_classes = self.data_cfg.vocab_size

    def eval_batches(self, length: int, *args, **kwargs) -> Iterator[dict]:
        """SeededSource.eval_batches: sequences of ``length``, at random distances."""
        check_room(length, self.data_cfg.num_pairs)
        yield from super().eval_batches(length, *args, **kwargs)

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
            yield self.make_batch(rngs, length, distance)

    def make_batch(self, rngs: list[np.random.Generator], length: int, distance=None) -> dict:
        sequences = [make_sequence(self.data_cfg, rng, length, distance) for rng in rngs]
        inputs = np.stack([tokens for tokens, _, _ in sequences])
        return last_position_batch(inputs, [label for _, label, _ in sequences])
