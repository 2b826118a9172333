"""Byte-level language-modelling data from WikiText-103 or -2, any UTF-8 text, or audio tokens.

A corpus is the bytes of its text as one flat uint8 array: WikiText's rows
joined as ``wikitext_rows`` says (below), or a text file's bytes (a
directory: its files' bytes in sorted path order, joined with newlines),
written once to ``<cache_dir>/<source>-<hash>.u8`` (atomically; the hash
covers everything the bytes depend on) and memory-mapped. Audio token files
(jrope.data.audio) are memory-mapped where they lie, with no UTF-8 check.

WikiText rows (one per line of the official file, without its newline)
become bytes in one of two ways:
  'file'       joined with newlines: the official file's text.
  'reference'  as the paper's reference code builds its stream from the
               Hugging Face rows: a non-blank line keeps its newline, a blank
               one (the files' ``" "`` lines) becomes empty, and the rows are
               joined with newlines. Every non-blank line is then followed by
               an empty line and the blank lines lose their space (on
               WikiText-2 validation: 2,460 more newline bytes, 1,299 fewer
               spaces than the file).

Tokens: vocabulary 257 maps byte ``b`` to ``b + 1`` and reserves 0 (the
paper's reference); vocabulary 256 uses the byte itself.

Sampling (all host-side numpy; ``L = seq_len``):
  training   row ``r`` of the global batch of ``step`` is the window of
             ``L + 1`` bytes starting at a position drawn by a PCG64 generator
             seeded with ``(seed, 0, step, r)``; inputs = window[:-1],
             targets = window[1:], weights = 1. Each process draws only its
             share of the rows (jrope.data.source.ProcessShare).
  packing    with ``pack`` the same training windows are cut into articles: a
             segment starts at the window's first byte and at every title line
             (``" = "`` and not ``" = = "``: WikiText's level-1 headings).
             Batches then also hold 'segment_ids' and 'positions' int32 [b, T]
             (from 0 in each segment; jrope.attention.packing). Evaluation
             windows stay whole, so packed and unpacked runs are scored alike.
  evaluation sequence ``i`` at length ``T`` is the window of ``T + 1`` bytes
             of the evaluation corpus drawn with ``(eval_seed, 1, T, i)``: the
             same for every run's seed and method, batch size and process count.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import ClassVar

import numpy as np
from absl import logging
from etils import epath

from jrope.data import audio, wikitext
from jrope.data.files import is_uri, resolved, write_atomically
from jrope.data.source import DEFAULT_EVAL_SEED, EVAL_STREAM, TRAIN_STREAM, ProcessShare
from jrope.fields import PARAMETERS, RESULT, Declared, setting

SOURCES = ("wikitext103", "wikitext2", "text", "audio_tokens")
VOCAB_SIZES = (256, 257)
# How WikiText rows become bytes: the official file's text, or the reference code's stream.
WIKITEXT_ROWS = ("file", "reference")
DEFAULT_CACHE_DIR = "~/.cache/jrope/text_bytes"

# Bytes read per chunk when copying text into a cache file.
_CHUNK_BYTES = 1 << 24
# Rows fetched per call from a WikiText data source.
_CHUNK_ROWS = 4096


@dataclasses.dataclass(frozen=True)
class TextDataConfig(Declared):
    """Everything that determines the byte-level data."""

    section = "data"

    # 'wikitext103' or 'wikitext2' (the TFDS builders of jrope.data.wikitext), 'text' (UTF-8
    # text at path and eval_path) or 'audio_tokens' (jrope.data.audio's files there).
    source: str = setting("text", choices=SOURCES, defines=PARAMETERS)
    # 'text': a file or a directory of files; 'audio_tokens': train.u8 / eval.u8 or their folder.
    path: str = ""
    eval_path: str = ""
    train_split: str = "train"  # WikiText: the split to train on
    eval_split: str = setting("validation", defines=RESULT)  # WikiText: the split to evaluate on
    # Train on this leading fraction of the training rows (WikiText; 0.01 is the paper's v2
    # setting, the split's first 1% of lines) or bytes ('text', 'audio_tokens').
    train_fraction: float = setting(1.0, gt=0.0, le=1.0)
    vocab_size: int = setting(257, choices=VOCAB_SIZES, defines=PARAMETERS)
    seq_len: int = setting(1024, ge=1)  # training length L (the model sees L tokens, predicts L)
    seed: int = setting(0, le=2**32 - 1, defines=RESULT)  # follows seed, which checks its floor
    cache_dir: str = ""  # where corpus cache files go ('': DEFAULT_CACHE_DIR)
    data_dir: str = ""  # WikiText: TFDS data directory ('': TFDS's default)
    manual_dir: str = ""  # WikiText: the archive or its files ('': <data_dir>/downloads/manual)
    # How WikiText rows become bytes (WIKITEXT_ROWS; the module docstring).
    wikitext_rows: str = setting("file", choices=WIKITEXT_ROWS, defines=RESULT)
    # Cut each training window into segments at article titles (the module docstring's
    # "packing"); not for 'audio_tokens', whose tokens have no articles.
    pack: bool = False
    # Keys only some sources read: (chooser, its values that read the keys, whether setting
    # them anyway is refused) -> keys; the run's config checks them (keys_without_effect).
    KEYS_READ_ONLY_BY: ClassVar = {
        ("source", ("text", "audio_tokens"), True): ("path", "eval_path"),
        ("source", ("wikitext103", "wikitext2"), True): (
            *("train_split", "eval_split", "data_dir", "manual_dir"),
        ),
        ("source", ("wikitext103", "wikitext2", "text"), True): ("pack",),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.source in ("text", "audio_tokens") and not (self.path and self.eval_path):
            files = "training and evaluation text" if self.source == "text" else "train.u8, eval.u8"
            raise ValueError(
                f"source={self.source!r} needs both path and eval_path ({files}), got "
                f"path={self.path!r}, eval_path={self.eval_path!r}; set both, e.g. "
                "--config.data.path=train.txt --config.data.eval_path=valid.txt (audio_tokens: "
                "the folder python -m jrope.data.audio wrote)."
            )

    @property
    def token_offset(self) -> int:
        """What is added to a byte to make its token."""
        return self.vocab_size - 256


def encode_text(text: str, vocab_size: int) -> np.ndarray:
    """int32 [n] tokens of a string's UTF-8 bytes."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + (vocab_size - 256)


