"""The sharded train step and the training loop, with preemption and the non-finite policy.

Data and dropout keys are pure functions of the step, so a resumed run reproduces an uninterrupted
one. The host reads each step's metrics one step late and before every save, so no checkpoint holds
a non-finite step's state unnoticed. SIGTERM and Ctrl-C only set a flag: the loop saves its step
(a multi-process run's processes agree on it through orbax) and raises TrainingPreempted.
Shapes: B batch, T length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import traverse_util

from jrope import errors, flops, losses
from jrope.model import damping
from jrope.train import checkpoints, evaluation, outputs, runtime, setup
from jrope.train.config import TrainConfig
from jrope.train.outputs import MetricsLogger, first_nonfinite, say
from jrope.train.setup import RunSetup


class PreemptionWatch:
    """In the main thread of a single process, SIGTERM and Ctrl-C set `signum` instead of ending
    the process, once (a second one ends it); JAX's coordination service catches a multi-process
    run's SIGTERM. A signal that no save answered takes effect when the watch ends."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionWatch:
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            signals = (signal.SIGTERM, signal.SIGINT)
            self._previous = {s: signal.signal(s, self._on_signal) for s in signals}
        return self

    def __exit__(self, error_type, *_) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self.signum is not None and error_type is None:
            signal.raise_signal(self.signum)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signum
        signal.signal(signum, self._previous[signum])


# Dropout keys: their own stream of the seed (nnx.Rngs folds small counters into the same seed).
_DROPOUT_STREAM = 0x64726F70  # 'drop'


def make_train_step(run: RunSetup, *, plan=None, compiler_options=None) -> Callable:
    """The jitted train step of `run` for global batches of `run.batch_size` rows.

    plan: the kernels it compiles with (default: planned for model.max_damping alone).
    compiler_options: XLA's options ({}: its defaults); default runtime.step_compiler_options.
    Batch: 'inputs', 'targets', 'weights' [B, T] (regression inputs and targets [B, T, C]);
    packed rows add 'positions' and 'segment_ids' int32 [B, T].
    Metrics: 'loss', 'accuracy' (regression: 'r2', 'r2_pooled'), 'grad_norm' (before clipping),
    'learning_rate' of the step taken, and with optax.apply_if_finite (opt.nonfinite = 'skip')
    'skipped' (1.0: this update was dropped), 'skipped_steps' and 'skipped_in_a_row' (so far).
    """
    plan = plan or run.plan
    layout, mesh, optimizer = run.layout, run.mesh, run.layout.optimizer
    task, num_classes, schedule = run.source.task, run.source.num_classes, run.schedule

    def train_step(state, batch):
        inputs, segments = batch["inputs"], batch.get("segment_ids")
        # Packed batches carry positions restarting at each segment (jrope.data.text_bytes).
        positions = batch.get("positions", jnp.arange(inputs.shape[1], dtype=jnp.int32))
        dropout_key = None
        if run.dropout_rate > 0.0:
            stream = jax.random.fold_in(jax.random.key(run.seed), _DROPOUT_STREAM)
            dropout_key = jax.random.fold_in(stream, state["step"])

        def loss_fn(params):
            model = setup.model_from_params(plan.graphdef, params)
            outputs = model(inputs, positions, dropout_key=dropout_key, segment_ids=segments)
            sums = losses.task_sums(outputs, batch, task, num_classes)
            return sums["loss_sum"] / sums["weight_sum"], sums

        (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {
            **losses.metrics_from_sums(sums, task),
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state["step"]),
        }
        if isinstance(opt_state, optax.ApplyIfFiniteState):  # optax.apply_if_finite's counters
            metrics["skipped"] = 1.0 - opt_state.last_finite.astype(jnp.float32)
            metrics["skipped_steps"] = opt_state.total_notfinite
            metrics["skipped_in_a_row"] = opt_state.notfinite_count
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if compiler_options is None:
        blockwise = plan.kernel(run.train_length) == "blockwise"
        compiler_options = runtime.step_compiler_options(
            blockwise=blockwise, platform=plan.platform
        )
    return jax.jit(
        train_step,
        in_shardings=(layout.shardings, run.batch_sharding),
        out_shardings=(layout.shardings, replicated),
        donate_argnums=0,
        compiler_options=compiler_options,
    )


