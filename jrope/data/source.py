"""The data-source contract: what the trainer and the evaluation ask of every data source.

A data source is built once per process for a global batch size, and hands
out this process's rows of every global batch:

    source = build_source(data_cfg, global_batch_size, process_index, process_count)
    source.train_batch(step)                                        # one step's rows
    source.eval_batches(length, num_sequences, batch_size, seed)    # fixed evaluation rows

Each batch is a dict of numpy arrays with a leading axis of this process's
rows: 'inputs', 'targets', and 'weights' float32 [b, T] (each position's
weight in the loss). What inputs and targets hold is the source's `task`:

    'language_model'  inputs, targets int32 [b, T] tokens (targets: the next
                      token); cross-entropy over the whole vocabulary.
    'classification'  inputs int32 [b, T] tokens; targets int32 [b, T] class
                      labels where weights are nonzero (e.g. only the last
                      position); cross-entropy over the logits of the first
                      num_classes tokens.
    'regression'      inputs float32 [b, T, C_in] real-valued signals (the model
                      projects them in), targets float32 [b, T, C_out]; mean
                      squared error of a linear regression head. Such sources
                      give input_channels and output_channels, and vocab_size None.

A source that can place what the evaluation asks about at a chosen distance
(key-value retrieval: the key-to-query distance) also implements
DistanceEvaluation; the evaluation then reports every length per distance too.

Row r of a global batch belongs to process r // b (b = global / process
count), whatever the process count. Training batches are pure functions of
the config's seed and the step (a resumed run sees the data an uninterrupted
one would); evaluation sequences of the evaluation seed, the length and the
sequence index alone, so every run of a comparison is scored on the same
sequences, as the reference code does, and fewer sequences are a prefix of more.

`data.source` names the source; SOURCES maps each name to the module, the
frozen config dataclass its `data` section converts to, and the source class.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

Batch = dict[str, np.ndarray]


TASKS = ("language_model", "classification", "regression")

# The evaluation sequences' seed when eval.seed is not set: one value for every run. The
# evaluation draws from its own streams, so it shares no data with training of any seed.
DEFAULT_EVAL_SEED = 0
# First entropy word after the seed of a row's generator: the train and eval streams are disjoint.
TRAIN_STREAM, EVAL_STREAM = 0, 1


class DataSource(Protocol):
    """What every source provides (see the module docstring)."""

    task: str  # one of TASKS: what the batches hold and which loss the trainer takes
    vocab_size: int | None  # tokens the model embeds; None for real-valued inputs (regression)
    num_classes: int | None  # classification over the first num_classes tokens, or None

    def train_batch(self, step: int) -> Batch: ...

    def eval_batches(
        self, length: int, num_sequences: int, batch_size: int, seed: int = DEFAULT_EVAL_SEED
    ) -> Iterator[Batch]: ...


@runtime_checkable
class DistanceEvaluation(Protocol):
    """A source whose evaluation sequences can put their answer at a chosen distance."""

    def eval_distances(self, length: int) -> tuple[int, ...]:
        """The configured distances that fit in sequences of `length`."""
        ...

    def distance_eval_batches(
        self,
        length: int,
        distance: int,
        num_sequences: int,
        batch_size: int,
        seed: int = DEFAULT_EVAL_SEED,
    ) -> Iterator[Batch]:
        """Like eval_batches, every sequence with its answer `distance` positions before the end."""
        ...


@dataclasses.dataclass(frozen=True)
class ProcessShare:
    """This process's rows of global batches; the checks every source needs, in one place."""

    global_batch_size: int
    process_index: int
    process_count: int

    def __post_init__(self):
        index, count, size = self.process_index, self.process_count, self.global_batch_size
        if not 0 <= index < count or size < 1 or size % count:
            raise ValueError(
                f"global_batch_size {size} must be a positive multiple of process_count {count}, "
                f"and process_index {index} below process_count; change the batch size."
            )

    def eval_rows(
        self, length: int, num_sequences: int, batch_size: int, min_length: int
    ) -> Iterator[range]:
        """Per global evaluation batch, the indices of this process's sequences.

        Sequence i is the same whatever the batch size and process count.
        """
        if (
            length < min_length
            or batch_size < 1
            or batch_size % self.process_count
            or (num_sequences % batch_size)
        ):
            raise ValueError(
                f"Evaluation length {length} must be >= {min_length}, and batch_size {batch_size} "
                f"be a positive multiple of process_count {self.process_count} and divide "
                f"num_sequences {num_sequences}."
            )
        local = batch_size // self.process_count
        for batch_start in range(0, num_sequences, batch_size):
            first = batch_start + self.process_index * local
            yield range(first, first + local)

    def train_generators(self, seed: int, stream: int, step: int) -> list[np.random.Generator]:
        """A PCG64 generator per row of this process's share of `step`'s global batch, seeded
        with (seed, stream, step, row): each row is the same whatever the process count."""
        local = self.global_batch_size // self.process_count
        rows = range(self.process_index * local, (self.process_index + 1) * local)
        return [np.random.default_rng([seed, stream, step, row]) for row in rows]

    def eval_generators(
        self,
        words: Sequence[int],
        length: int,
        num_sequences: int,
        batch_size: int,
        min_length: int,
    ) -> Iterator[list[np.random.Generator]]:
        """Per global evaluation batch (eval_rows), a generator per sequence i of this process,
        seeded with (*words, i)."""
        for indices in self.eval_rows(length, num_sequences, batch_size, min_length):
            yield [np.random.default_rng([*words, index]) for index in indices]


