r"""Train and evaluate a list of methods over seeds, and tabulate them side by side.

    python -m jrope.compare --config=configs/synthetic_cpu.py \
        --methods=rope,direct_sum,jordan_rope,jordan_raw_tau,jordan_exact_scaled,rope_alibi \
        --seeds=0,1,2 --workdir=runs/synthetic_cpu

Each (method, seed) trains in `<workdir>/<method>/seed<seed>` with the same config but `pe.name`
and `seed`. Every run's config is checked before the first one trains, all problems of all runs
together: a misspelt method last in --methods must not cost the training of the others first. A
finished run (its final evaluation CSV exists) is not retrained, only read where its last start's
config has the command's training settings, and evaluated at the lengths it lacks; an interrupted
one resumes. `<workdir>/comparison.{csv,md,png}` hold every row, then the mean and sample std over
seeds per method and length (and distance, for key-value retrieval). Every process of a
multi-process run (train.py's flags) runs the same command.
"""

from __future__ import annotations

import collections
import copy
import importlib.metadata
import json
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import flags
from etils import epath

from jrope import results
from jrope.errors import ConfigError, DataError, UsageError
from jrope.train import evaluation, outputs, setup
from jrope.train.checkpoints import config_differences
from jrope.train.config import TrainConfig
from jrope.train.evaluation import CSV_COLUMNS, TASK_COLUMNS
from jrope.train.outputs import say
from jrope.train.trainer import evaluate_checkpoint, train_and_evaluate


def run_comparison(config, methods: Sequence[str], seeds: Sequence[int], workdir: str) -> list:
    """Checks every (method, seed), trains those not yet finished, then writes the comparison files.
    ConfigError (DataError) listing every problem of every run before any trains."""
    methods, seeds = comparison_axes(methods, [str(seed) for seed in seeds])
    folder = epath.Path(workdir)
    runs = {
        (m, s): (_run_config(config, m, s), folder / m / f"seed{s}") for s in seeds for m in methods
    }
    checked = _check_every_run(runs)
    finished = {run: _finished_rows(checked[run], run_dir) for run, (_, run_dir) in runs.items()}
    rows = []
    for (method, seed), (_, run_dir) in runs.items():
        if finished[method, seed] is None:
            say(f"{method} seed {seed}: training in {run_dir}")
            train_and_evaluate(checked[method, seed], str(run_dir))
            results = evaluation.results_dir(run_dir, checked[method, seed].num_steps)
            finished[method, seed] = evaluation.read_results(results)
        rows.extend(finished[method, seed])
    if jax.process_index() == 0:
        paths = write_comparison(rows, workdir)
        show_comparison(paths)
    return rows


def _finished_rows(cfg: TrainConfig, run_dir: epath.Path) -> list[dict] | None:
    """The result rows of a run finished with `cfg`'s settings at eval.lengths, evaluating the
    lengths it lacks; None when unfinished. UsageError for a run of other settings (its last start
    record's config): its rows are not this command's."""
    out_dir = evaluation.results_dir(run_dir, cfg.num_steps)
    earlier = evaluation.readable_results(out_dir)
    if earlier is None:
        return None
    record = run_dir / outputs.RECORD_FILE
    starts = results.split_json_lines(record.read_bytes())[0] if record.exists() else []
    saved = json.loads(starts[-1]).get("config") if starts else None
    asked = cfg.to_json_dict()
    asked["checkpoint"]["accept_changes"] = ""  # a finished run trains no further
    refused = [f"no {outputs.RECORD_FILE} names them"]
    if saved is not None:
        refused = config_differences(saved, asked, purpose="resume")[0]
    if refused:
        raise UsageError(f"{run_dir} finished with other settings: {'; '.join(refused)}; give "
                         "this comparison another --workdir.")  # fmt: skip
    if missing := evaluation.lengths_to_evaluate(
        cfg.eval, cfg.model.compute_dtype, earlier, out_dir
    ):
        say(f"{run_dir}: finished earlier; evaluating lengths {sorted(missing)}")
        return evaluate_checkpoint(cfg, str(run_dir), cfg.num_steps)
    say(f"{run_dir}: finished earlier, reading its results")
    return [row for row in earlier if row["length"] in cfg.eval.lengths]


