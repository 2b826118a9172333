"""Result files written whole (CSV, markdown, PNG; local or on a bucket) and JSON-lines logs read
tolerantly: what the harness and the experiments both write through; it imports neither."""

from __future__ import annotations

import csv
import importlib
import io
import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from jrope.data.files import BucketObject, is_uri, write_atomically


def write_csv(path: epath.PathLike, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]):
    """Rows (dicts holding `columns`) as a CSV file with a header line."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, buffer.getvalue())


def read_csv(path: epath.PathLike) -> list[dict[str, str]]:
    """The rows of a CSV file written by write_csv, as dicts of strings."""
    return list(csv.DictReader(io.StringIO(epath.Path(path).read_text())))


def write_text(path: epath.PathLike, text: str | bytes) -> None:
    """`text` (str, or bytes) as the whole file at `path` (parent folders created)."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def format_cell(value: Any) -> str:
    """Floats with 4 decimals, anything else as str."""
    return f"{value:.4f}" if isinstance(value, (float, np.floating)) else str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def new_figure(size: tuple[float, float]):
    """A matplotlib Figure of `size` inches, made outside pyplot: no display, no global figure
    list to close, and no pyplot import (a third of matplotlib's import time)."""
    return importlib.import_module("matplotlib.figure").Figure(figsize=size)


def save_figure(fig, path: epath.PathLike, *, dpi: int = 120) -> None:
    """A matplotlib figure as a PNG file at `path` (matplotlib's Agg renderer)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    write_text(path, buffer.getvalue())


# A curve against evaluation length: (lengths, values, spreads as error bars or None).
Curve = tuple[Sequence[int], Sequence[float], Sequence[float] | None]


def plot_against_length(path, curves: Mapping[str, Curve], *, ylabel: str, size=(6, 4)) -> None:
    """One curve per label against evaluation length, on a log2 axis."""
    fig = new_figure(size)
    ax = fig.subplots()
    all_lengths = sorted({length for lengths, _, _ in curves.values() for length in lengths})
    for label, (lengths, values, spreads) in curves.items():
        ax.errorbar(lengths, values, yerr=spreads, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_lengths, [str(length) for length in all_lengths])
    ax.set(xlabel="evaluation length", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def write_folder_atomically(out_dir: epath.PathLike, write: Callable, names: Sequence[str]) -> None:
    """`write(folder)` writes the files `names` into a temporary sibling folder, then each is moved
    into `out_dir` in that order (the last one marks a whole result): a local folder never holds a
    part of them. On an object store (no rename) `write` writes into `out_dir` itself."""
    out_dir = epath.Path(out_dir)
    if is_uri(out_dir):
        write(out_dir)
        return
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.", dir=out_dir.parent) as staging:
        write(epath.Path(staging))
        out_dir.mkdir(exist_ok=True)
        for name in names:
            os.replace(os.path.join(staging, name), out_dir / name)


def split_json_lines(data: bytes) -> tuple[list[str], bytes]:
    """(the records: lines of UTF-8 and one JSON object each, with their newline; the bytes of
    every other line) of a JSON-lines log's contents."""
    records, damaged = [], []
    pieces = data.split(b"\n")  # not bytes.splitlines, which also splits at \r, \f, ...
    for raw in [piece + b"\n" for piece in pieces[:-1]] + [pieces[-1]]:
        try:
            text = raw.decode("utf-8")
            whole = isinstance(json.loads(text), dict)
        except (UnicodeDecodeError, ValueError):
            whole = False
        if whole:
            records.append(text if text.endswith("\n") else text + "\n")
        elif raw.strip():
            damaged.append(raw if raw.endswith(b"\n") else raw + b"\n")
    return records, b"".join(damaged)


class JsonLinesLog:
    """A log of one line per record at `path`, continued; `keep` chooses which records already
    there stay (None: all). Damaged lines are set aside in `<path>.damaged`, said once: every line
    of the log parses, and a line cut short never fuses with the next record."""

    def __init__(self, path: epath.PathLike, keep: Callable[[str], bool] | None = None):
        self._path = epath.Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)
        history = self._path.read_bytes() if self._path.exists() else b""
        records, damaged = split_json_lines(history)
        if damaged:  # appended to the side file before the log is rewritten without them
            side = self._path.parent / (self._path.name + ".damaged")
            side.write_bytes((side.read_bytes() if side.exists() else b"") + damaged)
            lines = damaged.count(b"\n")
            print(f"{self._path}: {lines} damaged line(s) set aside in {side}.", flush=True)
        kept = "".join(line for line in records if keep is None or keep(line)).encode()
        if is_uri(self._path):  # uploaded an interval after the first line, not line by line
            self._file = BucketObject(self._path, kept, uploaded_at=time.monotonic())
            return
        if kept != history:
            write_atomically(str(self._path), [kept])
        self._file = self._path.open("ab")

    def write(self, line: str) -> None:
        """Appends `line` (no newline) to the log."""
        self._file.write(f"{line}\n".encode())
        self._file.flush()

    def flush(self) -> None:
        """Everything written so far is in the file (a local file is flushed at every line)."""
        if isinstance(self._file, BucketObject):
            self._file.upload()

    def close(self) -> None:
        self.flush()
        self._file.close()
