"""Train and evaluate a list of methods over seeds, and tabulate them side by side.

    python -m jrope.compare --config=configs/synthetic_cpu.py \
        --methods=rope,direct_sum,jordan_rope,jordan_raw_tau,jordan_exact_scaled,rope_alibi \
        --seeds=0,1,2 --workdir=runs/synthetic_cpu

Each (method, seed) trains in `<workdir>/<method>/seed<seed>` with the same
config but `pe.name` and `seed`. The run is resumable at two levels: a
finished run (its final evaluation CSV exists) is not retrained, and an
interrupted one resumes from its latest checkpoint. The comparison is
written to `<workdir>/comparison.{csv,md,png}`: every row, then the mean and
spread (sample standard deviation) over seeds per method and length, and,
for a task evaluated at chosen distances (key-value retrieval), per method,
length and distance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import app, flags, logging
from etils import epath
from ml_collections import config_flags

from jrope.train import huge_pages, reporting
from jrope.train.config import TrainConfig
from jrope.train.evaluation import CSV_COLUMNS, TASK_COLUMNS
from jrope.train.trainer import train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Experiment config file.', lock_config=True
)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Root directory of the comparison.')
_METHODS = flags.DEFINE_list('methods', None, 'Position-encoding names to compare.')
_SEEDS = flags.DEFINE_list('seeds', ['0', '1', '2'], 'Seeds of every method.')


def final_results_path(run_dir: epath.PathLike, num_steps: int) -> epath.Path:
    """The evaluation CSV a finished run leaves behind (see jrope.train.trainer)."""
    return epath.Path(run_dir) / f'eval_step{num_steps}' / 'eval.csv'


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
            run_dir = epath.Path(workdir) / method / f'seed{seed}'
            results = final_results_path(run_dir, cfg.num_steps)
            if results.exists():
                logging.info('%s seed %d: finished earlier, reading %s', method, seed, results)
            else:
                logging.info('%s seed %d: training in %s', method, seed, run_dir)
                train_and_evaluate(cfg, str(run_dir))
            rows.extend(_read_rows(results))
    if jax.process_index() == 0:
        write_comparison(rows, workdir)
    return rows


def _read_rows(path: epath.Path) -> list[dict[str, Any]]:
    rows = reporting.read_csv(path)
    for row in rows:
        for key in ('seed', 'length', 'num_sequences'):
            row[key] = int(row[key])
        # Results written before distances and R^2 were reported lack those columns.
        row['distance'] = int(row['distance']) if row.get('distance') else None
        for key in ('loss', 'accuracy', 'bits_per_byte', 'r2'):
            row[key] = float(row.get(key, 'nan'))
    return rows


def task_of(rows: Sequence[dict[str, Any]]) -> str:
    """The task the rows come from (jrope.data.source.TASKS), read off which metrics are set."""
    if not np.isnan(rows[0]['bits_per_byte']):
        return 'language_model'
    return 'regression' if not np.isnan(rows[0]['r2']) else 'classification'


def summarize(
    rows: Sequence[dict[str, Any]], metric: str, distance: int | None = None
) -> dict[str, dict[int, tuple[float, float, int]]]:
    """method -> length -> (mean, sample std over seeds, number of seeds), of the rows at `distance`
    (None: the rows over the source's own evaluation sequences)."""
    grouped: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        if row['distance'] == distance:
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
    cells = []
    for method, by_length in summary.items():
        seeds = min(n for _, _, n in by_length.values())
        cells.append(
            [method, str(seeds)] + [_mean_and_spread(*by_length[length]) for length in lengths]
        )
    title = f'{metric}: mean ± std over seeds ({rows[0]["num_sequences"]} sequences per length)'
    header = ['method', 'seeds'] + [str(length) for length in lengths]
    return f'{title}\n\n' + reporting.markdown_table(header, cells)


def distance_tables(rows: Sequence[dict[str, Any]], metric: str) -> str:
    """Markdown: per length, one line per method, 'mean ± std' per distance ('' without such rows)."""
    tables = []
    for length in sorted({row['length'] for row in rows if row['distance'] is not None}):
        distances = sorted({r['distance'] for r in rows if r['length'] == length} - {None})
        by_distance = {d: summarize(rows, metric, d) for d in distances}
        cells = [
            [method] + [_mean_and_spread(*by_distance[d][method][length]) for d in distances]
            for method in by_distance[distances[0]]
        ]
        header = ['method'] + [f'd={d}' for d in distances]
        title = f'{metric} at length {length} by key-to-query distance d: mean ± std over seeds'
        tables.append(f'{title}\n\n' + reporting.markdown_table(header, cells))
    return '\n'.join(tables)


def _mean_and_spread(mean: float, spread: float, num_seeds: int) -> str:
    # One seed has no spread to report; a '± 0.000' would claim one.
    return f'{mean:.3f}' if num_seeds == 1 else f'{mean:.3f} ± {spread:.3f}'


def write_comparison(rows: Sequence[dict[str, Any]], workdir: str) -> None:
    """<workdir>/comparison.csv (all rows), .md (a table per metric of the task, and its headline
    metric per distance), .png (curves of the headline metric against length)."""
    workdir = epath.Path(workdir)
    reporting.write_csv(workdir / 'comparison.csv', rows, CSV_COLUMNS)
    metrics = TASK_COLUMNS[task_of(rows)]
    tables = [comparison_table(rows, metric) for metric in metrics]
    tables.append(distance_tables(rows, metrics[0]))
    reporting.write_text(workdir / 'comparison.md', '\n'.join(filter(None, tables)))
    curves = {
        method: (
            list(by_length),
            [m for m, _, _ in by_length.values()],
            [s for _, s, _ in by_length.values()],
        )
        for method, by_length in summarize(rows, metrics[0]).items()
    }
    reporting.plot_against_length(workdir / 'comparison.png', curves, ylabel=metrics[0])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
    if not _METHODS.value:
        raise app.UsageError('--methods is required, e.g. --methods=rope,jordan_rope')
    run_comparison(_CONFIG.value, _METHODS.value, [int(s) for s in _SEEDS.value], _WORKDIR.value)


def run_main() -> None:
    """The command line: python -m jrope.experiments.compare (or python -m jrope.compare)."""
    huge_pages.restart_with_huge_pages()
    flags.mark_flags_as_required(['config', 'workdir'])
    app.run(main)


if __name__ == '__main__':
    run_main()