def _run_config(config, method: str, seed: int):
    """A copy of `config` with `pe.name` and `seed` set (FieldReferences follow within the copy)."""
    run_config = copy.deepcopy(config)
    run_config.pe.name = method
    run_config.seed = seed  # a FieldReference: the data seed follows
    return run_config


def _check_every_run(runs: dict) -> dict:
    """(method, seed) -> its checked TrainConfig; one ConfigError (DataError) for all problems."""
    checked, problems, only_data = {}, collections.defaultdict(list), True
    for (method, seed), (run_config, run_dir) in runs.items():
        try:
            cfg = TrainConfig.from_config_dict(run_config)
            setup.check_run(cfg, str(run_dir))
            checked[method, seed] = cfg
        except ConfigError as error:
            only_data &= isinstance(error, DataError)
            for problem in error.problems:
                problems[problem].append((method, seed))
    if problems:
        lines = [f"{_which_runs(where)}: {problem}" for problem, where in problems.items()]
        raise (DataError if only_data else ConfigError)(lines)
    return checked


def _which_runs(runs: list[tuple[str, int]]) -> str:
    """'rope seeds 0, 1; jordan_rope seed 2'."""
    seeds_by_method = collections.defaultdict(list)
    for method, seed in runs:
        seeds_by_method[method].append(str(seed))
    return "; ".join(
        f"{method} seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}"
        for method, seeds in seeds_by_method.items()
    )


def task_of(rows: Sequence[dict[str, Any]]) -> str:
    """The task the rows come from (jrope.data.source.TASKS), read off which metrics are set."""
    if not np.isnan(rows[0]["bits_per_byte"]):
        return "language_model"
    return "regression" if not np.isnan(rows[0]["r2"]) else "classification"


def summarize(rows: Sequence[dict], metric: str, distance: int | None = None) -> dict:
    """method -> length -> (mean, sample std over seeds, number of seeds), of the rows at `distance`
    (None: the rows over the source's own evaluation sequences)."""
    grouped: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        if row["distance"] == distance:
            grouped.setdefault(row["method"], {}).setdefault(row["length"], []).append(row[metric])
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
    lengths = sorted({row["length"] for row in rows})
    cells = []
    for method, by_length in summary.items():
        seeds = min(n for _, _, n in by_length.values())
        cells.append([method, str(seeds), *(_mean_and_spread(*by_length[n]) for n in lengths)])
    title = f"{metric}: mean ± std over seeds ({rows[0]['num_sequences']} sequences per length)"
    header = ["method", "seeds"] + [str(length) for length in lengths]
    return f"{title}\n\n" + results.markdown_table(header, cells)


def seed_table(rows: Sequence[dict[str, Any]], metric: str) -> str:
    """Markdown: one line per (method, seed), the metric per length (the rows behind the means)."""
    lengths = sorted({row["length"] for row in rows})
    values = {
        (r["method"], r["seed"], r["length"]): r[metric] for r in rows if r["distance"] is None
    }
    runs = list(dict.fromkeys((method, seed) for method, seed, _ in values))
    cells = [
        [method, str(seed)] + [f"{values[method, seed, length]:.3f}" for length in lengths]
        for method, seed in runs
    ]
    header = ["method", "seed"] + [str(length) for length in lengths]
    return f"{metric} of each run\n\n" + results.markdown_table(header, cells)


def provenance() -> str:
    """'Made by `<this command>` at jrope <commit>[+changes]' (an installed package: its version):
    the line that lets a table be regenerated."""
    command = shlex.join(["python", "-m", "jrope.compare", *sys.argv[1:]])
    commit = outputs.code_commit()
    if commit is None:
        return f"Made by `{command}` at jrope version {importlib.metadata.version('jrope')}."
    return f"Made by `{command}` at jrope {commit[0][:10]}{'' if commit[1] else '+changes'}."


