"""Result files: CSV rows, markdown tables and PNG plots, written through `etils.epath`.

Every writer renders in memory and writes the whole file in one call through
the path object, so a result lands whole on a local disk or an object store
(`gs://...`) alike. The evaluation, the method x seed comparison and the
kernel probes all write through here.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from etils import epath


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


def write_text(path: epath.PathLike, text: str) -> None:
    """`text` as the whole file at `path` (parent folders created)."""
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def format_cell(value: Any, digits: int = 4) -> str:
    """Floats with `digits` decimals, anything else as str."""
    return f"{value:.{digits}f}" if isinstance(value, (float, np.floating)) else str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table of already formatted cells."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: epath.PathLike, *, dpi: int = 120) -> None:
    """A matplotlib figure as a PNG file at `path`; the figure is closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    pyplot().close(fig)
    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())


def plot_against_length(
    path: epath.PathLike,
    curves: Mapping[str, tuple[Sequence[int], Sequence[float], Sequence[float] | None]],
    *,
    ylabel: str,
    size: tuple[float, float] = (6, 4),
) -> None:
    """One curve per label: values (with error bars when spreads are given) against evaluation length.

    curves: label -> (lengths, values, spreads or None). The length axis is log2.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=size)
    all_lengths = sorted({length for lengths, _, _ in curves.values() for length in lengths})
    for label, (lengths, values, spreads) in curves.items():
        ax.errorbar(lengths, values, yerr=spreads, marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(all_lengths, [str(length) for length in all_lengths])
    ax.set_xlabel("evaluation length")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