def train_and_evaluate(cfg: TrainConfig, workdir: str) -> dict[str, Any]:
    """Train for `num_steps` (resuming from `workdir`'s checkpoints), then evaluate: {'state': the
    final train state, 'eval': [row per length]}; a finished run is only restored and read. A
    damping learned past what the kernels planned before step 1 carry resumes with a new plan."""
    with contextlib.ExitStack() as held:
        run = setup.open_run(cfg, workdir, held, role="training")
        result = None
        while result is None:  # a damping beyond the kernel plan: plan again from its checkpoint
            result = _run(run, workdir)
        return result


def evaluate_checkpoint(cfg: TrainConfig, workdir: str, step: int | None = None) -> list[dict]:
    """The rows of every length of eval.lengths for checkpoint `step` (default: latest), evaluating
    those `eval_step<step>/` lacks, which join it and the run's logs. Under the workdir's lock as an
    evaluation (waits for another, WorkdirBusy while training runs)."""
    with contextlib.ExitStack() as held:
        run = setup.open_run(cfg, workdir, held, role="evaluation")
        asked = run.eval.lengths
        step = run.checkpointer.latest_step() if step is None else step
        out_dir = evaluation.results_dir(workdir, step)
        earlier = evaluation.readable_results(out_dir) or []
        missing = evaluation.lengths_to_evaluate(run.eval, run.compute_dtype, earlier, out_dir)
        state = checkpoints.restore_compatible(  # checked, also with nothing to evaluate
            run.checkpointer, run.layout.abstract, step, purpose="evaluate"
        )
        new = []
        if missing:
            run = dataclasses.replace(run, eval=dataclasses.replace(run.eval, lengths=missing))
            params, tensorboard, task = state["params"], run.tensorboard, run.source.task
            eval_step = evaluation.EvalStep(run, run.plan_kernels(params))
            evaluation.compile_lengths(eval_step, params, run)
            log = functools.partial(evaluation.log_evaluation, workdir, step, tensorboard, task)
            new = evaluation.evaluate_and_report(eval_step, params, run, workdir, step, log)
        else:
            say(f"{out_dir / evaluation.RESULTS_CSV} holds every length asked.")
            evaluation.show_results(earlier, out_dir, task=run.source.task)
    kept = [row for row in earlier if row["length"] in asked and row["length"] not in missing]
    return sorted(kept + new, key=lambda row: (row["length"], row["distance"] or -1))


def _run(run: RunSetup, workdir: str) -> dict[str, Any] | None:
    mesh, num_steps = run.mesh, run.num_steps
    say(
        f"Training {run.method} (seed {run.seed}) for {num_steps} steps; mesh "
        f"{dict(mesh.shape)} over {mesh.size} {mesh.devices.flat[0].device_kind} devices, "
        f"{jax.process_count()} process(es); workdir {workdir}"
    )
    if (latest := run.checkpointer.latest_step()) is None:
        state = run.init_state()
    else:
        say(f"Resuming from checkpoint {checkpoints.checkpoint_path(run.checkpointer, latest)}.")
        state = checkpoints.restore_compatible(run.checkpointer, run.layout.abstract, latest)
    start = int(jax.device_get(state["step"]))
    if start == num_steps and (rows := evaluation.finished_rows(workdir, start, run.source.task)):
        return {"state": state, "eval": rows}
    # A stop at an evaluation's step before its table was written: that evaluation is done again
    # (a finished run's final one always is: it has no readable table, or it returned above).
    every_eval, table = run.eval.every_steps, evaluation.results_dir(workdir, start)
    periodic = bool(every_eval and start and start % every_eval == 0)
    redo = start == num_steps or periodic and evaluation.readable_results(table) is None
    plan = run.plan_kernels(state["params"])  # the only plan: the loop compiles nothing else
    eval_step = evaluation.EvalStep(run, plan)
    evaluation.compile_lengths(eval_step, state["params"], run)  # refused before step 1
    logger = MetricsLogger(
        workdir,
        every_steps=run.log_every_steps,
        num_steps=num_steps,
        tensorboard=run.tensorboard,
        start_step=start,
        redo_step=start if redo else None,
        throughput=run.throughput,
    )
    if start == 0:
        logger.write_hparams(
            traverse_util.flatten_dict(run.config_json, sep="."),
            ["train/loss"] + [f"eval_{length}/loss" for length in run.eval.lengths],
        )
    if jax.process_index() == 0:
        outputs.append_start_record(workdir, outputs.start_record(run.config_json, start))

    def evaluate(state, step: int) -> list[dict[str, Any]]:
        logger.flush()
        log = functools.partial(evaluation.log_rows, logger, step, run.source.task)
        return evaluation.evaluate_and_report(eval_step, state["params"], run, workdir, step, log)

    with contextlib.closing(logger):
        if redo and start < num_steps:
            evaluate(state, start)
        state = _train_steps(run, plan, state, start, logger, evaluate, workdir)
        rows = None if state is None else evaluate(state, num_steps)
    return None if state is None else {"state": state, "eval": rows}