def distance_tables(rows: Sequence[dict[str, Any]], metric: str) -> str:
    """Markdown: per length, one line per method, 'mean ± std' per distance ('' without such rows)."""
    tables = []
    for length in sorted({row["length"] for row in rows if row["distance"] is not None}):
        distances = sorted({r["distance"] for r in rows if r["length"] == length} - {None})
        by_distance = {d: summarize(rows, metric, d) for d in distances}
        cells = [
            [method] + [_mean_and_spread(*by_distance[d][method][length]) for d in distances]
            for method in by_distance[distances[0]]
        ]
        header = ["method"] + [f"d={d}" for d in distances]
        title = f"{metric} at length {length} by key-to-query distance d: mean ± std over seeds"
        tables.append(f"{title}\n\n" + results.markdown_table(header, cells))
    return "\n".join(tables)


def _mean_and_spread(mean: float, spread: float, num_seeds: int) -> str:
    # One seed has no spread to report; a '± 0.000' would claim one.
    return f"{mean:.3f}" if num_seeds == 1 else f"{mean:.3f} ± {spread:.3f}"


def write_comparison(rows: Sequence[dict[str, Any]], workdir: str) -> dict[str, epath.Path]:
    """<workdir>/comparison.csv (all rows), .md (a table per metric of the task, and its headline
    metric per distance), .png (the headline metric against length); their paths by suffix."""
    workdir = epath.Path(workdir)
    paths = {suffix: workdir / f"comparison.{suffix}" for suffix in ("csv", "md", "png")}
    results.write_csv(paths["csv"], rows, CSV_COLUMNS)
    metrics = TASK_COLUMNS[task_of(rows)]
    tables = [provenance(), *(comparison_table(rows, metric) for metric in metrics)]
    tables += [seed_table(rows, metrics[0]), distance_tables(rows, metrics[0])]
    results.write_text(paths["md"], "\n".join(filter(None, tables)))
    curves = {}
    for method, by_length in summarize(rows, metrics[0]).items():
        means, spreads, _ = zip(*by_length.values(), strict=True)
        curves[method] = (list(by_length), means, spreads)
    results.plot_against_length(paths["png"], curves, ylabel=metrics[0])
    return paths


def show_comparison(paths: dict[str, epath.Path]) -> None:
    """The comparison tables on the console (as comparison.md holds them), then where each file is."""
    say(f"\nComparison ({paths['md']}):\n")
    say(paths["md"].read_text().rstrip())
    say(f"\nComparison files:\n  {paths['csv']}  every run's rows\n  {paths['md']}  the tables "
        f"above\n  {paths['png']}  the headline metric against length")  # fmt: skip


def main(argv: list[str]) -> None:
    run_comparison(flags.FLAGS.config, flags.FLAGS.methods, flags.FLAGS.seeds, flags.FLAGS.workdir)


def comparison_axes(methods: Sequence[str] | None, seeds: Sequence[str]) -> tuple[list, list]:
    """(methods, int seeds) from the flags' lists; UsageError for a seed that is no integer, an
    empty list, or a repeat (it would train once and count twice in the means)."""
    methods = [method.strip() for method in methods or () if method.strip()]
    try:
        int_seeds = [int(seed) for seed in seeds if seed.strip()]
    except ValueError:
        raise UsageError(f"--seeds must be integers, e.g. --seeds=0,1,2; got {seeds}.") from None
    examples = {"--methods": "rope,jordan_rope", "--seeds": "0,1,2"}
    for flag, values in (("--methods", methods), ("--seeds", int_seeds)):
        repeated = sorted({str(v) for v in values if values.count(v) > 1})
        if repeated or not values:
            problem = f"lists {', '.join(repeated)} more than once" if repeated else "is empty"
            unique = ",".join(str(v) for v in dict.fromkeys(values)) or examples[flag]
            raise UsageError(f"{flag} {problem}: use {flag}={unique}.")
    return methods, int_seeds
