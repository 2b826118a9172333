"""Result files, written whole: CSV, markdown tables and PNG plots, local or on a bucket. The
one module that the harness (jrope.train) and the experiments (jrope.experiments) both write
their tables and figures through; it imports neither."""

from __future__ import annotations

import csv
import importlib
import io
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath

from jrope.data.files import is_uri


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


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    importlib.import_module("matplotlib").use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def save_figure(fig, path: epath.PathLike, *, dpi: int = 120) -> None:
    """A matplotlib figure as a PNG file at `path`; the figure is closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    pyplot().close(fig)
    write_text(path, buffer.getvalue())


# A curve against evaluation length: (lengths, values, spreads as error bars or None).
Curve = tuple[Sequence[int], Sequence[float], Sequence[float] | None]


def plot_against_length(
    path: epath.PathLike, curves: Mapping[str, Curve], *, ylabel: str, size=(6, 4)
) -> None:
    """One curve per label against evaluation length, on a log2 axis."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=size)
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


def write_folder_atomically(
    out_dir: epath.PathLike, write: Callable[[epath.Path], None], names: Sequence[str]
) -> None:
    """`write(folder)` writes the files `names` into a temporary sibling folder, then each is moved
    into `out_dir` in that order (the last one marks a whole result): a local folder never holds a
    part of them. On an object store (no rename) `write` writes into `out_dir` itself."""
    out_dir = epath.Path(out_dir)
    if is_uri(out_dir):
        write(out_dir)
        return
    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    try:
        write(staging)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            os.replace(staging / name, out_dir / name)
    except OSError as error:  # a full disk: the message names the results' folder
        raise OSError(error.errno, error.strerror or str(error), str(out_dir)) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
