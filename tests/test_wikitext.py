"""The WikiText-103 and WikiText-2 builders on fake data laid out like the official archives;
the offline and checksum errors; byte mode."""

import socket
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest
import tensorflow_datasets as tfds
from tensorflow_datasets.core.download import checksums

from jrope.data import wikitext
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

both_datasets = pytest.mark.parametrize("dataset", ["wikitext103", "wikitext2"])


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


def _write_raw_files(folder, lines=FAKE_LINES):
    folder.mkdir(parents=True, exist_ok=True)
    for split, filename in wikitext.SPLIT_FILES.items():
        (folder / filename).write_bytes(
            "".join(line + "\n" for line in lines[split]).encode("utf-8")
        )


def _write_fake_archive(manual_dir, dataset, lines=FAKE_LINES):
    """A zip laid out like the official one, e.g. wikitext-2-raw/wiki.{train,valid,test}.raw."""
    archive = wikitext.BUILDERS[dataset].ARCHIVE
    staging = manual_dir.parent / f"staging-{dataset}"
    _write_raw_files(staging / archive.archive_folder, lines)
    manual_dir.mkdir(parents=True, exist_ok=True)
    path = manual_dir / archive.archive_name
    with zipfile.ZipFile(path, "w") as zipped:
        for filename in wikitext.SPLIT_FILES.values():
            zipped.write(
                staging / archive.archive_folder / filename,
                f"{archive.archive_folder}/{filename}",
            )
    return path


def _accept_fake_archive(monkeypatch, dataset, path):
    """Registers the fake archive's checksum in place of the official one (as TFDS's tests do)."""
    builder_cls = wikitext.BUILDERS[dataset]
    monkeypatch.setattr(
        builder_cls,
        "url_infos",
        {builder_cls.ARCHIVE.archive_url: checksums.compute_url_info(path)},
    )


def _rows(data_source):
    return [data_source[i]["text"].decode("utf-8") for i in range(len(data_source))]


def test_checksum_file_beside_the_builders_is_read():
    info = wikitext.Wikitext103Raw.url_infos[wikitext.WIKITEXT103.archive_url]
    assert int(info.size) == 191_984_949
    assert info.filename == wikitext.WIKITEXT103.archive_name
    assert len(info.checksum) == 64
    info = wikitext.Wikitext2Raw.url_infos[wikitext.WIKITEXT2.archive_url]
    assert wikitext.WIKITEXT2.archive_url == "https://wikitext.smerity.com/wikitext-2-raw-v1.zip"
    assert int(info.size) == 4_721_645
    assert info.checksum == "ef7edb566e3e2b2d31b29c1fdb0c89a4cc683597484c3dc2517919c615435a11"
    assert info.filename == "wikitext-2-raw-v1.zip"


@both_datasets
def test_builds_from_an_archive_in_the_manual_dir(tmp_path, monkeypatch, dataset):
    archive = _write_fake_archive(tmp_path / "manual", dataset)
    _accept_fake_archive(monkeypatch, dataset, archive)
    builder = wikitext.prepare_wikitext(dataset, str(tmp_path / "data"), str(tmp_path / "manual"))
    assert isinstance(builder, wikitext.BUILDERS[dataset])
    assert builder.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
    for split, lines in FAKE_LINES.items():
        assert builder.info.splits[split].num_examples == len(lines)
        assert _rows(builder.as_data_source(split=split)) == lines  # file order, newlines removed
    name = wikitext.BUILDERS[dataset].name
    assert list((tmp_path / "data" / name / "1.0.0").glob("*.array_record-*"))


def test_each_builder_reads_its_own_archive(tmp_path, monkeypatch):
    # Both archives in one manual directory, with different text: neither builder takes the other's.
    other_lines = {
        split: [f" {line} (WikiText-2) " for line in lines] for split, lines in FAKE_LINES.items()
    }
    for dataset, lines in (("wikitext103", FAKE_LINES), ("wikitext2", other_lines)):
        _accept_fake_archive(
            monkeypatch, dataset, _write_fake_archive(tmp_path / "manual", dataset, lines)
        )
    for dataset, lines in (("wikitext103", FAKE_LINES), ("wikitext2", other_lines)):
        rows = wikitext.wikitext_data_source(
            dataset, "train", data_dir=str(tmp_path / "data"), manual_dir=str(tmp_path / "manual")
        )
        assert _rows(rows) == lines["train"]
    for name in ("wikitext103_raw", "wikitext2_raw"):
        assert list((tmp_path / "data" / name / "1.0.0").glob("*.array_record-*"))


@both_datasets
def test_rejects_an_archive_that_is_not_the_official_one(tmp_path, dataset):
    _write_fake_archive(tmp_path / "manual", dataset)
    manual = tmp_path / "manual"
    with pytest.raises(wikitext.DataUnavailable, match="not the official one") as raised:
        wikitext.prepare_wikitext(dataset, str(tmp_path / "data"), str(manual))
    message = str(raised.value)
    archive = wikitext.BUILDERS[dataset].ARCHIVE
    assert message.startswith(f"{archive.title} is not available")
    assert str(manual) in message and archive.archive_url in message


