"""Byte-level text data: exact bytes, token offsets, deterministic and partitioned windows, the cache."""

import dataclasses
import os

import numpy as np
import pytest

from jrope.data import files, text_bytes
from jrope.data.text_bytes import ByteTextSource, TextDataConfig, decode_tokens, encode_text

NON_ASCII = "Café naïve – Ελληνικά, 日本語 and 🦞 lobsters.\n"


@pytest.fixture
def corpus_files(tmp_path):
    """A training and an evaluation text with non-ASCII characters, and a cache folder."""
    train = tmp_path / "train.txt"
    train.write_text("".join(f"{i:04d} {NON_ASCII}" for i in range(200)), encoding="utf-8")
    evaluation = tmp_path / "eval.txt"
    evaluation.write_text(
        "".join(f"= {i} = {NON_ASCII[::-1]}" for i in range(150)), encoding="utf-8"
    )
    return train, evaluation, tmp_path / "cache"


def _config(corpus_files, **overrides):
    train, evaluation, cache = corpus_files
    base = TextDataConfig(
        source="text",
        path=str(train),
        eval_path=str(evaluation),
        seq_len=32,
        seed=3,
        cache_dir=str(cache),
    )
    return dataclasses.replace(base, **overrides)


def test_corpus_is_the_files_bytes(corpus_files, monkeypatch):
    # 7-byte chunks cut many multi-byte characters: the UTF-8 check must carry them over.
    monkeypatch.setattr(text_bytes, "_CHUNK_BYTES", 7)
    source = ByteTextSource(_config(corpus_files), 4, 0, 1)
    train, evaluation, _ = corpus_files
    assert source.train_corpus.dtype == np.uint8
    assert source.train_corpus.tobytes() == train.read_bytes()
    assert source.eval_corpus.tobytes() == evaluation.read_bytes()


@pytest.mark.parametrize("vocab_size", [256, 257])
def test_non_ascii_round_trip(vocab_size):
    tokens = encode_text(NON_ASCII, vocab_size)
    assert tokens.dtype == np.int32
    assert len(tokens) == len(NON_ASCII.encode("utf-8")) > len(NON_ASCII)  # multi-byte characters
    assert decode_tokens(tokens, vocab_size) == NON_ASCII


@pytest.mark.parametrize("vocab_size", [256, 257])
def test_windows_are_contiguous_text(corpus_files, vocab_size):
    source = ByteTextSource(_config(corpus_files, vocab_size=vocab_size), 4, 0, 1)
    text = corpus_files[0].read_bytes()
    batch = source.train_batch(7)
    assert batch["inputs"].shape == batch["targets"].shape == batch["weights"].shape == (4, 32)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    assert batch["weights"].dtype == np.float32 and np.all(batch["weights"] == 1.0)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    for inputs, targets in zip(batch["inputs"], batch["targets"], strict=False):
        window = np.concatenate([inputs, targets[-1:]]) - (vocab_size - 256)
        assert window.astype(np.uint8).tobytes() in text


def test_vocab_257_is_byte_plus_one(corpus_files):
    batch_256 = ByteTextSource(_config(corpus_files, vocab_size=256), 4, 0, 1).train_batch(2)
    batch_257 = ByteTextSource(_config(corpus_files, vocab_size=257), 4, 0, 1).train_batch(2)
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(batch_257[key], batch_256[key] + 1)
    assert batch_256["inputs"].min() >= 0 and batch_256["inputs"].max() <= 255
    assert batch_257["inputs"].min() >= 1 and batch_257["inputs"].max() <= 256  # 0 stays reserved
    assert batch_256["inputs"].max() > 127  # the non-ASCII bytes are there


def test_same_batches_after_a_restart(corpus_files):
    first = ByteTextSource(_config(corpus_files), 4, 0, 1)
    # reads the cache written by the first
    restarted = ByteTextSource(_config(corpus_files), 4, 0, 1)
    for step in (0, 1, 250):
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(
                first.train_batch(step)[key], restarted.train_batch(step)[key]
            )
    assert not np.array_equal(first.train_batch(0)["inputs"], first.train_batch(1)["inputs"])
    other_seed = ByteTextSource(_config(corpus_files, seed=4), 4, 0, 1)
    assert not np.array_equal(first.train_batch(0)["inputs"], other_seed.train_batch(0)["inputs"])


def test_two_processes_split_the_global_batch(corpus_files):
    whole = ByteTextSource(_config(corpus_files), 8, 0, 1)
    shares = [ByteTextSource(_config(corpus_files), 8, index, 2) for index in range(2)]
    for step in (0, 9):
        parts = [share.train_batch(step) for share in shares]
        assert all(part["inputs"].shape == (4, 32) for part in parts)
        for key in ("inputs", "targets", "weights"):
            np.testing.assert_array_equal(
                np.concatenate([part[key] for part in parts]), whole.train_batch(step)[key]
            )
        rows = {row.tobytes() for part in parts for row in part["inputs"]}
        assert len(rows) == 8  # disjoint: no window drawn twice


