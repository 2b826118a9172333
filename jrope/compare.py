"""Train and evaluate a list of methods over seeds, and tabulate them side by side.

    python -m jrope.compare --config=configs/synthetic_cpu.py \
        --methods=rope,direct_sum,jordan_rope,jordan_raw_tau,jordan_exact_scaled,rope_alibi \
        --seeds=0,1,2 --workdir=runs/synthetic_cpu

Each (method, seed) trains in `<workdir>/<method>/seed<seed>` with the same
config but `pe.name` and `seed`. The run is resumable at two levels: a
finished run (its final evaluation CSV exists) is not retrained, and an
interrupted one resumes from its latest checkpoint. The comparison is
written to `<workdir>/comparison.{csv,md,png}`: every row, then the mean and
spread (sample standard deviation) over seeds per method and length.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from jrope import huge_pages
from jrope.config_types import TrainConfig
from jrope.evaluation import CSV_COLUMNS
from jrope.trainer import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file.', lock_config=True
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Root directory of the comparison.')
_METHODS = flags.DEFINE_list('methods', None, 'Position-encoding names to compare.')
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds of every method.')


def final_results_path(run_dir: str, num_steps: int) -> str:
    """The evaluation CSV a finished run leaves behind (see jrope.trainer)."""
    return os.path.join(run_dir, f'eval_step{num_steps}', 'eval.csv')


def run_comparison(
    config, methods: Sequence[str], seeds: Sequence[int], workdir: str
) -> list[dict]:
    """Trains every (method, seed) not yet finished, then writes the comparison files."""
    rows = []
    for seed in seeds:
        for method in methods:
            config.pe.name = method
            config.seed = seed  # a FieldReference: the data seed follows
            cfg = TrainConfig.from_config_dict(config)
            run_dir = os.path.join(workdir, method, f'seed{seed}')
            results = final_results_path(run_dir, cfg.num_steps)
            if os.path.exists(results):
                logging.info('%s seed %d: finished earlier, reading %s', method, seed, results)
            else:
                logging.info('%s seed %d: training in %s', method, seed, run_dir)
                train_and_evaluate(cfg, run_dir)
            rows.extend(_read_rows(results))
    if jax.process_index() == 0:
        write_comparison(rows, workdir)
    return rows


def _read_rows(path: str) -> list[dict[str, Any]]:
    with open(path, newline='', encoding='utf-8') as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key in ('seed', 'length', 'num_sequences'):
            row[key] = int(row[key])
        for key in ('loss', 'accuracy', 'bits_per_byte'):
            row[key] = float(row[key])
    return rows


def summarize(
    rows: Sequence[dict[str, Any]], metric: str
) -> dict[str, dict[int, tuple[float, float, int]]]:
    """method -> length -> (mean, sample std over seeds, number of seeds)."""
    grouped: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        grouped.setdefault(row['method'], {}).setdefault(row['length'], []).append(row[metric])
    return {
        method: {
            length: (float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0, len(v))
            for length, v in sorted(by_length.items())
        }
        for method, by_length in grouped.items()
    }


def comparison_table(rows: Sequence[dict[str, Any]], metric: str) -> str:
    """Markdown: one line per method, 'mean ± std' per length, seeds counted."""
    summary = summarize(rows, metric)
    lengths = sorted({row['length'] for row in rows})
    lines = [
        f'{metric}: mean ± std over seeds ({rows[0]["num_sequences"]} sequences per length)',
        '',
        '| method | seeds | ' + ' | '.join(str(length) for length in lengths) + ' |',
        '|---|---|' + '---|' * len(lengths),
    ]
    for method, by_length in summary.items():
        seeds = min(n for _, _, n in by_length.values())
        cells = [_mean_and_spread(*by_length[length]) for length in lengths]
        lines.append(f'| {method} | {seeds} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines) + '\n'


def _mean_and_spread(mean: float, spread: float, num_seeds: int) -> str:
    # One seed has no spread to report; a '± 0.000' would claim one.
    return f'{mean:.3f}' if num_seeds == 1 else f'{mean:.3f} ± {spread:.3f}'


def write_comparison(rows: Sequence[dict[str, Any]], workdir: str) -> None:
    """<workdir>/comparison.csv (all rows), .md (accuracy and loss tables), .png (curves)."""
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'comparison.csv'), 'w', newline='', encoding='utf-8') as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    language_model = not np.isnan(rows[0]['bits_per_byte'])
    metrics = ('loss', 'bits_per_byte') if language_model else ('accuracy', 'loss')
    with open(os.path.join(workdir, 'comparison.md'), 'w', encoding='utf-8') as f:
        f.write('\n'.join(comparison_table(rows, metric) for metric in metrics))
    _plot(rows, metrics[0], os.path.join(workdir, 'comparison.png'))


def _plot(rows: Sequence[dict[str, Any]], metric: str, path: str) -> None:
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, by_length in summarize(rows, metric).items():
        lengths = list(by_length)
        means = [by_length[length][0] for length in lengths]
        spreads = [by_length[length][1] for length in lengths]
        ax.errorbar(lengths, means, yerr=spreads, marker='o', capsize=3, label=method)
    ax.set_xscale('log', base=2)
    ax.set_xlabel('evaluation length')
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
    if not _METHODS.value:
        raise app.UsageError('--methods is required, e.g. --methods=rope,jordan_rope')
    run_comparison(_CONFIG.value, _METHODS.value, [int(s) for s in _SEEDS.value], _WORKDIR.value)


if __name__ == '__main__':
    huge_pages.restart_with_huge_pages()
    flags.mark_flags_as_required(['config', 'workdir'])
    app.run(main)