@both_datasets
@pytest.mark.parametrize("in_archive_folder", [False, True])
def test_builds_from_extracted_files(tmp_path, dataset, in_archive_folder):
    subfolder = wikitext.BUILDERS[dataset].ARCHIVE.archive_folder if in_archive_folder else ""
    _write_raw_files(tmp_path / "manual" / subfolder)
    rows = wikitext.wikitext_data_source(
        dataset, "test", data_dir=str(tmp_path / "data"), manual_dir=str(tmp_path / "manual")
    )
    assert _rows(rows) == FAKE_LINES["test"]


@both_datasets
def test_offline_without_data_fails_at_once_with_directions(tmp_path, monkeypatch, caplog, dataset):
    monkeypatch.setattr(wikitext, "archive_host_reachable", lambda: False)
    archive = wikitext.BUILDERS[dataset].ARCHIVE
    manual = tmp_path / "manual"
    started = time.perf_counter()
    with pytest.raises(wikitext.DataUnavailable) as raised:
        wikitext.wikitext_data_source(
            dataset, "train", data_dir=str(tmp_path / "data"), manual_dir=str(manual)
        )
    assert time.perf_counter() - started < 5.0
    message = str(raised.value)
    assert str(manual) in message
    assert archive.archive_name in message and "wiki.train.raw" in message
    assert f"wget -P {manual} {archive.archive_url}" in message
    assert f"python -m jrope.data.wikitext --dataset={dataset}" in message
    assert not (tmp_path / "data" / wikitext.BUILDERS[dataset].name / "1.0.0").exists()
    # The message alone: not TFDS's warning that nothing is prepared yet.
    assert not [r for r in caplog.records if "dataset_info.json" in r.getMessage()]


@pytest.mark.slow
def test_prepare_command_offline_prints_the_directions_and_exits_with_the_data_status(tmp_path):
    # The command as `python -m jrope.data.wikitext` runs it, with the archive's host unreachable.
    code = (
        "from jrope.data import wikitext\n"
        "wikitext.archive_host_reachable = lambda: False\n"
        "wikitext._cli()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "--dataset=wikitext2", f"--data_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3, result.stderr
    assert result.stderr.startswith("WikiText-2 is not available"), result.stderr
    assert "Traceback" not in result.stderr


def test_default_manual_dir_follows_tfds_convention(tmp_path):
    assert wikitext.default_manual_dir(str(tmp_path)) == tmp_path / "downloads" / "manual"


def test_archive_host_reachable_on_a_local_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert wikitext.archive_host_reachable(f"http://127.0.0.1:{port}/x.zip", timeout_s=2.0)
    assert not wikitext.archive_host_reachable(f"http://127.0.0.1:{port}/x.zip", timeout_s=2.0)


def test_unknown_split_or_dataset_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        wikitext.wikitext_data_source("wikitext103", "valid")
    with pytest.raises(KeyError, match="wikitext3"):
        wikitext.wikitext_data_source("wikitext3", "train")


@both_datasets
def test_byte_source_reads_the_builder(tmp_path, dataset):
    _write_raw_files(tmp_path / "manual")
    cfg = TextDataConfig(
        source=dataset,
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
    # The cache files are named by the source, and the builder is in their key.
    assert {p.name.split("-")[0] for p in (tmp_path / "cache").iterdir()} == {dataset}


def test_reference_rows_build_the_reference_codes_stream(tmp_path):
    """'reference': non-blank rows keep a newline, blank rows are empty, all joined by newlines."""
    _write_raw_files(tmp_path / "manual")
    common = dict(
        source="wikitext2",
        vocab_size=257,
        seq_len=4,
        cache_dir=str(tmp_path / "cache"),
        data_dir=str(tmp_path / "data"),
        manual_dir=str(tmp_path / "manual"),
    )
    file_stream = ByteTextSource(TextDataConfig(**common), 2, 0, 1)
    reference = ByteTextSource(TextDataConfig(**common, wikitext_rows="reference"), 2, 0, 1)
    hf_rows = ["" if not line.strip() else line + "\n" for line in FAKE_LINES["validation"]]
    assert reference.eval_corpus.tobytes().decode("utf-8") == "\n".join(hf_rows)
    assert (
        reference.eval_corpus.tobytes() == b"\n = Valkyria = \n\n Senj\xc5\x8d no Valkyria 3 . \n"
    )
    # Each stream has its own cache file, so switching never reads the other's bytes.
    assert file_stream.eval_corpus.tobytes() == "\n".join(FAKE_LINES["validation"]).encode()
    assert len(list((tmp_path / "cache").iterdir())) == 4
    with pytest.raises(ValueError, match="data.wikitext_rows = 'hf' is not one of"):
        TextDataConfig(**common, wikitext_rows="hf")
