"""Loss and accuracy (or MSE and R^2) of a model across evaluation lengths (length extrapolation).

`evaluate_lengths` adds the task's sums (jrope.losses) of `EvalStep` over the fixed sequences of
`eval.seed` per length (and distance). `evaluate_and_report` logs the rows, then merges them into
`eval_step<step>/` (newer rows win), CSV last: a folder with its CSV holds a whole result whose
rows are logged; a NaN loss is a failure.

Shape legend: B batch, T length, V vocabulary, C channels.
"""

from __future__ import annotations

import contextlib
import csv
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from jrope import command_line, flops, results
from jrope.data.source import DistanceEvaluation
from jrope.errors import NonFiniteError, UsageError
from jrope.losses import metrics_from_sums, task_sums
from jrope.model import damping
from jrope.train import checkpoints, outputs, runtime
from jrope.train.config import EvalConfig
from jrope.train.outputs import duration, say
from jrope.train.setup import RunSetup, model_from_params

# A result row: CSV_COLUMNS to their values.
Row = dict[str, Any]


# What a row is of (distance: empty for the source's own sequences), what it measures (NaN where
# the task has none), the compute dtype and eval.seed (last: older CSVs lack them, read as None).
KEY_COLUMNS = ("method", "seed", "step", "length", "distance", "num_sequences")
METRIC_COLUMNS = ("loss", "accuracy", "bits_per_byte", "r2", "r2_pooled")
CSV_COLUMNS = KEY_COLUMNS + METRIC_COLUMNS + ("compute_dtype", "eval_seed")
# The columns of each task's markdown table, after the length: headline metric first.
TASK_COLUMNS = {
    "language_model": ("loss", "bits_per_byte"),
    "classification": ("accuracy", "loss"),
    "regression": ("loss", "r2", "r2_pooled"),
}
RESULTS_CSV = "eval.csv"  # written last: its presence marks a whole result
# A length still evaluating after this many seconds reports its progress, and again after as many.
PROGRESS_INTERVAL_S = 30.0


class EvalStep:
    """step(params, batch) -> weighted sums, for the kernels of `plan` (default: planned for
    model.max_damping alone); `for_length` gives the jitted function of a length."""

    def __init__(self, run: RunSetup, plan: damping.KernelPlan | None = None):
        task, num_classes = run.source.task, run.source.num_classes
        self.plan = plan or run.plan
        self.graphdef = self.plan.graphdef

        def eval_sums(graphdef, params, batch):
            inputs = batch["inputs"]
            positions = batch.get("positions", jnp.arange(inputs.shape[1], dtype=jnp.int32))
            model = model_from_params(graphdef, params)
            outputs = model(inputs, positions, segment_ids=batch.get("segment_ids"))
            return task_sums(outputs, batch, task, num_classes)

        platform, self._jitted = self.plan.platform, {}
        for blockwise in (False, True):
            options = runtime.step_compiler_options(blockwise=blockwise, platform=platform)
            self._jitted[blockwise] = jax.jit(eval_sums, static_argnums=0, compiler_options=options)

    def for_length(self, length: int):
        """The jitted step for batches of `length` tokens."""
        # The checks before the run refuse a length whose kernel does not apply.
        return self._jitted[self.plan.kernel(length) == "blockwise"]

    def __call__(self, params, batch):
        return self.for_length(batch["inputs"].shape[1])(self.graphdef, params, batch)


def _batches(run: RunSetup, length: int, distance: int | None = None):
    """The evaluation sequences of `length` (at `distance`), this process's rows of each batch."""
    count, batch_size, seed = run.eval.num_sequences, run.eval.batch_size, run.eval.seed
    if distance is None:
        return run.source.eval_batches(length, count, batch_size, seed=seed)
    return run.source.distance_eval_batches(length, distance, count, batch_size, seed=seed)


def compile_lengths(eval_step: EvalStep, params: Any, run: RunSetup) -> None:
    """Compiles `eval_step` at every length of eval.lengths (one batch's shapes; its calls reuse
    it), before the work; UsageError where one needs more than a device's memory (XLA's count)."""
    with jax.set_mesh(run.mesh):
        for length in run.eval.lengths:
            jitted, local_batch = eval_step.for_length(length), next(iter(_batches(run, length)))
            lowered = jitted.lower(eval_step.graphdef, params, run.global_batch(local_batch))
            what, fix = f"eval.lengths: {length}", "drop it or lower eval.batch_size"
            flops.require_memory(lowered.compile(), what=what, fix=fix)