def decode_tokens(tokens: np.ndarray, vocab_size: int) -> str:
    """The text of byte tokens; the reserved token 0 of vocabulary 257 is dropped,
    and byte sequences that are not UTF-8 (a window cut inside a character) become U+FFFD."""
    tokens = np.asarray(tokens)
    if vocab_size == 257:
        tokens = tokens[tokens != 0]
    data = (tokens - (vocab_size - 256)).astype(np.uint8).tobytes()
    return data.decode("utf-8", errors="replace")


class ByteTextSource:
    """Byte-level LM data source: 'inputs' int32 [b, T], 'targets' the inputs shifted by one,
    'weights' ones (and with ``pack``, 'segment_ids' and 'positions')."""

    task = "language_model"
    num_classes = None  # language modelling: the loss runs over the full vocabulary

    def __init__(
        self,
        data_cfg: TextDataConfig,
        global_batch_size: int,
        process_index: int,
        process_count: int,
    ):
        self.data_cfg = data_cfg
        self.vocab_size = data_cfg.vocab_size
        self.share = ProcessShare(global_batch_size, process_index, process_count)
        self.train_corpus = load_corpus(data_cfg, training=True)
        self.eval_corpus = load_corpus(data_cfg, training=False)
        _check_long_enough(self.train_corpus, data_cfg.seq_len, describe_corpus(data_cfg, True))

    def train_batch(self, step: int) -> dict:
        """This process's rows of the global training batch of ``step``."""
        length, corpus = self.data_cfg.seq_len, self.train_corpus
        rngs = self.share.train_generators(self.data_cfg.seed, TRAIN_STREAM, step)
        starts = _window_starts(rngs, len(corpus), length)
        batch = self._make_batch(corpus, starts, length)
        if self.data_cfg.pack:
            batch.update(article_segments(corpus, starts, length))
        return batch

    def eval_batches(
        self, length: int, num_sequences: int, batch_size: int, seed: int = DEFAULT_EVAL_SEED
    ) -> Iterator[dict]:
        """This process's share of ``num_sequences`` fixed evaluation windows of ``length`` tokens
        (``batch_size``: the global evaluation batch; ``seed``: the evaluation seed)."""
        # The request is checked before the text's length.
        words, corpus = (seed, EVAL_STREAM, length), self.eval_corpus
        batches = list(self.share.eval_generators(words, length, num_sequences, batch_size, 1))
        _check_long_enough(corpus, length, describe_corpus(self.data_cfg, False))
        for rngs in batches:
            yield self._make_batch(corpus, _window_starts(rngs, len(corpus), length), length)

    def _make_batch(self, corpus: np.ndarray, starts: Sequence[int], length: int) -> dict:
        windows = np.stack([corpus[start : start + length + 1] for start in starts])
        windows = windows.astype(np.int32) + self.data_cfg.token_offset
        return {
            "inputs": windows[:, :-1],
            "targets": windows[:, 1:],
            "weights": np.ones((len(starts), length), np.float32),
        }


def _window_starts(rngs: Sequence[np.random.Generator], corpus_len: int, length: int) -> list:
    # A window of length + 1 bytes fits at starts 0 .. corpus_len - length - 1.
    return [int(rng.integers(0, corpus_len - length)) for rng in rngs]