def test_eval_windows_fixed_per_length_whatever_the_batching(corpus_files):
    source = ByteTextSource(_config(corpus_files), 4, 0, 1)
    by_two = np.concatenate([b["inputs"] for b in source.eval_batches(64, 8, 2)])
    by_eight = np.concatenate([b["inputs"] for b in source.eval_batches(64, 8, 8)])
    np.testing.assert_array_equal(by_two, by_eight)
    shares = [ByteTextSource(_config(corpus_files), 4, index, 2) for index in range(2)]
    per_process = [list(share.eval_batches(64, 8, 4)) for share in shares]
    interleaved = np.concatenate(
        [np.concatenate([p0["inputs"], p1["inputs"]]) for p0, p1 in zip(*per_process, strict=False)]
    )
    np.testing.assert_array_equal(interleaved, by_two)
    assert by_two.shape == (8, 64)
    eval_text = corpus_files[1].read_bytes()
    assert all((row - 1).astype(np.uint8).tobytes() in eval_text for row in by_two)
    longer = np.concatenate([b["inputs"] for b in source.eval_batches(128, 4, 4)])
    assert longer.shape == (4, 128)


def test_cache_written_once(corpus_files):
    cache = corpus_files[2]
    ByteTextSource(_config(corpus_files), 4, 0, 1)
    files = sorted(os.listdir(cache))
    assert len(files) == 2 and all(
        name.startswith("text-") and name.endswith(".u8") for name in files
    )
    mtimes = [os.stat(cache / name).st_mtime_ns for name in files]
    ByteTextSource(_config(corpus_files), 4, 0, 1)
    assert sorted(os.listdir(cache)) == files
    assert [os.stat(cache / name).st_mtime_ns for name in files] == mtimes
    ByteTextSource(_config(corpus_files, train_fraction=0.5), 4, 0, 1)
    assert len(os.listdir(cache)) == 3  # a different input, a different key


def test_train_fraction_keeps_the_leading_bytes(corpus_files):
    source = ByteTextSource(_config(corpus_files, train_fraction=0.25), 4, 0, 1)
    text = corpus_files[0].read_bytes()
    assert source.train_corpus.tobytes() == text[: round(0.25 * len(text))]
    # evaluation text is never cut
    assert len(source.eval_corpus) == len(corpus_files[1].read_bytes())


def test_directory_files_joined_with_newlines_in_path_order(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    (folder / "b" / "two.txt").write_text("zwei ü", encoding="utf-8")
    (folder / "a.txt").write_text("one é", encoding="utf-8")
    (folder / ".hidden").write_text("not text", encoding="utf-8")
    cfg = TextDataConfig(
        source="text",
        path=str(folder),
        eval_path=str(folder),
        seq_len=4,
        cache_dir=str(tmp_path / "cache"),
    )
    source = ByteTextSource(cfg, 2, 0, 1)
    assert source.train_corpus.tobytes() == "one é\nzwei ü".encode()


def test_bad_input_raises_clear_errors(tmp_path, corpus_files):
    for text, bad_offset in (("caf\xe9 au lait", 3), ("plain text then caf\xe9", 19)):
        latin1 = tmp_path / "latin1.txt"
        latin1.write_bytes(text.encode("latin-1"))
        with pytest.raises(ValueError, match=rf"latin1\.txt is not UTF-8.*offset {bad_offset}\)"):
            ByteTextSource(_config(corpus_files, path=str(latin1)), 4, 0, 1)
    with pytest.raises(ValueError, match="too few for windows"):
        ByteTextSource(_config(corpus_files, seq_len=100_000), 4, 0, 1)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt' holds no text \(0 bytes\); point it at"):
        ByteTextSource(_config(corpus_files, path=str(tmp_path / "empty.txt")), 4, 0, 1)
    source = ByteTextSource(_config(corpus_files), 4, 0, 1)
    with pytest.raises(ValueError, match="too few for windows"):
        next(source.eval_batches(100_000, 4, 4))
    with pytest.raises(ValueError, match="divide num_sequences"):
        next(source.eval_batches(64, 6, 4))
    with pytest.raises(ValueError, match=r"data\.path = '.*missing\.txt' does not exist"):
        ByteTextSource(_config(corpus_files, path=str(tmp_path / "missing.txt")), 4, 0, 1)
    endless = tmp_path / "endless"  # a pipe, as /dev/zero a device: read, neither would end
    os.mkfifo(endless)
    with pytest.raises(ValueError, match="endless is neither a regular file"):
        ByteTextSource(_config(corpus_files, path=str(endless)), 4, 0, 1)
    with pytest.raises(ValueError, match="multiple of process_count"):
        ByteTextSource(_config(corpus_files), 3, 0, 2)
    with pytest.raises(ValueError, match="eval_path"):
        TextDataConfig(source="text", path="train.txt")
    with pytest.raises(ValueError, match="vocab_size"):
        TextDataConfig(source="text", path="a", eval_path="b", vocab_size=258)
    with pytest.raises(ValueError, match="train_fraction"):
        TextDataConfig(source="text", path="a", eval_path="b", train_fraction=0.0)
    with pytest.raises(ValueError, match="data.source = 'wikitext3' is not one of"):
        TextDataConfig(source="wikitext3")


def test_no_partial_files_left_behind(tmp_path):
    target = tmp_path / "cache" / "x.u8"

    def failing_chunks():
        yield b"abc"
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        files.write_atomically(str(target), failing_chunks())
    assert os.listdir(tmp_path / "cache") == []