def evaluate_lengths(eval_step, params, run: RunSetup, *, step: int, on_length=None) -> list[Row]:
    """One result row per length of eval.lengths (CSV_COLUMNS) for the model of `step`, each
    followed by one per distance of a DistanceEvaluation; on_length(row, seconds) after each."""
    rows, source = [], run.source
    for length in run.eval.lengths:
        started = time.perf_counter()
        rows.append(_result_row(eval_step, params, run, step, length))
        if on_length is not None:
            on_length(rows[-1], time.perf_counter() - started)
        distances = source.eval_distances(length) if isinstance(source, DistanceEvaluation) else ()
        for distance in distances:
            rows.append(_result_row(eval_step, params, run, step, length, distance))
    return rows


def _result_row(eval_step, params, run, step, length, distance=None) -> Row:
    """The CSV row of one length (and distance) over its evaluation sequences."""
    count, batch_size = run.eval.num_sequences, run.eval.batch_size
    totals = {}
    started = last_report = time.perf_counter()
    at = f"length {length}" + ("" if distance is None else f", distance {distance}")
    with jax.set_mesh(run.mesh):
        for done, local_batch in enumerate(_batches(run, length, distance), start=1):
            sums = eval_step(params, run.global_batch(local_batch))
            for name, value in jax.device_get(sums).items():
                totals[name] = totals.get(name, 0.0) + float(value)
            # eval.batch_size divides eval.num_sequences (jrope.train.config).
            now, evaluated = time.perf_counter(), done * batch_size
            if done == 1:  # the pace is measured after the first batch (and its compilation)
                paced_from = now
            if done > 1 and now - last_report >= PROGRESS_INTERVAL_S and evaluated < count:
                last_report = now
                per_sequence = (now - paced_from) / (evaluated - batch_size)
                left = per_sequence * (count - evaluated)
                say(f"  {at}: {evaluated} of {count} sequences in {duration(now - started)}, "
                    f"about {duration(left)} left")  # fmt: skip
    metrics = metrics_from_sums(totals, run.source.task)
    if run.source.task == "language_model":  # byte-level: nats per byte -> bits per byte
        metrics["bits_per_byte"] = metrics["loss"] / math.log(2.0)
    keys = (run.method, run.seed, step, length, distance, count)
    row = dict(zip(KEY_COLUMNS, keys, strict=True))
    row |= {name: metrics.get(name, math.nan) for name in METRIC_COLUMNS}
    return row | {"compute_dtype": run.compute_dtype, "eval_seed": run.eval.seed}


def log_rows(logger: outputs.MetricsLogger, step: int, task: str, rows: Sequence[Row]) -> None:
    """`rows` in the run's logs at `step` (flushed), as 'eval_<length>[_d<distance>]/<metric>'."""
    for row in rows:
        metrics = {metric: row[metric] for metric in TASK_COLUMNS[task]}
        logger.write_scalars(step, metrics, row_name(row))
    logger.flush()


def row_name(row: Row) -> str:
    """A row's name in the run's logs: 'eval_<length>[_d<distance>]'."""
    return f"eval_{row['length']}" + ("" if row["distance"] is None else f"_d{row['distance']}")


def evaluate_and_report(eval_step, params, run: RunSetup, workdir, step: int, log) -> list[Row]:
    """This evaluation's rows of the checkpoint of `step` (NonFiniteError naming it for a NaN loss),
    merged into `eval_step<step>` and shown. log(rows) writes them to the run's logs before the
    CSV: a kill in between leaves the evaluation to redo."""
    task = run.source.task
    lengths = ", ".join(str(length) for length in run.eval.lengths)
    say(f"Evaluating step {step} at lengths {lengths} ({run.eval.num_sequences} sequences each):")

    def show(row: Row, seconds: float) -> None:
        shown = "  ".join(f"{name} {row[name]:.4f}" for name in TASK_COLUMNS[task])
        say(f"  length {row['length']}: {shown}  ({duration(seconds)})")

    rows = evaluate_lengths(eval_step, params, run, step=step, on_length=show)
    checkpoint = str(checkpoints.checkpoint_path(run.checkpointer, step))
    check_evaluation(rows, checkpoint, eval_step.plan.measured)
    out_dir = results_dir(workdir, step)
    merged = merge_rows(readable_results(out_dir) or [], rows)
    log(rows)
    if jax.process_index() == 0:
        write_results_atomically(merged, out_dir, task=task)
    show_results(merged, out_dir, task=task)
    return rows


