"""The sharded train step and the training loop, with preemption and the non-finite policy.

`make_train_step` builds one pure `train_step(state, batch) -> (state,
metrics)`, jitted once with the state's shardings in and out and the state
donated. `train_and_evaluate` is the whole run: every check in one pass
(jrope.train.checks), the workdir's lock, data source, mesh, sharded
initialisation or automatic resume from the latest checkpoint (checked
against its digests), the start record, the loop with periodic checkpoints
and evaluations, a final checkpoint and evaluation, and on the console the
compile time, the progress, the results and where every output went. A
finished run is not run again and its results are never rewritten. A storage
failure (disk full) ends the run with a RunIOError naming the path, the
cause and the last good checkpoint.

The step is a pure function of (state, batch): the data are a pure function
of the step, and dropout's randomness is the seed folded with the step, so a
resumed run reproduces an uninterrupted one.

Non-finite steps (`opt.nonfinite`): 'stop' (default) lets the host read every
step's metrics one step late (jrope.train.outputs) and raise
NonFiniteLossError naming the step, the metric and the last good checkpoint;
the pending step is read before every save, so no checkpoint holds a state
made by a non-finite step. 'skip' keeps the previous parameters and optimizer
state inside the jitted step (a select on a device-side flag: no host round
trip, no recompilation); the step counter still advances, so the data move
on exactly as in an uninterrupted run, and the metric 'skipped' marks such
steps until opt.max_consecutive_skips come in a row.

Preemption: schedulers send SIGTERM before they take a machine, and a person
at the console presses Ctrl-C (SIGINT). The loop asks
`PreemptionWatch.reached(step)` once per step; on True it saves that step,
waits for the write and raises TrainingPreempted (status 143, or 130 for
Ctrl-C); the next start resumes there. One process: the handler only sets a
flag (a handler runs between two bytecodes, possibly inside a JAX call or a
checkpoint write); a second Ctrl-C stops at once (jrope.train.runtime). Several: JAX's
coordination service catches SIGTERM on every host and agrees on a step all
reach (`multihost_utils.reached_preemption_sync_point`); no Python handler is
installed then, it would replace the service's own.

Shape legend: B batch, T length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

import jax
import jax.numpy as jnp
import optax
from etils import epath
from jax.experimental import multihost_utils

from jrope.errors import NonFiniteLossError, RunIOError, TrainingPreempted
from jrope.train import checkpoints, checks, damping, evaluation, outputs, runtime, setup
from jrope.train.checkpoints import Checkpointer, WorkdirLock, describe_holder
from jrope.train.config import TrainConfig, flatten_dict
from jrope.train.outputs import (
    CHECKED_METRICS,
    METRICS_FILE,
    SKIPPED_METRIC,
    MetricsLogger,
    Throughput,
    duration,
    say,
)
from jrope.train.runtime import step_compiler_options
from jrope.train.setup import (
    RunSetup,
    learning_rate_schedule,
    model_from_params,
    model_io,
    set_up_run,
)


class PreemptionWatch:
    """Context manager answering, once per step, whether to checkpoint and stop.

    Use as `with PreemptionWatch() as watch: ... if watch.reached(step): ...`.
    Every process must call `reached` at every step, from the same first step.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None  # the signal that asked to stop
        self._previous_handlers: dict[int, Any] = {}
        self._multiprocess = False

    def __enter__(self) -> PreemptionWatch:
        self._multiprocess = jax.process_count() > 1
        # signal.signal works only in the main thread; elsewhere (a library
        # caller's worker thread) the signals keep their default action.
        if not self._multiprocess and threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc_info) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    def reached(self, step: int) -> bool:
        """Whether `step` is the step at which to save and stop."""
        if self._multiprocess:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = signal.SIGTERM
        return self.signum is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        del frame
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.signum = signum