# An article's title line: a newline, then " = " and a title (" = = " opens a section).
_TITLE_OPENING = np.frombuffer(b"\n = ", np.uint8)
_SECTION_MARK = ord("=")


def article_segments(corpus: np.ndarray, starts: Sequence[int], length: int) -> dict:
    """'segment_ids' (from 0 in each row) and 'positions' (from 0 in each segment) int32
    [b, length] of the windows at ``starts`` (the module docstring's "packing")."""
    opening = len(_TITLE_OPENING)
    starts_of_segments = np.zeros((len(starts), length), bool)
    for row, start in enumerate(starts):
        # Byte t of the window opens a title when bytes t-1 .. t+2 are "\n = " and byte t+3 is
        # no "=": read one byte before the window and the title's first bytes after it.
        front = int(start == 0)  # no byte before the corpus: a zero stands in
        text = np.asarray(corpus[start - 1 + front : start + length + opening - 1])
        text = np.pad(text, (front, length + opening - front - len(text)))
        windows = np.lib.stride_tricks.sliding_window_view(text, opening + 1)[:length]
        titles = np.all(windows[:, :opening] == _TITLE_OPENING, axis=1)
        starts_of_segments[row] = titles & (windows[:, opening] != _SECTION_MARK)
    starts_of_segments[:, 0] = True
    index = np.arange(length)
    segment_ids = np.cumsum(starts_of_segments, axis=1) - 1
    first = np.maximum.accumulate(np.where(starts_of_segments, index, 0), axis=1)
    return {
        "segment_ids": segment_ids.astype(np.int32),
        "positions": (index - first).astype(np.int32),
    }


def _check_long_enough(corpus: np.ndarray, length: int, description: str) -> None:
    if len(corpus) < length + 1:
        raise ValueError(
            f"{description} has {len(corpus)} bytes, too few for windows of {length} + 1 bytes; "
            "use more text or a shorter length."
        )


def describe_corpus(data_cfg: TextDataConfig, training: bool) -> str:
    """The config key and value a corpus comes from, for messages: "data.path = 'train.txt'"."""
    if data_cfg.source in ("text", "audio_tokens"):
        key = "path" if training else "eval_path"
        return f"data.{key} = {getattr(data_cfg, key)!r}"
    split = data_cfg.train_split if training else data_cfg.eval_split
    return f"the {split} split of data.source = {data_cfg.source!r}"


# ---- Corpus files: built once, memory-mapped after.


def load_corpus(data_cfg: TextDataConfig, *, training: bool) -> np.ndarray:
    """The training or evaluation corpus as a read-only uint8 [n] memory map."""
    cache_dir = os.path.expanduser(data_cfg.cache_dir or DEFAULT_CACHE_DIR)
    fraction = data_cfg.train_fraction if training else 1.0
    if data_cfg.source == "audio_tokens":
        # Already a byte file: mapped where it lies (a bucket's copied to the cache
        # first), its leading fraction a view.
        split = "train" if training else "eval"
        location = data_cfg.path if training else data_cfg.eval_path
        if is_uri(location):
            bucket_file = audio.token_file(location, split)
            location = _cache_path(cache_dir, "copy", {"file": _file_identity(bucket_file)})
            if not os.path.exists(location):
                logging.info("Copying %s to %s.", bucket_file, location)
                write_atomically(location, _file_chunks(bucket_file))
        tokens = audio.load_token_file(location, split)
        return tokens[: max(1, round(fraction * len(tokens)))]
    if data_cfg.source == "text":
        files = _text_files(data_cfg, training)
        key = {"files": [_file_identity(f) for f in files], "fraction": fraction}
        path = _cache_path(cache_dir, "text", key)
        if not os.path.exists(path):
            write_atomically(path, _limit_bytes(_text_file_chunks(files), fraction, files))
    else:
        split = data_cfg.train_split if training else data_cfg.eval_split
        folders = dict(data_dir=data_cfg.data_dir or None, manual_dir=data_cfg.manual_dir or None)
        rows = wikitext.wikitext_data_source(data_cfg.source, split, **folders)
        num_rows = max(1, round(fraction * len(rows)))
        builder = wikitext.BUILDERS[data_cfg.source]
        key = {"builder": f"{builder.name}:{builder.VERSION}", "split": split}
        key["rows"] = [num_rows, len(rows)]
        if data_cfg.wikitext_rows != "file":  # the file stream keeps the key of earlier caches
            key["joined"] = data_cfg.wikitext_rows
        path = _cache_path(cache_dir, data_cfg.source, key)
        if not os.path.exists(path):
            what = (num_rows, builder.ARCHIVE.title, split, path)
            logging.info("Writing the bytes of %d rows of %s %s to %s.", *what)
            write_atomically(path, _joined_rows(rows, num_rows, data_cfg.wikitext_rows))
    if os.path.getsize(path) == 0:
        raise ValueError(
            f"{describe_corpus(data_cfg, training)} holds no text (0 bytes); point it at a file "
            "with some."
        )
    return np.memmap(path, dtype=np.uint8, mode="r")


