"""WikiText-103 and WikiText-2 (raw) as TFDS builders in ArrayRecord, read without TensorFlow.

One example per line of the official files ``wiki.{train,valid,test}.raw``,
in file order (shuffling disabled), the line's text without its newline, so
joining a split's rows with newlines gives back the file's text. The two
datasets differ only in their archive; both builders share one
implementation (``WikiTextRaw``) and are chosen by name ('wikitext103',
'wikitext2', the keys of BUILDERS):

  dataset      archive                   train      validation  test
  wikitext103  wikitext-103-raw-v1.zip   1,801,350  3,760       4,358 lines
  wikitext2    wikitext-2-raw-v1.zip     36,718     3,760       4,358 lines

Where the text comes from, first match wins:

1. the extracted files in the manual directory (``wiki.train.raw``,
   ``wiki.valid.raw``, ``wiki.test.raw``, directly there or in the
   archive's folder, ``wikitext-103-raw/`` or ``wikitext-2-raw/``);
2. the official archive in the manual directory;
3. the archive downloaded from its ``archive_url``.

The archive is checked by TFDS against the size and SHA-256 published for it
(``checksums.tsv`` beside this file), then read with ``zipfile`` (TFDS's
extractor needs TensorFlow). The manual directory defaults to
``<data_dir>/downloads/manual``, ``data_dir`` to TFDS's.

``wikitext_data_source`` prepares a dataset on first use; without the files
and a route to the archives' host it fails at once with DataUnavailable,
saying where to put the files. To prepare once, with network access:

    python -m jrope.data.wikitext --dataset=wikitext103 [--data_dir=DIR] [--manual_dir=DIR]
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import urllib.parse
import zipfile
from collections.abc import Sequence
from typing import ClassVar

import tensorflow_datasets as tfds
from etils import epath

# TFDS raises this on a checksum mismatch but does not export it under tfds.download.
from tensorflow_datasets.core.download.download_manager import NonMatchingChecksumError

from jrope.errors import DataUnavailable

ARCHIVE_HOST = "https://wikitext.smerity.com"
SPLIT_FILES = {"train": "wiki.train.raw", "validation": "wiki.valid.raw", "test": "wiki.test.raw"}

# Seconds to wait for the archives' host before declaring the network absent.
_CONNECT_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class WikiTextArchive:
    """One official raw WikiText archive: what it is called and how it is laid out."""

    title: str  # 'WikiText-103', for messages
    archive_name: str  # the zip's file name, also its name in the manual directory
    archive_folder: str  # the folder inside the zip holding the three wiki.*.raw files

    @property
    def archive_url(self) -> str:
        return f"{ARCHIVE_HOST}/{self.archive_name}"


WIKITEXT103 = WikiTextArchive("WikiText-103", "wikitext-103-raw-v1.zip", "wikitext-103-raw")
WIKITEXT2 = WikiTextArchive("WikiText-2", "wikitext-2-raw-v1.zip", "wikitext-2-raw")


class WikiTextRaw(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Raw WikiText, one example ``{'text': str}`` per line of the official files: the body of
    the builders below, each naming its ARCHIVE. Out of TFDS's registry (build them by class):
    this module run as ``__main__`` beside its imported copy would register the names twice."""

    ARCHIVE: ClassVar[WikiTextArchive]
    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "One example per line of wiki.{train,valid,test}.raw, in file order."}
    # TFDS opens the manual directory only for a builder with instructions; a missing archive is
    # named, with its URL and the folder, by prepare_wikitext's WikiTextUnavailable.
    MANUAL_DOWNLOAD_INSTRUCTIONS = "The official archive, or its wiki.*.raw files extracted."

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=f"{self.ARCHIVE.title} raw (Merity et al., 2016), one line per example.",
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            homepage="https://arxiv.org/abs/1609.07843",
            # Line order is the text: rows joined with newlines must give the file back.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        raw_dir = None
        with contextlib.suppress(AssertionError):  # TFDS's when the manual directory is empty
            raw_dir = find_extracted_files(dl_manager.manual_dir, self.ARCHIVE)
        if raw_dir is not None:
            return {
                split: self._generate_examples(raw_dir / name, None)
                for split, name in SPLIT_FILES.items()
            }
        # Taken from the manual directory if it is there, else downloaded; checksum-checked either way.
        archive = dl_manager.download(self.ARCHIVE.archive_url)
        return {
            split: self._generate_examples(archive, f"{self.ARCHIVE.archive_folder}/{name}")
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


class Wikitext103Raw(WikiTextRaw, skip_registration=True):
    """WikiText-103 raw: 103 M words of Wikipedia articles."""

    name = "wikitext103_raw"
    ARCHIVE = WIKITEXT103


class Wikitext2Raw(WikiTextRaw, skip_registration=True):
    """WikiText-2 raw: 2 M words; same validation and test articles as WikiText-103."""

    name = "wikitext2_raw"
    ARCHIVE = WIKITEXT2


# The dataset names accepted here, on the command line and as TextDataConfig.source.
BUILDERS: dict[str, type[WikiTextRaw]] = {"wikitext103": Wikitext103Raw, "wikitext2": Wikitext2Raw}


def find_extracted_files(directory: epath.PathLike, archive: WikiTextArchive) -> epath.Path | None:
    """``directory`` or the archive's folder below it, whichever holds all three ``wiki.*.raw``
    files; else None."""
    directory = epath.Path(directory)
    for candidate in (directory, directory / archive.archive_folder):
        if all((candidate / filename).is_file() for filename in SPLIT_FILES.values()):
            return candidate
    return None


def default_manual_dir(data_dir: str | None) -> epath.Path:
    """TFDS's default manual directory for a data directory (None: TFDS's default)."""
    root = epath.Path(data_dir) if data_dir else epath.Path(tfds.core.constants.DATA_DIR)
    return root.expanduser() / "downloads" / "manual"


def archive_host_reachable(url: str = ARCHIVE_HOST, timeout_s: float = _CONNECT_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the host of ``url`` opens within ``timeout_s``."""
    parsed = urllib.parse.urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _unavailable_message(
    dataset: str, manual_dir: epath.Path, data_dir: str | None, reason: str
) -> str:
    archive = BUILDERS[dataset].ARCHIVE
    prepare_command = f"python -m jrope.data.wikitext --dataset={dataset}"
    prepare_command += f" --data_dir={data_dir}" if data_dir else ""
    return (
        f"{archive.title} is not available: {reason}\n"
        f"Put the official archive {archive.archive_name} (or the files "
        f"{', '.join(SPLIT_FILES.values())} extracted from it) in\n"
        f"    {manual_dir}\n"
        f"e.g. with\n"
        f"    wget -P {manual_dir} {archive.archive_url}\n"
        f"or, where the network allows, download and prepare it once with\n"
        f"    {prepare_command}\n"
        f"then run the same command again."
    )


@contextlib.contextmanager
def _unprepared_folders_quiet():
    """Drops TFDS's warning that a dataset's folder holds no dataset_info.json: before the first
    preparation that is the normal state (where it is a problem, DataUnavailable says so)."""

    def not_that_warning(record: logging.LogRecord) -> bool:
        return "has no dataset_info.json" not in record.getMessage()

    absl_logger = logging.getLogger("absl")  # TFDS logs through absl.logging
    absl_logger.addFilter(not_that_warning)
    try:
        yield
    finally:
        absl_logger.removeFilter(not_that_warning)


def prepare_wikitext(
    dataset: str, data_dir: str | None = None, manual_dir: str | None = None
) -> WikiTextRaw:
    """The builder of ``dataset`` (a key of BUILDERS), its ArrayRecord files written if they
    were not yet. DataUnavailable without prepared data, manual files or a route to the
    archive's host, or where the archive failed to download or to match its checksum."""
    archive = BUILDERS[dataset].ARCHIVE
    builder = BUILDERS[dataset](data_dir=data_dir, file_format="array_record")
    with _unprepared_folders_quiet():
        prepared = builder.is_prepared()
    if prepared:
        return builder
    manual = epath.Path(manual_dir).expanduser() if manual_dir else default_manual_dir(data_dir)

    def unavailable(reason: str) -> DataUnavailable:
        return DataUnavailable(_unavailable_message(dataset, manual, data_dir, reason))

    has_manual_files = find_extracted_files(manual, archive) is not None
    has_manual_files = has_manual_files or (manual / archive.archive_name).is_file()
    # Checked before TFDS starts, so that an offline machine fails at once with directions.
    if not has_manual_files and not archive_host_reachable():
        host = urllib.parse.urlparse(ARCHIVE_HOST).hostname
        raise unavailable(
            f"nothing is prepared in {builder.data_dir}, "
            f"the manual directory holds no data, and {host} cannot be reached."
        )
    config = tfds.download.DownloadConfig(manual_dir=os.fspath(manual))
    try:
        builder.download_and_prepare(download_config=config, file_format="array_record")
    except NonMatchingChecksumError as error:
        raise unavailable(f"the archive is not the official one ({error}).") from None
    except (tfds.download.DownloadError, OSError) as error:
        # Failed downloads (HTTP errors, resets, timeouts) and unreadable archives.
        raise unavailable(f"preparing failed with {type(error).__name__}: {error}") from None
    return builder


def wikitext_data_source(
    dataset: str, split: str, *, data_dir: str | None = None, manual_dir: str | None = None
) -> Sequence[dict]:
    """Random-access rows ``{'text': bytes}`` of a split ('train', 'validation', 'test'), the
    dataset prepared on first use (``prepare_wikitext``)."""
    title = BUILDERS[dataset].ARCHIVE.title
    if split not in SPLIT_FILES:
        raise ValueError(f"Unknown {title} split {split!r}; choose one of {tuple(SPLIT_FILES)}.")
    return prepare_wikitext(dataset, data_dir, manual_dir).as_data_source(split=split)


def _cli() -> None:
    """``python -m jrope.data.wikitext --dataset=...``: prepare once and print the splits' sizes."""
    from absl import flags

    from jrope import command_line

    which = "Which WikiText to prepare."
    dataset = flags.DEFINE_enum("dataset", None, list(BUILDERS), which, required=True)
    data_dir = flags.DEFINE_string("data_dir", "", "TFDS data directory (empty: TFDS's default).")
    help_manual = "Archive's or extracted files' folder (empty: <data_dir>/downloads/manual)."
    manual_dir = flags.DEFINE_string("manual_dir", "", help_manual)

    def main(argv: Sequence[str]) -> None:
        builder = prepare_wikitext(dataset.value, data_dir.value or None, manual_dir.value or None)
        for split, info in builder.info.splits.items():
            print(f"{split}: {info.num_examples} rows in {builder.data_dir}")

    command_line.run(main)


if __name__ == "__main__":
    # Run the importable copy of this module: TFDS finds a builder's files
    # (checksums.tsv, data directory) through its module name, which __main__ is not.
    from jrope.data import wikitext

    wikitext._cli()