class SeededSource:
    """A source whose every row comes from a generator of its own: training row r of `step` from
    (data_cfg.seed, TRAIN_STREAM, step, r), evaluation sequence i of a length from (the eval seed,
    EVAL_STREAM, length, i). A subclass sets `task` and its sizes, and makes a batch of `length`
    from a generator per row (`make_batch`)."""

    min_eval_length = 2

    def __init__(self, data_cfg, global_batch_size: int, process_index: int, process_count: int):
        self.data_cfg = data_cfg
        self.share = ProcessShare(global_batch_size, process_index, process_count)

    def train_batch(self, step: int) -> Batch:
        """This process's rows of the global training batch of `step` (length data_cfg.seq_len)."""
        rngs = self.share.train_generators(self.data_cfg.seed, TRAIN_STREAM, step)
        return self.make_batch(rngs, self.data_cfg.seq_len)

    def eval_batches(
        self, length: int, num_sequences: int, batch_size: int, seed: int = DEFAULT_EVAL_SEED
    ) -> Iterator[Batch]:
        """This process's share of `num_sequences` fixed evaluation sequences of `length`
        (`batch_size`: the global evaluation batch)."""
        words, least = (seed, EVAL_STREAM, length), self.min_eval_length
        for rngs in self.share.eval_generators(words, length, num_sequences, batch_size, least):
            yield self.make_batch(rngs, length)


def last_position_batch(inputs: np.ndarray, labels: Sequence[int]) -> Batch:
    """A classification batch of int32 inputs [b, T] whose labels [b] are the targets of the last
    position, the only one weighted."""
    targets, weights = np.zeros(inputs.shape, np.int32), np.zeros(inputs.shape, np.float32)
    targets[:, -1], weights[:, -1] = labels, 1.0
    return {"inputs": inputs, "targets": targets, "weights": weights}


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """Where a source lives: its module, its config dataclass and its class."""

    module: str
    config_class: str
    source_class: str

    def load(self) -> tuple[type, type]:
        module = importlib.import_module(self.module)
        return getattr(module, self.config_class), getattr(module, self.source_class)


_TEXT_BYTES = SourceSpec("jrope.data.text_bytes", "TextDataConfig", "ByteTextSource")

# data.source -> where that source lives.
SOURCES = {
    "synthetic": SourceSpec("jrope.data.synthetic", "SyntheticTaskConfig", "SyntheticSource"),
    "text": _TEXT_BYTES,
    "wikitext103": _TEXT_BYTES,
    "wikitext2": _TEXT_BYTES,
    "audio_tokens": _TEXT_BYTES,
    "signal": SourceSpec("jrope.data.signal", "SignalRegressionConfig", "SignalRegressionSource"),
    "retrieval": SourceSpec("jrope.data.retrieval", "RetrievalConfig", "RetrievalSource"),
}


def build_source(
    data_cfg: Any, global_batch_size: int, process_index: int, process_count: int
) -> DataSource:
    """The source of a converted data config (its `source`, checked there, picks the class)."""
    _, source_class = SOURCES[data_cfg.source].load()
    return source_class(data_cfg, global_batch_size, process_index, process_count)