def merge_rows(earlier: Sequence[Row], new: Sequence[Row]) -> list[Row]:
    """`earlier` and `new` result rows, one per (length, distance), `new` winning, by length; says
    which length's row is replaced, with the compute dtypes where they differ."""
    by_key = {(row["length"], row["distance"]): row for row in earlier}
    for row in new:
        old = by_key.get((row["length"], row["distance"]))
        if old is not None and row["distance"] is None:
            before, now = old.get("compute_dtype"), row.get("compute_dtype")
            dtypes = f" ({before} there, {now} now)" if before and before != now else ""
            say(f"  length {row['length']}: row replaced{dtypes}")
        by_key[row["length"], row["distance"]] = row
    keys = sorted(by_key, key=lambda key: (key[0], -1 if key[1] is None else key[1]))
    return [by_key[key] for key in keys]


def write_results_atomically(rows: Sequence[Row], out_dir: epath.Path, *, task: str) -> None:
    """write_results, the CSV last, so that no folder holds a part of the rows."""
    results.write_folder_atomically(
        out_dir,
        lambda folder: write_results(rows, folder, task=task),
        [f"eval.{name}" for name in ("png", "md", "csv")],
    )


def show_results(rows: Sequence[Row], out_dir: epath.PathLike, *, task: str) -> None:
    """The results table on the console, with where it is saved."""
    say(f"\n{epath.Path(out_dir) / 'eval.md'}:\n")
    say(markdown_table(rows, task=task))


def lengths_to_evaluate(eval_cfg: EvalConfig, compute_dtype: str, earlier, out_dir) -> tuple:
    """The lengths of eval.lengths without a row in `earlier` (`out_dir`'s) of the same
    eval.num_sequences and `compute_dtype`; UsageError for rows of another eval.seed (other
    sequences, which one table does not mix)."""
    if seeds := sorted({row["eval_seed"] for row in earlier} - {None, eval_cfg.seed}):
        raise UsageError(
            f"eval.seed = {eval_cfg.seed}, but {out_dir / RESULTS_CSV} holds eval.seed {seeds[0]}; "
            f"set --config.eval.seed={seeds[0]}, or mv {out_dir} {out_dir}.eval_seed{seeds[0]}"
        )
    done = {
        row["length"]
        for row in earlier
        if row["distance"] is None
        and row["num_sequences"] == eval_cfg.num_sequences
        and row["compute_dtype"] in (None, compute_dtype)
    }
    return tuple(length for length in eval_cfg.lengths if length not in done)


def log_evaluation(workdir: str, step: int, tensorboard: bool, task: str, rows: Sequence[Row]):
    """Appends a later evaluation of checkpoint `step` to the run's metrics.jsonl (and TensorBoard)
    under the training run's names, in place of an earlier try's records of the same rows."""
    names = {row_name(row) for row in rows}  # an earlier try stopped before the table was written
    logger = outputs.MetricsLogger(
        workdir, every_steps=1, num_steps=step, tensorboard=tensorboard, start_step=None,
        redo_step=step, redo_names=names,
    )  # fmt: skip
    with contextlib.closing(logger):
        log_rows(logger, step, task, rows)


def results_dir(workdir: str, step: int) -> epath.Path:
    return epath.Path(workdir) / f"eval_step{step}"


def finished_rows(workdir: str, step: int, task: str) -> list[Row] | None:
    """The rows of a finished run's evaluation at `step`, shown (None: it has none to read)."""
    finished = results_dir(workdir, step)
    if (rows := readable_results(finished)) is not None:
        say(
            f"Finished earlier: {command_line.command('eval')} --workdir={workdir} evaluates again."
        )
        show_results(rows, finished, task=task)
    return rows