def _cache_path(cache_dir: str, source: str, key: dict) -> str:
    text = json.dumps({"source": source, **key}, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    return os.path.join(cache_dir, f"{source}-{digest[:20]}.u8")


def _text_files(data_cfg: TextDataConfig, training: bool) -> list[epath.Path]:
    """The file at data.path (or eval_path), or the regular non-hidden files under that directory
    in sorted path order. The path is local or in a bucket (``gs://...``), read through epath.
    """
    root = resolved(data_cfg.path if training else data_cfg.eval_path)
    if not root.exists():
        key = "path" if training else "eval_path"
        raise ValueError(
            f"{describe_corpus(data_cfg, training)} does not exist; point --config.data.{key} at "
            "a UTF-8 text file or a directory of them."
        )
    if _is_regular_file(root):
        return [root]
    if not root.is_dir():  # a device such as /dev/zero or a pipe would be read without end
        raise ValueError(
            f"Text path {root} is neither a regular file nor a directory; point the config at "
            "UTF-8 text."
        )
    return sorted(_files_under(root), key=str)  # none: the corpus holds no text, refused then


def _files_under(directory: epath.Path) -> Iterator[epath.Path]:
    """The non-hidden files below ``directory``, hidden folders skipped."""
    for child in directory.iterdir():
        if child.name.startswith("."):
            continue
        if child.is_dir():
            yield from _files_under(child)
        elif _is_regular_file(child):
            yield child


def _is_regular_file(path: epath.Path) -> bool:
    """A file with an end: not a device, a pipe or a socket (epath calls those files)."""
    return path.is_file() if is_uri(path) else os.path.isfile(path)


def _file_identity(path: epath.Path) -> list:
    """Name, size and modification time: what a cached copy of the file depends on."""
    if is_uri(path):
        stat = path.stat()
        return [str(path), stat.length, stat.mtime]
    stat = os.stat(path)
    return [str(path), stat.st_size, stat.st_mtime_ns]


def _file_chunks(path: epath.Path) -> Iterator[bytes]:
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            yield chunk


def _text_file_chunks(files: Sequence[epath.Path]) -> Iterator[bytes]:
    """The files' bytes joined with newlines, checked to be UTF-8 on the way."""
    for index, path in enumerate(files):
        if index:
            yield b"\n"
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        for chunk in _file_chunks(path):
            _check_utf8(decoder, chunk, str(path), offset, final=False)
            offset += len(chunk)
            yield chunk
        _check_utf8(decoder, b"", str(path), offset, final=True)


def _check_utf8(decoder, chunk: bytes, name: str, offset: int, *, final: bool) -> None:
    """Feeds ``chunk`` (which starts at byte ``offset`` of the file) to the decoder."""
    # The decoder holds back the bytes of a character cut at the last chunk's end;
    # an error's position counts from the first of them.
    pending = len(decoder.getstate()[0])
    try:
        decoder.decode(chunk, final=final)
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{name} is not UTF-8 text (bad byte at offset {offset - pending + error.start}); "
            "convert it to UTF-8 (e.g. with iconv)."
        ) from None


def _limit_bytes(chunks: Iterable[bytes], fraction: float, files: Sequence[epath.Path]):
    """The leading ``fraction`` of the bytes the chunks make up."""
    if fraction == 1.0:
        yield from chunks
        return
    sizes = [f.stat().length if is_uri(f) else os.path.getsize(f) for f in files]
    total = sum(sizes) + len(files) - 1
    remaining = max(1, round(fraction * total))
    for chunk in chunks:
        yield chunk[:remaining]
        remaining -= min(remaining, len(chunk))
        if not remaining:
            return


def _joined_rows(rows: Sequence[dict], num_rows: int, mode: str = "file") -> Iterator[bytes]:
    """Rows ``0 .. num_rows - 1`` of a WikiText data source as bytes (``mode``: WIKITEXT_ROWS)."""
    for first in range(0, num_rows, _CHUNK_ROWS):
        indices = list(range(first, min(first + _CHUNK_ROWS, num_rows)))
        texts = [row["text"] for row in rows.__getitems__(indices)]
        if mode == "reference":  # a row as the Hugging Face data set holds it
            texts = [text + b"\n" if text.strip() else b"" for text in texts]
        yield (b"\n" if first else b"") + b"\n".join(texts)
        if first and first % (100 * _CHUNK_ROWS) == 0:
            logging.info("  %d of %d rows", first, num_rows)
