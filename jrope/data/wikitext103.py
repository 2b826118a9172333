"""WikiText-103 (raw) as a TFDS builder stored in ArrayRecord, read without TensorFlow.

One example per line of the official files ``wiki.{train,valid,test}.raw``,
in file order (shuffling disabled), the line's text without its newline, so
joining a split's rows with newlines gives back the file's text. Splits:
'train' (1,801,350 lines), 'validation' (3,760), 'test' (4,358).

Where the text comes from, first match wins:

1. the extracted files in the manual directory (``wiki.train.raw``,
   ``wiki.valid.raw``, ``wiki.test.raw``, directly there or in a
   ``wikitext-103-raw/`` subfolder);
2. the official archive ``wikitext-103-raw-v1.zip`` in the manual directory;
3. the archive downloaded from ARCHIVE_URL.

The archive, manual or downloaded, is checked by TFDS against the size and
SHA-256 in ``checksums.tsv`` beside this file (the values published for the
official archive), then read member by member with ``zipfile``: TFDS's own
extractor needs TensorFlow. The manual directory defaults
to ``<data_dir>/downloads/manual`` (TFDS's convention), ``data_dir`` to
TFDS's (``~/tensorflow_datasets``).

``wikitext103_data_source`` prepares the dataset on first use and returns a
split's random-access data source; without the files and without a route to
the archive's host it fails at once with WikiText103Unavailable, saying where
to put the files. To prepare once, on a machine with network access:

    python -m jrope.data.wikitext103 [--data_dir=DIR] [--manual_dir=DIR]
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.parse
import zipfile
from collections.abc import Sequence

import tensorflow_datasets as tfds
from etils import epath

# TFDS raises this on a checksum mismatch but does not export it under tfds.download.
from tensorflow_datasets.core.download.download_manager import NonMatchingChecksumError

ARCHIVE_URL = "https://wikitext.smerity.com/wikitext-103-raw-v1.zip"
ARCHIVE_NAME = "wikitext-103-raw-v1.zip"
ARCHIVE_FOLDER = "wikitext-103-raw"
SPLIT_FILES = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}

# Seconds to wait for the archive's host before declaring the network absent.
_CONNECT_TIMEOUT_S = 5.0


class WikiText103Unavailable(FileNotFoundError):
    """WikiText-103 is neither prepared, nor on disk, nor downloadable from here."""


class Wikitext103Raw(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """WikiText-103 raw text, one example ``{'text': str}`` per line of the official files.

    Kept out of TFDS's global registry (build it with this class, not
    ``tfds.builder``): running this module as ``__main__`` next to its
    imported copy would otherwise register the name twice.
    """

    name = "wikitext103_raw"
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "One example per line of wiki.{train,valid,test}.raw, in file order."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = f"""
    Put the official archive {ARCHIVE_NAME} (from {ARCHIVE_URL}), or the
    three files {', '.join(SPLIT_FILES.values())} extracted from it, in the
    manual directory.
    """

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description="WikiText-103 raw (Merity et al., 2016), one line per example.",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            homepage="https://arxiv.org/abs/1609.07843",
            # Line order is the text: rows joined with newlines must give the file back.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        raw_dir = None
        try:
            raw_dir = find_extracted_files(dl_manager.manual_dir)
        except AssertionError:
            # TFDS asserts when the manual directory is absent or empty: no manual files.
            pass
        if raw_dir is not None:
            return {
                split: self._generate_examples(raw_dir / name, None)
                for split, name in SPLIT_FILES.items()
            }
        # Taken from the manual directory if it is there, else downloaded; checksum-checked either way.
        archive = dl_manager.download(ARCHIVE_URL)
        return {
            split: self._generate_examples(archive, f"{ARCHIVE_FOLDER}/{name}")
            for split, name in SPLIT_FILES.items()
        }

    def _generate_examples(self, path: epath.Path, member: str | None):
        """Lines of a raw file, or of the archive's ``member`` (read from the zip,
        not extracted: TFDS's extractor needs TensorFlow)."""
        with path.open("rb") as raw, zipfile.ZipFile(raw).open(member) if member else raw as lines:
            # Binary lines split on b"\n" only: text-mode reading would also split
            # on, and rewrite, any carriage return, and the bytes must stay the file's.
            for index, line in enumerate(lines):
                if line.endswith(b"\n"):
                    line = line[:-1]
                yield index, {"text": line.decode("utf-8")}


def find_extracted_files(directory: epath.PathLike) -> epath.Path | None:
    """The folder under ``directory`` holding all three ``wiki.*.raw`` files, or None."""
    directory = epath.Path(directory)
    for candidate in (directory, directory / ARCHIVE_FOLDER):
        if all((candidate / filename).is_file() for filename in SPLIT_FILES.values()):
            return candidate
    return None


