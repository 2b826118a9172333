"""The WikiText-103 builder on fake data laid out like the official archive; the offline error; byte mode."""

import socket
import time
import zipfile

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.core.download import checksums

from jrope.data import wikitext103
from jrope.data.text_bytes import ByteTextSource, TextDataConfig

# Line structure of the real files: blank lines, headings, text with non-ASCII,
# and a stray carriage return that only a split on b"\n" keeps inside its line.
FAKE_LINES = {
    "train": [
        " ",
        " = Homarus = ",
        " ",
        " Le homard européen – 龍蝦 ; 60 cm ( 24 in ) . ",
        " a\rb ",
        " = = Size = = ",
    ],
    "validation": [" ", " = Valkyria = ", " Senjō no Valkyria 3 . "],
    "test": [" ", " = Robert Boulter = ", " Boulter is an English actor . ", " "],
}


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any connection beyond this machine fails the test; TFDS's GCS look-ups are off."""
    real_connect = socket.socket.connect

    def local_only(sock, address):
        if isinstance(address, tuple) and address[0] not in ("127.0.0.1", "localhost", "::1"):
            raise AssertionError(f"test tried to reach {address}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", local_only)
    with tfds.testing.disable_gcs_access():
        yield


def _write_raw_files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for split, filename in wikitext103.SPLIT_FILES.items():
        (folder / filename).write_bytes(
            "".join(line + "\n" for line in FAKE_LINES[split]).encode("utf-8")
        )


def _write_fake_archive(manual_dir):
    """A zip laid out like wikitext-103-raw-v1.zip: wikitext-103-raw/wiki.{train,valid,test}.raw."""
    staging = manual_dir.parent / "staging"
    _write_raw_files(staging / wikitext103.ARCHIVE_FOLDER)
    manual_dir.mkdir(parents=True)
    archive = manual_dir / wikitext103.ARCHIVE_NAME
    with zipfile.ZipFile(archive, "w") as zipped:
        for filename in wikitext103.SPLIT_FILES.values():
            zipped.write(
                staging / wikitext103.ARCHIVE_FOLDER / filename,
                f"{wikitext103.ARCHIVE_FOLDER}/{filename}",
            )
    return archive


def _rows(data_source):
    return [data_source[i]["text"].decode("utf-8") for i in range(len(data_source))]


def test_checksum_file_beside_the_builder_is_read():
    info = wikitext103.Wikitext103Raw.url_infos[wikitext103.ARCHIVE_URL]
    assert int(info.size) == 191_984_949
    assert info.filename == wikitext103.ARCHIVE_NAME
    assert len(info.checksum) == 64


def test_builds_from_an_archive_in_the_manual_dir(tmp_path, monkeypatch):
    archive = _write_fake_archive(tmp_path / "manual")
    # Register the fake archive's checksum in place of the official one, as TFDS's builder tests do.
    monkeypatch.setattr(
        wikitext103.Wikitext103Raw,
        "url_infos",
        {wikitext103.ARCHIVE_URL: checksums.compute_url_info(archive)},
    )
    builder = wikitext103.prepare_wikitext103(str(tmp_path / "data"), str(tmp_path / "manual"))
    assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
    for split, lines in FAKE_LINES.items():
        assert builder.info.splits[split].num_examples == len(lines)
        assert _rows(builder.as_data_source(split=split)) == lines  # file order, newlines removed
    assert list((tmp_path / "data" / "wikitext103_raw" / "1.0.0").glob("*.array_record-*"))


def test_rejects_an_archive_that_is_not_the_official_one(tmp_path):
    _write_fake_archive(tmp_path / "manual")
    with pytest.raises(wikitext103.WikiText103Unavailable, match="not the official one"):
        wikitext103.prepare_wikitext103(str(tmp_path / "data"), str(tmp_path / "manual"))


@pytest.mark.parametrize("subfolder", ["", wikitext103.ARCHIVE_FOLDER])
def test_builds_from_extracted_files(tmp_path, subfolder):
    _write_raw_files(tmp_path / "manual" / subfolder)
    rows = wikitext103.wikitext103_data_source(
        "test", data_dir=str(tmp_path / "data"), manual_dir=str(tmp_path / "manual")
    )
    assert _rows(rows) == FAKE_LINES["test"]


def test_offline_without_data_fails_at_once_with_directions(tmp_path, monkeypatch):
    monkeypatch.setattr(wikitext103, "archive_host_reachable", lambda: False)
    manual = tmp_path / "manual"
    started = time.perf_counter()
    with pytest.raises(wikitext103.WikiText103Unavailable) as raised:
        wikitext103.wikitext103_data_source(
            "train", data_dir=str(tmp_path / "data"), manual_dir=str(manual)
        )
    assert time.perf_counter() - started < 5.0
    message = str(raised.value)
    assert str(manual) in message
    assert wikitext103.ARCHIVE_NAME in message and "wiki.train.raw" in message
    assert f"wget -P {manual} {wikitext103.ARCHIVE_URL}" in message
    assert "python -m jrope.data.wikitext103" in message
    assert not (tmp_path / "data" / "wikitext103_raw" / "1.0.0").exists()


def test_default_manual_dir_follows_tfds_convention(tmp_path):
    assert wikitext103.default_manual_dir(str(tmp_path)) == tmp_path / "downloads" / "manual"


def test_archive_host_reachable_on_a_local_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert wikitext103.archive_host_reachable(f"http://127.0.0.1:{port}/x.zip", timeout_s=2.0)
    assert not wikitext103.archive_host_reachable(f"http://127.0.0.1:{port}/x.zip", timeout_s=2.0)


def test_unknown_split_is_a_value_error():
    with pytest.raises(ValueError, match="choose one of"):
        wikitext103.wikitext103_data_source("valid")


def test_byte_source_reads_the_builder(tmp_path):
    _write_raw_files(tmp_path / "manual")
    cfg = TextDataConfig(
        source="wikitext103",
        train_fraction=0.5,
        vocab_size=257,
        seq_len=8,
        seed=0,
        cache_dir=str(tmp_path / "cache"),
        data_dir=str(tmp_path / "data"),
        manual_dir=str(tmp_path / "manual"),
    )
    source = ByteTextSource(cfg, 2, 0, 1)
    # Half of the 6 training rows, joined with newlines; evaluation is the whole validation split.
    assert source.train_corpus.tobytes() == "\n".join(FAKE_LINES["train"][:3]).encode("utf-8")
    assert source.eval_corpus.tobytes() == "\n".join(FAKE_LINES["validation"]).encode("utf-8")
    full = ByteTextSource(TextDataConfig(**{**cfg.__dict__, "train_fraction": 1.0}), 2, 0, 1)
    assert full.train_corpus.tobytes().decode("utf-8") == "\n".join(FAKE_LINES["train"])
    batch = full.train_batch(0)
    assert batch["inputs"].shape == (2, 8) and np.all(batch["inputs"] >= 1)