def readable_results(out_dir: epath.PathLike) -> list[Row] | None:
    """The rows of a results folder's CSV; None without one, or for one that cannot be read as
    results (damaged, edited): renamed `eval.csv.damaged[N]` and said, so that it is redone."""
    path = epath.Path(out_dir) / RESULTS_CSV
    if not path.exists():
        return None
    try:
        rows = read_results(out_dir)
    except (UnicodeDecodeError, csv.Error, KeyError, ValueError, TypeError) as error:
        problem = f"{type(error).__name__}: {error}"
    else:
        if rows:
            return rows
        problem = "no rows"
    aside, number = path.parent / f"{RESULTS_CSV}.damaged", 1
    while aside.exists():
        number += 1
        aside = path.parent / f"{RESULTS_CSV}.damaged{number}"
    path.rename(aside)
    say(f"{path} unreadable ({problem[:200]}): set aside as {aside}; evaluating again.")
    return None


def read_results(out_dir: epath.PathLike) -> list[Row]:
    """The rows of a results folder's CSV, with their types (distance None where empty)."""
    rows = results.read_csv(epath.Path(out_dir) / RESULTS_CSV)
    for row in rows:
        if "r2_pooled" not in row:  # a CSV without this column holds the pooled R^2 under r2
            row["r2_pooled"], row["r2"] = row["r2"], "nan"
        for key in ("seed", "step", "length", "num_sequences"):
            row[key] = int(row[key])
        row["distance"] = int(row["distance"]) if row["distance"] else None
        row["compute_dtype"] = row.get("compute_dtype") or None
        row["eval_seed"] = int(row["eval_seed"]) if row.get("eval_seed") else None
        for key in METRIC_COLUMNS:
            row[key] = float(row[key])
    return rows


def write_results(rows: Sequence[Row], out_dir: epath.PathLike, *, task: str) -> dict:
    """eval.{png,md,csv} of `rows` (of a source with `task`), the CSV last; their paths."""
    out_dir = epath.Path(out_dir)
    paths = {name: out_dir / f"eval.{name}" for name in ("png", "md", "csv")}
    metric = TASK_COLUMNS[task][0]
    by_length = [row for row in rows if row["distance"] is None]
    curve = ([row["length"] for row in by_length], [row[metric] for row in by_length], None)
    labels = {"language_model": "loss (nats/byte)", "regression": "mean squared error"}
    results.plot_against_length(
        paths["png"], {rows[0]["method"]: curve}, ylabel=labels.get(task, metric), size=(5, 3.5)
    )
    results.write_text(paths["md"], markdown_table(rows, task=task))
    results.write_csv(paths["csv"], rows, CSV_COLUMNS)
    return paths


def markdown_table(rows: Sequence[Row], *, task: str) -> str:
    """Rows as a markdown table with the mean over lengths (the paper's LM summary), rows at
    chosen distances in a second; the sequence count in the title, or a column where it varies."""
    first = rows[0]
    title = f"method: {first['method']}, seed: {first['seed']}, step: {first['step']}"
    counts = sorted({row["num_sequences"] for row in rows})
    per_row = ("num_sequences",) if len(counts) > 1 else ()
    title += ", sequences per row" if per_row else f", {counts[0]} sequences per length"
    columns = ("length",) + TASK_COLUMNS[task] + per_row
    by_length = [row for row in rows if row["distance"] is None]
    cells = [[results.format_cell(row[column]) for column in columns] for row in by_length]
    means = [np.mean([row[column] for row in by_length]) for column in TASK_COLUMNS[task]]
    cells.append(["mean", *map(results.format_cell, means), *[""] * len(per_row)])
    text = f"{title}\n\n" + results.markdown_table(columns, cells)
    at_distance = [row for row in rows if row["distance"] is not None]
    if at_distance:
        columns = ("length", "distance") + TASK_COLUMNS[task] + per_row
        cells = [[results.format_cell(row[c]) for c in columns] for row in at_distance]
        text += "\nAt chosen distances:\n\n" + results.markdown_table(columns, cells)
    return text


def check_evaluation(rows: Sequence[Row], checkpoint: str, measured=None) -> None:
    """NonFiniteError naming the lengths whose loss is NaN or infinite, if any, and first the
    damping `measured` (the kernel plan's) where it passed model.max_damping."""
    bad = [f"{row['length']} ({row['loss']})" for row in rows if not math.isfinite(row["loss"])]
    if bad:
        error = NonFiniteError(f"Loss of {checkpoint} not finite at length {', '.join(bad)}; "
                               "nothing written. Retrain with lower opt.learning_rate.")  # fmt: skip
        raise damping.diagnosed(error, measured)