def keep_previous_if_nonfinite(
    previous: dict[str, Any], updated: dict[str, Any], metrics: dict[str, jax.Array]
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Inside jit: `updated` if the step is finite, else `previous` with the step counter advanced.

    Args:
      previous, updated: train states {'step', 'params', 'opt_state'} before and after the update.
      metrics: the step's scalar metrics, holding CHECKED_METRICS.
    Returns:
      (state, metrics with SKIPPED_METRIC = 1.0 when the update was dropped).
    """
    finite = jnp.all(jnp.stack([jnp.isfinite(metrics[name]) for name in CHECKED_METRICS]))

    def select(new: jax.Array, old: jax.Array) -> jax.Array:
        return jnp.where(finite, new, old)

    state = {
        "step": updated["step"],
        "params": jax.tree.map(select, updated["params"], previous["params"]),
        "opt_state": jax.tree.map(select, updated["opt_state"], previous["opt_state"]),
    }
    return state, {**metrics, SKIPPED_METRIC: 1.0 - finite.astype(jnp.float32)}


# Dropout keys come from their own stream of the seed, apart from the
# initialisation's (nnx.Rngs folds small counters into the same seed).
_DROPOUT_STREAM = 0x64726F70  # 'drop'

TrainStep = Callable[
    [dict[str, Any], dict[str, jax.Array]], tuple[dict[str, Any], dict[str, jax.Array]]
]


def make_train_step(
    run: RunSetup,
    *,
    compiler_options: dict[str, Any] | None = None,
    measured: damping.MeasuredDamping | None = None,
) -> TrainStep:
    """The jitted train step of `run` for global batches of `run.cfg.batch_size` rows.

    measured: the damping its layers plan for where it passed model.max_damping
    (jrope.train.damping.follow gives the run's graphdef for it).

    Compiled with jrope.train.runtime (on CPU, without XLA's library
    fusions unless the attention is blockwise); `compiler_options` replaces
    them ({}: XLA's defaults, as benchmarks/train_step.py compares).

    Batch: 'inputs', 'targets' and 'weights' [B, T] (the data-source
    contract, jrope.data.source; regression inputs and targets [B, T, C]).
    Metrics: 'loss' (weighted mean cross-entropy, or the mean squared error
    for regression), 'accuracy' (or 'r2' and 'r2_pooled' for regression), 'grad_norm'
    (before clipping) and 'learning_rate' of the step just taken; with
    opt.nonfinite = 'skip' also 'skipped' (`keep_previous_if_nonfinite`).
    """
    cfg, layout, mesh = run.cfg, run.layout, run.mesh
    task, num_classes = run.source.task, run.source.num_classes
    schedule = learning_rate_schedule(cfg.opt, cfg.num_steps)
    optimizer = layout.optimizer

    def train_step(state, batch):
        positions = jnp.arange(batch["inputs"].shape[1], dtype=jnp.int32)
        dropout_key = None
        if cfg.model.dropout_rate > 0.0:
            stream = jax.random.fold_in(jax.random.key(cfg.seed), _DROPOUT_STREAM)
            dropout_key = jax.random.fold_in(stream, state["step"])

        def loss_fn(params):
            model = model_from_params(layout.graphdef, params)
            outputs = model(batch["inputs"], positions, dropout_key=dropout_key)
            sums = evaluation.task_sums(outputs, batch, task, num_classes)
            return sums["loss_sum"] / sums["weight_sum"], sums

        (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {
            **evaluation.metrics_from_sums(sums, task),
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": schedule(state["step"]),
        }
        updated = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if cfg.opt.nonfinite == "skip":
            return keep_previous_if_nonfinite(state, updated, metrics)
        return updated, metrics

    batch_sharding = setup.batch_sharding(cfg.batch_size, cfg.mesh.rules, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if compiler_options is None:
        platform = mesh.devices.flat[0].platform
        kernel = damping.kernel(cfg, cfg.pe.train_context, platform, measured)
        compiler_options = step_compiler_options(blockwise=kernel == "blockwise", platform=platform)
    return jax.jit(
        train_step,
        in_shardings=(layout.shardings, batch_sharding),
        out_shardings=(layout.shardings, replicated),
        donate_argnums=0,
        compiler_options=compiler_options,
    )


def train_and_evaluate(config: TrainConfig | Mapping[str, Any], workdir: str) -> dict[str, Any]:
    """Train for `num_steps` (resuming from `workdir` if it holds checkpoints), then evaluate.

    config: a TrainConfig, or the ConfigDict to convert (checked in the same pass).
    Returns the final train state and the final evaluation rows:
    {'state': ..., 'eval': [row per length]}. A finished run (its last
    checkpoint and final results present) is not run again: its checkpoint is
    restored (and so checked) and its results read back, nothing written.

    Raises:
      ConfigError (DataError): the config does not fit itself, the machine,
        the workdir or the data (before anything is built).
      WorkdirBusy: another run holds the workdir.
      CorruptCheckpointError, IncompatibleCheckpointError: the checkpoint to resume from.
      TrainingPreempted: SIGTERM or SIGINT arrived; the current step was checkpointed.
      NonFiniteLossError: a step's loss or gradient norm was NaN/Inf (opt.nonfinite =
        'stop'), or too many steps in a row were ('skip'); NonFiniteEvaluationError.
      RunIOError: the storage failed (disk full, ...); the last good checkpoint is named.
    """
    checked = checks.check_training_run(config, workdir)
    cfg = checked.cfg
    runtime.enable_compilation_cache(cfg.runtime.compilation_cache_dir)  # before anything compiles
    with WorkdirLock(workdir, enabled=jax.process_index() == 0) as lock:
        if lock.previous_holder is not None:
            say(
                f"Taking over {lock.path} from {describe_holder(lock.previous_holder)}, "
                "which ended without releasing it."
            )
        run = set_up_run(cfg, source=checked.source)
        checkpointer = Checkpointer.for_run(cfg, workdir)
        try:
            return _run(run, checkpointer, workdir)
        except Exception as error:
            failure = runtime.find_io_failure(error)
            if failure is None or isinstance(error, RunIOError):
                raise
            raise RunIOError(*failure, checkpoints.describe_latest(checkpointer)) from error
        finally:
            # Also on errors: an in-flight save finishes (the last good checkpoint), none is
            # left half-written.
            checkpointer.close()


def _run(run: RunSetup, checkpointer: Checkpointer, workdir: str) -> dict[str, Any]:
    cfg, mesh = run.cfg, run.mesh
    devices = list(mesh.devices.flat)
    say(
        f"Training {cfg.pe.name} (seed {cfg.seed}) for {cfg.num_steps} steps; mesh "
        f"{dict(mesh.shape)} over {mesh.size} {devices[0].device_kind} devices, "
        f"{jax.process_count()} process(es); workdir {workdir}"
    )
    state = checkpoints.restore_or_initialize(
        cfg, checkpointer, run.layout.abstract, run.init_state
    )
    start = int(jax.device_get(state["step"]))
    finished = evaluation.finished_results(workdir, cfg.num_steps)
    if start == cfg.num_steps and finished is not None:
        say(
            f"This run is finished: step {start} is trained and evaluated. Its results are left as "
            "they are; to evaluate it again (other lengths, more sequences), run eval.py, which "
            "writes a new folder."
        )
        rows = evaluation.read_results(finished)
        evaluation.show_results(rows, finished, task=run.source.task)
        return {"state": state, "eval": rows}
    if jax.process_index() == 0:
        outputs.append_start_record(workdir, outputs.start_record(cfg, start))
    logger = MetricsLogger(
        workdir,
        every_steps=cfg.log.every_steps,
        num_steps=cfg.num_steps,
        tensorboard=cfg.log.tensorboard,
        last_checkpoint=lambda: checkpoints.describe_last_good(
            checkpointer, logger.skip_streak_start
        ),
        is_writer=jax.process_index() == 0,
        start_step=start,
        throughput=Throughput.for_run(cfg, model_io(run.source), devices),
        max_consecutive_skips=cfg.opt.max_consecutive_skips,
        skip_progress=checkpointer.restore_json(checkpoints.PROGRESS_ITEM, start)
        if start
        else None,
    )
    if start == 0:
        logger.write_hparams(
            flatten_dict(cfg.to_json_dict()),
            ["train/loss"] + [f"eval_{length}/loss" for length in cfg.eval.lengths],
        )
    eval_step = evaluation.EvalStep(run)

    def evaluate(state, step: int) -> tuple[list[dict[str, Any]], epath.Path]:
        logger.flush()
        rows, out_dir = evaluation.evaluate_and_report(
            eval_step,
            state["params"],
            run,
            workdir,
            step,
            str(checkpoints.checkpoint_path(checkpointer, step)),
        )
        for name, scalars in evaluation.logged_scalars(rows, run.source.task):
            logger.write_scalars(step, scalars, name)
        return rows, out_dir

    state = _train_steps(run, state, start, checkpointer, logger, evaluate, workdir)
    with runtime.activity(
        f"the final evaluation of step {cfg.num_steps} (its checkpoint is saved; nothing of the "
        "evaluation was written): run the same command again to evaluate it"
    ):
        rows, out_dir = evaluate(state, cfg.num_steps)
    logger.close()
    checkpointer.wait_until_finished()
    _show_outputs(workdir, cfg, out_dir)
    return {"state": state, "eval": rows}


def _train_steps(
    run: RunSetup,
    state: dict[str, Any],
    start: int,
    checkpointer: Checkpointer,
    logger: MetricsLogger,
    evaluate: Callable[[dict[str, Any], int], Any],
    workdir: str,
) -> dict[str, Any]:
    """Steps `start + 1 .. num_steps` with their checkpoints and periodic evaluations."""
    cfg, source, mesh = run.cfg, run.source, run.mesh
    kernels = TrainKernel(run, state["params"])
    trace = runtime.StepTrace(workdir, cfg.runtime)
    with (
        jax.set_mesh(mesh),
        PreemptionWatch() as preemption,
        contextlib.closing(trace),
        kernels.diagnosing(),
    ):
        for step in range(start, cfg.num_steps):
            train_step = kernels.step
            local_batch = source.train_batch(step)
            batch = setup.global_batch(local_batch, cfg.mesh.rules, mesh)
            if step == start:
                say("Compiling the train step ...", end=" ")
                compile_started = time.perf_counter()
            trace.before_step(step)
            state, metrics = train_step(state, batch)  # returns once compiled and dispatched
            trace.after_step(step, state)
            if step == start:
                say(f"done in {duration(time.perf_counter() - compile_started)}.")
            done = step + 1
            logger.push(done, metrics)
            is_last = done == cfg.num_steps
            preempted = preemption.reached(done)
            if is_last or preempted or checkpointer.should_save(done):
                # never checkpoint a state whose loss is not yet known to be finite
                logger.flush()
                checkpointer.save(
                    done, state, force=is_last or preempted, progress=logger.skip_progress
                )
                kernels.follow(state["params"], done)
            if preempted:
                checkpointer.wait_until_finished()
                logger.close()
                raise TrainingPreempted(
                    done, checkpoints.checkpoint_path(checkpointer, done), preemption.signum
                )
            if cfg.eval.every_steps and done % cfg.eval.every_steps == 0 and not is_last:
                evaluate(state, done)
    return state


class TrainKernel:
    """The train step, kept on a kernel that survives the damping of the parameters.

    At the start and at every checkpoint `follow` reads the damping on the host
    (jrope.train.damping). Past model.max_damping (an encoding may start there:
    the bound then follows its own setting) it is said on the console; where
    the step's kernel would then overflow float32 at the training length (one
    map origin over it, or the blockwise kernel's blocks), the step changes to
    the blockwise kernel in blocks that carry the damping, recompiling (once
    for a single-origin kernel: a larger damping keeps the blockwise one, whose
    blocks shrink only by powers of two). `diagnosing` names a passed bound in
    a non-finite loss's message.
    """

    def __init__(self, run: RunSetup, params: Any):
        self._run = run
        self._platform = run.mesh.devices.flat[0].platform
        self.measured: damping.MeasuredDamping | None = None
        self._kernel = self._train_kernel(None)
        self.step = make_train_step(run)  # jitted lazily: nothing compiles before step 1
        self.follow(params, None)

    def follow(self, params: Any, step: int | None) -> None:
        """Reads the damping of `params` (after `step`; None: the starting state)."""
        cfg = self._run.cfg
        announced = self.measured is not None and self.measured.passed
        graphdef, measured = damping.follow(cfg, self._run.layout.graphdef, params)
        self.measured = measured
        if not measured.passed:
            return
        length = cfg.pe.train_context
        kernel = self._train_kernel(measured)
        if step is None:
            ran = (
                f"the train step runs the {self._describe(kernel)} at length {length}"
                if kernel != self._kernel
                else f"the train step's {kernel[0]!r} kernel is safe at length {length}"
            )
            say(
                f"The starting state: {measured.describe()}: the attention kernels follow this "
                f"damping instead of the bound (evaluations plan for it; {ran})."
            )
        elif kernel != self._kernel:
            say(
                f"Step {step}: {measured.describe()}; the train step's "
                f"{self._describe(self._kernel)} would overflow float32 at length {length}, so it "
                f"changes to the {self._describe(kernel)} (compiling it once more)."
            )
        elif not announced:
            say(
                f"Step {step}: {measured.describe()}; evaluations plan their kernels for it, and "
                f"the train step's {kernel[0]!r} kernel stays safe at length {length}."
            )
        if kernel == self._kernel:
            return
        layout = dataclasses.replace(self._run.layout, graphdef=graphdef)
        self.step = make_train_step(
            dataclasses.replace(self._run, layout=layout), measured=measured
        )
        self._kernel = kernel

    def _train_kernel(self, measured: damping.MeasuredDamping | None) -> tuple[str, int | None]:
        """(kernel, block size where blockwise) of the train step planned for `measured`."""
        cfg = self._run.cfg
        name = damping.kernel(cfg, cfg.pe.train_context, self._platform, measured)
        if name != "blockwise":
            return name, None
        return name, cfg.model.block_size if measured is None else measured.block_size

    @staticmethod
    def _describe(kernel: tuple[str, int | None]) -> str:
        name, block_size = kernel
        blocks = f" in blocks of {block_size}" if name == "blockwise" else ""
        return f"{name!r} kernel{blocks}"

    @contextlib.contextmanager
    def diagnosing(self):
        """Re-raises a NonFiniteLossError with the passed bound named first, where it was."""
        try:
            yield
        except NonFiniteLossError as error:
            note = damping.diagnosis(self.measured)
            if not note:
                raise
            raise type(error)(f"{note}{error}") from error


def _show_outputs(workdir: str, cfg: TrainConfig, results: epath.Path) -> None:
    """Where every output of the run went."""
    lines = [
        f"checkpoints/{cfg.num_steps}/  the trained state (resume; eval.py for other lengths)",
        f"{results.name}/  eval.md (above), eval.csv, eval.png",
        f"{METRICS_FILE}  training and evaluation metrics, one JSON object per line",
        f"{outputs.RECORD_FILE}  config, command line, versions and devices of each start",
    ]
    if cfg.log.tensorboard:
        lines.append(f"tensorboard/  event files: {outputs.tensorboard_command(workdir)}")
    say(f"Outputs in {workdir}:\n" + "\n".join(f"  {line}" for line in lines))