def default_manual_dir(data_dir: str | None) -> epath.Path:
    """TFDS's default manual directory for a data directory (None: TFDS's default)."""
    root = epath.Path(data_dir) if data_dir else epath.Path(tfds.core.constants.DATA_DIR)
    return root.expanduser() / "downloads" / "manual"


def archive_host_reachable(url: str = ARCHIVE_URL, timeout_s: float = _CONNECT_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the archive's host opens within ``timeout_s``."""
    parsed = urllib.parse.urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _unavailable_message(manual_dir: epath.Path, data_dir: str | None, reason: str) -> str:
    prepare_command = "python -m jrope.data.wikitext103" + (
        f" --data_dir={data_dir}" if data_dir else ""
    )
    return (
        f"WikiText-103 is not available: {reason}\n"
        f"Put the official archive {ARCHIVE_NAME} (or the files "
        f"{', '.join(SPLIT_FILES.values())} extracted from it) in\n"
        f"    {manual_dir}\n"
        f"e.g. with\n"
        f"    wget -P {manual_dir} {ARCHIVE_URL}\n"
        f"or, where the network allows, download and prepare it once with\n"
        f"    {prepare_command}\n"
        f"then run the same command again."
    )


def prepare_wikitext103(
    data_dir: str | None = None, manual_dir: str | None = None
) -> Wikitext103Raw:
    """The builder, with its ArrayRecord files written if they were not yet.

    Raises:
      WikiText103Unavailable: no prepared data, no manual files and no route
        to the archive's host; or the archive failed to download or does not
        match the recorded checksum.
    """
    builder = Wikitext103Raw(data_dir=data_dir, file_format="array_record")
    if builder.is_prepared():
        return builder
    manual = epath.Path(manual_dir).expanduser() if manual_dir else default_manual_dir(data_dir)
    has_manual_files = find_extracted_files(manual) is not None or (manual / ARCHIVE_NAME).is_file()
    # Checked before TFDS starts, so that an offline machine fails at once with directions.
    if not has_manual_files and not archive_host_reachable():
        host = urllib.parse.urlparse(ARCHIVE_URL).hostname
        raise WikiText103Unavailable(
            _unavailable_message(
                manual,
                data_dir,
                f"nothing is prepared in {builder.data_dir}, "
                f"the manual directory holds no data, and {host} cannot be reached.",
            )
        )
    config = tfds.download.DownloadConfig(manual_dir=os.fspath(manual))
    try:
        builder.download_and_prepare(download_config=config, file_format="array_record")
    except NonMatchingChecksumError as error:
        raise WikiText103Unavailable(
            _unavailable_message(
                manual, data_dir, f"the archive is not the official one ({error})."
            )
        ) from None
    except (tfds.download.DownloadError, OSError) as error:
        # Failed downloads (HTTP errors, resets, timeouts) and unreadable archives.
        raise WikiText103Unavailable(
            _unavailable_message(
                manual, data_dir, f"preparing failed with {type(error).__name__}: {error}"
            )
        ) from None
    return builder


def wikitext103_data_source(
    split: str, *, data_dir: str | None = None, manual_dir: str | None = None
) -> Sequence[dict]:
    """Random-access rows ``{'text': bytes}`` of a split ('train', 'validation', 'test').

    Prepares the dataset on first use (see ``prepare_wikitext103``).
    """
    if split not in SPLIT_FILES:
        raise ValueError(
            f"Unknown WikiText-103 split {split!r}; choose one of {tuple(SPLIT_FILES)}."
        )
    return prepare_wikitext103(data_dir, manual_dir).as_data_source(split=split)


def _cli() -> None:
    """``python -m jrope.data.wikitext103``: prepare once and print the splits' sizes."""
    from absl import app, flags

    data_dir = flags.DEFINE_string("data_dir", "", "TFDS data directory (empty: TFDS's default).")
    manual_dir = flags.DEFINE_string(
        "manual_dir",
        "",
        "Folder with the archive or the extracted files (empty: <data_dir>/downloads/manual).",
    )

    def main(argv: Sequence[str]) -> None:
        del argv
        try:
            builder = prepare_wikitext103(data_dir.value or None, manual_dir.value or None)
        except WikiText103Unavailable as error:
            sys.exit(str(error))  # the message is the whole story: no traceback
        for split, info in builder.info.splits.items():
            print(f"{split}: {info.num_examples} rows in {builder.data_dir}")

    app.run(main)


if __name__ == "__main__":
    # Run the importable copy of this module: TFDS finds a builder's files
    # (checksums.tsv, data directory) through its module name, which __main__ is not.
    from jrope.data import wikitext103

    wikitext103._cli()
