"""Loss and accuracy (or MSE and R^2) of a model across evaluation lengths (length extrapolation).

What a step measures, per task, for the train step and the evaluation alike
(so a training loss and an evaluation loss are the same quantity): token
tasks (language modelling, classification over the first `num_classes`
logits) sum a weighted cross-entropy and the correct predictions (nats per
byte for language modelling); regression sums squared errors, each
sequence's R^2 and what the pooled R^2 needs. Sums, not means, so that
batches and processes add up exactly. Regression reports two R^2: 'r2', the
mean over sequences of each sequence's own R^2 (the paper's reference
reports this one), and 'r2_pooled', one R^2 of every sequence's positions
taken together (which rewards a model for the spread between sequences).

The evaluation sequences are the data source's for `eval.seed`, fixed per
length whatever the run's seed and method, so every comparison is paired
(jrope.data.source).

`evaluate_lengths` runs a jitted forward at each length over the data
source's fixed evaluation sequences, in small batches so that long lengths
fit in memory, and, for a source that places its answer at chosen distances
(jrope.data.source.DistanceEvaluation), at each such distance too;
`write_results` writes a CSV (one row per method, seed, step, length and
distance), a markdown table and a PNG curve against length
(jrope.train.outputs), the CSV last: a folder holding `eval.csv` holds a
whole result. `evaluate_and_report` does both for the trainer and eval.py,
with the progress per length and the table on the console; a NaN or
infinite loss is a failure (`check_evaluation`), not a result. One folder per
step, `eval_step<step>`: a new evaluation merges its rows into what the folder
holds, by length (and distance), a length evaluated again taking the newer
row; the files are written into a temporary folder and moved in, the CSV
last, so a folder never holds half a result. `evaluate_checkpoint` holds the
workdir's lock as an evaluation (jrope.train.checkpoints.WorkdirLock): two
evaluations of one workdir take turns, and a training run in it is not
evaluated behind its back. A length that takes long prints a progress line
every PROGRESS_INTERVAL_S.

Shape legend: B batch, T length, V vocabulary, C channels.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.sharding import Mesh

from jrope.data.files import is_uri
from jrope.data.source import DistanceEvaluation
from jrope.errors import NonFiniteEvaluationError, UsageError
from jrope.train import checkpoints, checks, damping, outputs, runtime, setup
from jrope.train.checkpoints import Checkpointer
from jrope.train.config import TrainConfig
from jrope.train.outputs import duration, say
from jrope.train.runtime import step_compiler_options
from jrope.train.setup import RunSetup, model_from_params, set_up_run


def weighted_sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, num_classes: int | None
) -> dict[str, jax.Array]:
    """Weighted sums of cross-entropy and correct predictions.

    Args:
      logits: float32 [B, T', V] for the last T' <= T positions (T' = 1 with
        the model's readout='last'); targets: int32 [B, T]; weights: float32 [B, T].
      num_classes: when set, only logits[..., :num_classes] compete.
    Returns:
      float32 scalars 'loss_sum', 'correct_sum', 'weight_sum'.
    """
    first = targets.shape[1] - logits.shape[1]
    targets, weights = targets[:, first:], weights[:, first:]
    if num_classes is not None:
        logits = logits[..., :num_classes]
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "loss_sum": jnp.sum(nll * weights),
        "correct_sum": jnp.sum(correct * weights),
        "weight_sum": jnp.sum(weights),
    }


# A sequence whose targets are constant has no variance to explain: its R^2 divides by this.
VARIANCE_FLOOR = 1e-12


def squared_error_sums(
    predictions: jax.Array, targets: jax.Array, weights: jax.Array
) -> dict[str, jax.Array]:
    """Weighted sums of squared errors, of the targets (pooled R^2) and of each sequence's R^2.

    Args:
      predictions: float32 [B, T', C] for the last T' <= T positions;
        targets: float32 [B, T, C]; weights: float32 [B, T].
    Returns:
      float32 scalars 'loss_sum' (w (p - y)^2 summed over positions and
      channels), 'weight_sum' (w summed, times C: the loss is per element),
      'target_sum' and 'target_square_sum' (w y and w y^2 summed),
      'sequence_r2_sum' (each sequence's R^2 summed: 1 - its weighted mean
      squared error / its weighted variance about its own mean, over its
      positions and channels, the variance floored at VARIANCE_FLOOR; with
      unit weights jrope.data.signal.sequence_r2) and 'sequence_count' (the
      sequences with a nonzero weight, the only ones counted).
    """
    first = targets.shape[1] - predictions.shape[1]
    targets, weights = targets[:, first:].astype(jnp.float32), weights[:, first:, None]
    channels = targets.shape[-1]
    squared_errors = jnp.square(predictions - targets) * weights
    # Per sequence [B]: weight, mean squared error and variance over positions and channels.
    sequence_weight = jnp.sum(weights, axis=(1, 2)) * channels
    counted = sequence_weight > 0
    safe_weight = jnp.where(counted, sequence_weight, 1.0)
    sequence_mse = jnp.sum(squared_errors, axis=(1, 2)) / safe_weight
    sequence_mean = jnp.sum(targets * weights, axis=(1, 2)) / safe_weight
    centred = jnp.square(targets - sequence_mean[:, None, None]) * weights
    sequence_variance = jnp.sum(centred, axis=(1, 2)) / safe_weight
    sequence_r2 = 1.0 - sequence_mse / jnp.maximum(sequence_variance, VARIANCE_FLOOR)
    return {
        "loss_sum": jnp.sum(squared_errors),
        "weight_sum": jnp.sum(weights) * channels,
        "target_sum": jnp.sum(targets * weights),
        "target_square_sum": jnp.sum(jnp.square(targets) * weights),
        "sequence_r2_sum": jnp.sum(jnp.where(counted, sequence_r2, 0.0)),
        "sequence_count": jnp.sum(counted.astype(jnp.float32)),
    }


def task_sums(
    outputs: jax.Array, batch: dict[str, jax.Array], task: str, num_classes: int | None
) -> dict[str, jax.Array]:
    """The sums of `task` (a data source's, jrope.data.source.TASKS) for a batch's model outputs."""
    if task == "regression":
        return squared_error_sums(outputs, batch["targets"], batch["weights"])
    return weighted_sums(outputs, batch["targets"], batch["weights"], num_classes)


def metrics_from_sums(sums: dict[str, Any], task: str) -> dict[str, Any]:
    """From task_sums: 'loss' and 'accuracy' (token tasks), or 'loss' (MSE), 'r2' (the mean of
    the sequences' own R^2) and 'r2_pooled' (one R^2 over every sequence) for regression."""
    loss = sums["loss_sum"] / sums["weight_sum"]
    if task != "regression":
        return {"loss": loss, "accuracy": sums["correct_sum"] / sums["weight_sum"]}
    mean = sums["target_sum"] / sums["weight_sum"]
    variance = sums["target_square_sum"] / sums["weight_sum"] - mean * mean
    return {
        "loss": loss,
        "r2": sums["sequence_r2_sum"] / sums["sequence_count"],
        "r2_pooled": 1.0 - loss / variance,
    }


# distance: empty for the rows over the source's own evaluation sequences.
CSV_COLUMNS = (
    "method",
    "seed",
    "step",
    "length",
    "distance",
    "num_sequences",
    "loss",
    "accuracy",
    "bits_per_byte",
    "r2",
    "r2_pooled",
)
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
    """step(params, batch) -> weighted sums; compiled once per evaluation length.

    Before the first batch of new params, their damping is read on the host
    (jrope.train.damping.follow): past model.max_damping the model's layers
    plan their kernels for it, so a window one map origin cannot carry runs
    the blockwise kernel, and the step compiles for that model. Lengths whose
    attention runs blockwise compile with other XLA options than the rest
    (jrope.train.runtime): `for_length` gives the jitted function a length
    uses, and a call picks it by the batch's length.
    """

    def __init__(self, run: RunSetup):
        task, num_classes = run.source.task, run.source.num_classes

        def eval_sums(graphdef, params, batch):
            inputs = batch["inputs"]
            positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)
            outputs = model_from_params(graphdef, params)(inputs, positions)
            return task_sums(outputs, batch, task, num_classes)

        self._cfg = run.cfg
        self._platform = run.mesh.devices.flat[0].platform
        self._planned_graphdef = self._graphdef = run.layout.graphdef
        self._followed_params = None
        # The damping of the params last followed (None: none yet).
        self.measured: damping.MeasuredDamping | None = None
        self._jitted = {
            blockwise: jax.jit(
                eval_sums,
                static_argnums=0,
                compiler_options=step_compiler_options(
                    blockwise=blockwise, platform=self._platform
                ),
            )
            for blockwise in (False, True)
        }

    def follow(self, params) -> damping.MeasuredDamping:
        """Reads the damping of `params` and compiles for it (said on the console past the bound)."""
        if params is not self._followed_params:
            self._graphdef, self.measured = damping.follow(
                self._cfg, self._planned_graphdef, params
            )
            self._followed_params = params
            if self.measured.passed:
                say(
                    f"  {self.measured.describe()}: evaluating with kernels planned for it "
                    "(the blockwise kernel, in blocks of "
                    f"{self.measured.block_size}, where one map origin would overflow float32)."
                )
        return self.measured

    def for_length(self, length: int):
        """The jitted step for batches of `length` tokens (of the params last followed)."""
        try:
            kernel = damping.kernel(self._cfg, length, self._platform, self.measured)
        except ValueError as err:
            raise UsageError(
                f"Evaluation at length {length}: {err} Set --config.model.attention_impl=auto "
                "(or blockwise) to evaluate this model."
            ) from err
        return self._jitted[kernel == "blockwise"]

    def __call__(self, params, batch):
        self.follow(params)
        return self.for_length(batch["inputs"].shape[1])(self._graphdef, params, batch)


def evaluate_lengths(
    eval_step,
    params: Any,
    source: Any,
    cfg: TrainConfig,
    mesh: Mesh,
    *,
    step: int,
    on_length: Callable[[dict[str, Any], float], None] | None = None,
) -> list[dict[str, Any]]:
    """One result row per length of `cfg.eval.lengths` (see CSV_COLUMNS) for the model of `step`.

    For a DistanceEvaluation source, each length's row is followed by one per
    distance that fits in it. on_length(row, seconds) is called after each
    length's own row (compilation included).
    """
    rows = []
    for length in cfg.eval.lengths:
        started = time.perf_counter()
        batches = source.eval_batches(
            length, cfg.eval.num_sequences, cfg.eval.batch_size, seed=cfg.eval.seed
        )
        rows.append(_result_row(eval_step, params, batches, source, cfg, mesh, step, length, None))
        if on_length is not None:
            on_length(rows[-1], time.perf_counter() - started)
        if isinstance(source, DistanceEvaluation):
            for distance in source.eval_distances(length):
                batches = source.distance_eval_batches(
                    length,
                    distance,
                    cfg.eval.num_sequences,
                    cfg.eval.batch_size,
                    seed=cfg.eval.seed,
                )
                rows.append(
                    _result_row(
                        eval_step, params, batches, source, cfg, mesh, step, length, distance
                    )
                )
    return rows


def _result_row(
    eval_step, params, batches, source, cfg, mesh, step, length, distance
) -> dict[str, Any]:
    """The CSV row of one length (and distance) from its evaluation batches."""
    totals = {}
    started = last_report = time.perf_counter()
    num_batches = -(-cfg.eval.num_sequences // cfg.eval.batch_size)
    with jax.set_mesh(mesh):
        for done, local_batch in enumerate(batches, start=1):
            sums = eval_step(params, setup.global_batch(local_batch, cfg.mesh.rules, mesh))
            for name, value in jax.device_get(sums).items():
                totals[name] = totals.get(name, 0.0) + float(value)
            now = time.perf_counter()
            if now - last_report >= PROGRESS_INTERVAL_S and done < num_batches:
                last_report = now
                left = (now - started) / done * (num_batches - done)
                at = f"length {length}" + ("" if distance is None else f", distance {distance}")
                say(
                    f"  {at}: {min(done * cfg.eval.batch_size, cfg.eval.num_sequences)} of "
                    f"{cfg.eval.num_sequences} sequences in {duration(now - started)}, about "
                    f"{duration(left)} left"
                )
    metrics = metrics_from_sums(totals, source.task)
    nan = float("nan")
    return {
        "method": cfg.pe.name,
        "seed": cfg.seed,
        "step": step,
        "length": length,
        "distance": distance,
        "num_sequences": cfg.eval.num_sequences,
        "loss": metrics["loss"],
        "accuracy": metrics.get("accuracy", nan),
        # Byte-level LM: nats per byte -> bits per byte. Other tasks: not a rate.
        "bits_per_byte": metrics["loss"] / math.log(2.0)
        if source.task == "language_model"
        else nan,
        "r2": metrics.get("r2", nan),
        "r2_pooled": metrics.get("r2_pooled", nan),
    }


def logged_scalars(rows: Sequence[dict[str, Any]], task: str) -> list[tuple[str, dict[str, float]]]:
    """(name, {metric: value}) per row, for the metrics log: 'eval_<length>[_d<distance>]'."""
    logged = []
    for row in rows:
        name = f"eval_{row['length']}" + ("" if row["distance"] is None else f"_d{row['distance']}")
        logged.append((name, {metric: row[metric] for metric in TASK_COLUMNS[task]}))
    return logged


def evaluate_and_report(
    eval_step, params: Any, run: RunSetup, workdir: str, step: int, checkpoint: str
) -> tuple[list[dict[str, Any]], epath.Path]:
    """Evaluate the model of `step` at every length, showing progress; write and show the results.

    checkpoint: where the model is saved (for the message of a NaN evaluation).
    Returns this evaluation's rows and the results folder `eval_step<step>`,
    which then holds them merged with its earlier rows (`merge_rows`).
    Raises NonFiniteEvaluationError, writing nothing, when a loss is NaN or infinite.
    """
    cfg, task = run.cfg, run.source.task
    lengths = ", ".join(str(length) for length in cfg.eval.lengths)
    say(f"Evaluating step {step} at lengths {lengths} ({cfg.eval.num_sequences} sequences each):")

    def show(row: dict[str, Any], seconds: float) -> None:
        shown = "  ".join(f"{name} {row[name]:.4f}" for name in TASK_COLUMNS[task])
        say(f"  length {row['length']}: {shown}  ({duration(seconds)})")

    stopped = (
        f"the evaluation of step {step} (nothing of it was written; {checkpoint} is untouched): "
        "run the same command again to evaluate it"
    )
    with runtime.activity(stopped):
        rows = evaluate_lengths(
            eval_step, params, run.source, cfg, run.mesh, step=step, on_length=show
        )
        check_evaluation(rows, step, checkpoint, getattr(eval_step, "measured", None))
        out_dir = results_dir(workdir, step)
        earlier = read_results(out_dir) if (out_dir / RESULTS_CSV).exists() else []
        merged = merge_rows(earlier, rows)
        if earlier:
            before, now = {row["length"] for row in earlier}, {row["length"] for row in rows}
            kept, replaced = sorted(before - now), sorted(before & now)
            say(
                f"Merged into {out_dir / RESULTS_CSV}: "
                + "; ".join(
                    [f"earlier rows kept at lengths {kept}"] * bool(kept)
                    + [f"rows replaced by this evaluation's at lengths {replaced}"] * bool(replaced)
                )
                + "."
            )
        if jax.process_index() == 0:
            write_results_atomically(merged, out_dir, task=task)
    show_results(merged, out_dir, task=task)
    return rows, out_dir


def merge_rows(
    earlier: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """`earlier` and `new` result rows, one per (length, distance), `new` winning; by length."""
    by_key = {(row["length"], row["distance"]): row for row in earlier}
    by_key.update({(row["length"], row["distance"]): row for row in new})
    return [
        by_key[key] for key in sorted(by_key, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    ]


def write_results_atomically(
    rows: Sequence[dict[str, Any]], out_dir: epath.Path, *, task: str
) -> None:
    """write_results into a temporary sibling folder, then each file moved into `out_dir`, CSV last.

    A local folder is then never seen holding a part of the rows; on an object
    store (no rename) the files are written in place, the CSV last.
    """
    if is_uri(str(out_dir)):
        write_results(rows, out_dir, task=task)
        return
    staging = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    paths = write_results(rows, staging, task=task)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("png", "md", "csv"):
        os.replace(paths[name], out_dir / f"eval.{name}")
    shutil.rmtree(staging, ignore_errors=True)


def show_results(rows: Sequence[dict[str, Any]], out_dir: epath.PathLike, *, task: str) -> None:
    """The results table on the console, with where it is saved."""
    say(f"\n{epath.Path(out_dir) / 'eval.md'}:\n")
    say(markdown_table(rows, task=task))


def evaluate_checkpoint(
    config: TrainConfig | Any, workdir: str, step: int | None = None
) -> list[dict[str, Any]]:
    """Evaluate the checkpoint `step` (default: latest) of `workdir` at `cfg.eval.lengths`.

    config: a TrainConfig, or the ConfigDict to convert (checked in the same pass).
    Merges its rows into `<workdir>/eval_step<step>/eval.{csv,md,png}`
    (evaluate_and_report) and returns them. Holds the workdir's lock as an
    evaluation: waits for another evaluation, WorkdirBusy while training runs.
    Raises ConfigError before compiling anything when the config does not fit
    the machine or the workdir holds no checkpoint, and
    checkpoints.IncompatibleCheckpointError / CorruptCheckpointError for a
    checkpoint of other parameters or an unreadable or damaged one.
    """
    checked = checks.check_evaluation_run(config, workdir)
    cfg = checked.cfg
    runtime.enable_compilation_cache(cfg.runtime.compilation_cache_dir)  # before anything compiles
    with checkpoints.WorkdirLock(workdir, enabled=jax.process_index() == 0, role="evaluation"):
        run = set_up_run(cfg, source=checked.source)
        checkpointer = Checkpointer.for_run(cfg, workdir)
        step = checkpointer.latest_step() if step is None else step
        try:
            state = checkpoints.restore_compatible(
                cfg, checkpointer, run.layout.abstract, step, purpose="evaluate"
            )
        finally:
            checkpointer.close()
        rows, _ = evaluate_and_report(
            EvalStep(run),
            state["params"],
            run,
            workdir,
            step,
            str(checkpoints.checkpoint_path(checkpointer, step)),
        )
    return rows


def results_dir(workdir: str, step: int) -> epath.Path:
    """Where the evaluation of step `step` goes: `<workdir>/eval_step<step>` (merged, see
    evaluate_and_report)."""
    return epath.Path(workdir) / f"eval_step{step}"


def finished_results(workdir: str, step: int) -> epath.Path | None:
    """The folder of the whole evaluation of step `step` in `workdir` (the first one), or None."""
    path = epath.Path(workdir) / f"eval_step{step}"
    return path if (path / RESULTS_CSV).exists() else None


def read_results(out_dir: epath.PathLike) -> list[dict[str, Any]]:
    """The rows of a results folder's CSV, with their types (distance None where empty)."""
    rows = outputs.read_csv(epath.Path(out_dir) / RESULTS_CSV)
    for row in rows:
        if "r2_pooled" not in row:  # a CSV without this column holds the pooled R^2 under r2
            row["r2_pooled"], row["r2"] = row["r2"], "nan"
        for key in ("seed", "step", "length", "num_sequences"):
            row[key] = int(row[key])
        row["distance"] = int(row["distance"]) if row["distance"] else None
        for key in ("loss", "accuracy", "bits_per_byte", "r2", "r2_pooled"):
            row[key] = float(row[key])
    return rows


def write_results(
    rows: Sequence[dict[str, Any]], out_dir: epath.PathLike, *, task: str
) -> dict[str, epath.Path]:
    """PNG curve, markdown table and CSV of `rows` (of a source with `task`), the CSV last.

    Returns their paths.
    """
    out_dir = epath.Path(out_dir)
    paths = {name: out_dir / f"eval.{name}" for name in ("png", "md", "csv")}
    metric = TASK_COLUMNS[task][0]
    by_length = [row for row in rows if row["distance"] is None]
    labels = {"language_model": "loss (nats/byte)", "regression": "mean squared error"}
    outputs.plot_against_length(
        paths["png"],
        {
            rows[0]["method"]: (
                [row["length"] for row in by_length],
                [row[metric] for row in by_length],
                None,
            )
        },
        ylabel=labels.get(task, metric),
        size=(5, 3.5),
    )
    outputs.write_text(paths["md"], markdown_table(rows, task=task))
    outputs.write_csv(paths["csv"], rows, CSV_COLUMNS)
    return paths


def markdown_table(rows: Sequence[dict[str, Any]], *, task: str) -> str:
    """Rows as a markdown table, plus the mean over lengths (the paper's LM summary).

    Rows at chosen distances follow in a second table, one line per length and distance.
    """
    columns = ("length",) + TASK_COLUMNS[task]
    by_length = [row for row in rows if row["distance"] is None]
    means = {column: np.mean([row[column] for row in by_length]) for column in columns[1:]}
    cells = [[outputs.format_cell(row[column]) for column in columns] for row in by_length]
    cells.append(["mean"] + [outputs.format_cell(means[column]) for column in columns[1:]])
    title = (
        f"method: {rows[0]['method']}, seed: {rows[0]['seed']}, step: {rows[0]['step']}, "
        f"{rows[0]['num_sequences']} sequences per length"
    )
    text = f"{title}\n\n" + outputs.markdown_table(columns, cells)
    at_distance = [row for row in rows if row["distance"] is not None]
    if at_distance:
        columns = ("length", "distance") + TASK_COLUMNS[task]
        cells = [[outputs.format_cell(row[c]) for c in columns] for row in at_distance]
        text += "\nAt chosen distances:\n\n" + outputs.markdown_table(columns, cells)
    return text


def check_evaluation(
    rows: Sequence[Mapping[str, Any]],
    step: int,
    checkpoint: str,
    measured: damping.MeasuredDamping | None = None,
) -> None:
    """NonFiniteEvaluationError naming the lengths whose loss is NaN or infinite, if any.

    rows: evaluation rows ('length', 'loss'); checkpoint: where the evaluated
    model is; measured: its damping (EvalStep.measured), named first where it
    passed model.max_damping.
    """
    bad = [f"{row['length']} ({row['loss']})" for row in rows if not math.isfinite(row["loss"])]
    if bad:
        raise NonFiniteEvaluationError(
            f"The evaluation of step {step} ({checkpoint}) gave a non-finite loss at length "
            f"{', '.join(bad)}; no results were written. {damping.diagnosis(measured)}"
            + ("The model has diverged: " if not damping.diagnosis(measured) else "Otherwise: ")
            + "train again from an earlier checkpoint with a lower opt.learning_rate."
        )