def _train_steps(run: RunSetup, plan, state, start: int, logger, evaluate, workdir: str):
    """Steps `start + 1 .. num_steps` with their checkpoints and periodic evaluations: the last
    state, or None at a checkpoint whose damping needs kernels that `plan` lacks."""
    checkpointer, num_steps, every_eval = run.checkpointer, run.num_steps, run.eval.every_steps
    train_step, measured = make_train_step(run, plan=plan), plan.measured
    pending = None  # (step, metrics) not yet read on the host

    def read_pending() -> None:
        nonlocal pending
        if pending is not None:
            step, metrics = pending
            pending = None
            values = {name: float(value) for name, value in jax.device_get(metrics).items()}
            stop_if_nonfinite(step, values, run.max_skips, checkpointer, measured)
            # 'skipped' and the streak decide above; the count of skipped updates is logged.
            streak = ("skipped", "skipped_in_a_row")
            logger.write_step(step, {k: v for k, v in values.items() if k not in streak})

    with (
        jax.set_mesh(run.mesh),
        PreemptionWatch() as preemption,
        contextlib.closing(runtime.StepTrace(workdir, run.profile_steps)) as trace,
    ):
        for step in range(start, num_steps):
            batch = run.global_batch(run.source.train_batch(step))
            if step == start:
                say("Compiling the train step ...", end=" ")
                compile_started = time.perf_counter()
                train_step = train_step.lower(state, batch).compile()
                what = f"batch_size = {run.batch_size}: the train step"  # refused before step 1
                flops.require_memory(train_step, what=what, fix="lower it, or add devices")
            trace.before_step(step)
            state, metrics = train_step(state, batch)
            trace.after_step(step, state)
            if step == start:
                say(f"done in {outputs.duration(time.perf_counter() - compile_started)}.")
                logger.restart_interval()
            read_pending()  # the previous step's, while this one runs
            done = step + 1
            pending = (done, metrics)
            is_last = done == num_steps
            # Every process asks at every step, from the same first step.
            if checkpointer.reached_preemption(done):
                preemption.signum = signal.SIGTERM
            if is_last or preemption.signum is not None or checkpointer.should_save(done):
                read_pending()  # never checkpoint a state whose loss is not known to be finite
                logger.flush()
                checkpointer.save(done, state, force=True)  # due, last or preempted
                path = checkpoints.checkpoint_path(checkpointer, done)
                if preemption.signum is not None:
                    checkpointer.wait_until_finished()
                    raise errors.TrainingPreempted(done, path, preemption.signum)
                measured = plan.measure(state["params"])
                if not plan.carries(measured):
                    say(f"Step {done}: {measured.describe()}; planning again from {path}.")
                    checkpointer.wait_until_finished()
                    return None
            if every_eval and done % every_eval == 0 and not is_last:
                read_pending()
                evaluate(state, done)
        read_pending()
        checkpointer.wait_until_finished()  # the last step is saved before the evaluation
    return state


def stop_if_nonfinite(step: int, values, max_in_a_row: int, checkpointer, measured=None) -> None:
    """NonFiniteError for a non-finite step's metrics `values` unless its update was skipped, or
    at `max_in_a_row` skipped in a row, naming the last good checkpoint (and a passed damping)."""
    bad, in_a_row = first_nonfinite(values), int(values.get("skipped_in_a_row", 0))
    if values.get("skipped"):
        skipped = values["skipped_steps"]
        logging.warning("Step %d: %s is %s; skipped (%d in all).", step, *bad, skipped)
    if bad is None or "skipped" in values and in_a_row < max_in_a_row:
        return
    if "skipped" in values:
        # Checkpoints from step `first` - 1 on hold the parameters that give the non-finite steps.
        first = step - in_a_row + 1
        last_good = checkpoints.describe_last_good(checkpointer, before=first - 1)
        message = (
            f"Steps {first} to {step} skipped ({bad[0]} not finite): resume from {last_good}, "
            "later ones moved aside, at a lower opt.learning_rate."
        )
    else:
        last_good = checkpoints.describe_last_good(checkpointer)
        message = (
            f"{bad[0]} is {bad[1]} at step {step}; resume from {last_good} at a lower "
            "opt.learning_rate (or opt.nonfinite=skip)."
        )
    raise damping.diagnosed(errors.NonFiniteError(message), measured)
