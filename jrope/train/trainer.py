"""The sharded train step and the training loop.

`make_train_step` builds one pure `train_step(state, batch) -> (state,
metrics)`, jitted once with the state's shardings in and out and the state
donated (its buffers are reused for the next state). `train_and_evaluate`
is the whole run: config checks, data source, mesh, sharded initialisation
or automatic resume from the workdir's latest checkpoint, the loop with
periodic checkpoints and evaluations, a final checkpoint and evaluation.
On SIGTERM the loop checkpoints the current step and raises
TrainingPreempted (jrope.train.preemption); the next start resumes there.

The step is a pure function of (state, batch): the data are a pure function
of the step, and the step's randomness (dropout, when model.dropout_rate > 0)
comes from the seed folded with the step, so a resumed run reproduces an
uninterrupted one.

Shape legend: B batch, T length.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from absl import logging

from jrope.attention import choose_kernel
from jrope.train import evaluation, nonfinite, resume, sharding, validation
from jrope.train.checkpointing import Checkpointer
from jrope.train.compile_options import step_compiler_options
from jrope.train.config import TrainConfig
from jrope.train.metrics import MetricsLogger
from jrope.train.preemption import PreemptionWatch, TrainingPreempted
from jrope.train.setup import RunSetup, set_up_run
from jrope.train.state import learning_rate_schedule, model_from_params

# Dropout keys come from their own stream of the seed, apart from the
# initialisation's (nnx.Rngs folds small counters into the same seed).
_DROPOUT_STREAM = 0x64726F70  # 'drop'

TrainStep = Callable[
    [dict[str, Any], dict[str, jax.Array]], tuple[dict[str, Any], dict[str, jax.Array]]
]


def make_train_step(
    run: RunSetup, *, donate: bool = True, compiler_options: dict[str, Any] | None = None
) -> TrainStep:
    """The jitted train step of `run` for global batches of `run.cfg.batch_size` rows.

    Compiled with jrope.train.compile_options (on CPU, without XLA's library
    fusions unless the attention is blockwise); `compiler_options` replaces
    them ({}: XLA's defaults, as benchmarks/train_step.py compares).

    Batch: 'inputs', 'targets' and 'weights' [B, T] (the data-source
    contract, jrope.data.source; regression inputs and targets [B, T, C]).
    Metrics: 'loss' (weighted mean cross-entropy, or the mean squared error
    for regression), 'accuracy' (or 'r2' for regression), 'grad_norm'
    (before clipping) and 'learning_rate' of the step just taken; with
    opt.nonfinite = 'skip' also 'skipped' (jrope.train.nonfinite).
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
            return nonfinite.keep_previous_if_nonfinite(state, updated, metrics)
        return updated, metrics

    batch_sharding = sharding.batch_sharding(cfg.batch_size, cfg.mesh.rules, mesh)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    if compiler_options is None:
        platform = mesh.devices.flat[0].platform
        kernel = choose_kernel(
            cfg.model,
            has_bias=cfg.encoding.has_bias,
            length=cfg.pe.train_context,
            backend=platform,
        )
        compiler_options = step_compiler_options(blockwise=kernel == "blockwise", platform=platform)
    return jax.jit(
        train_step,
        in_shardings=(layout.shardings, batch_sharding),
        out_shardings=(layout.shardings, replicated),
        donate_argnums=0 if donate else (),
        compiler_options=compiler_options,
    )


def train_and_evaluate(cfg: TrainConfig, workdir: str) -> dict[str, Any]:
    """Train for `cfg.num_steps` (resuming from `workdir` if it holds checkpoints), then evaluate.

    Returns the final train state and the final evaluation rows:
    {'state': ..., 'eval': [row per length]}.

    Raises:
      validation.ConfigError: the config does not fit itself or the machine (before any compilation).
      TrainingPreempted: SIGTERM arrived; the current step was checkpointed.
      NonFiniteLossError: a step's loss or gradient norm was NaN/Inf (opt.nonfinite = 'stop').
    """
    validation.check_training_run(cfg, workdir)
    run = set_up_run(cfg)
    source, mesh = run.source, run.mesh
    logging.info(
        "Mesh %s over %d devices, %d processes.", dict(mesh.shape), mesh.size, jax.process_count()
    )
    checkpointer = Checkpointer.for_run(cfg, workdir)
    state = resume.restore_or_initialize(cfg, checkpointer, run.layout.abstract, run.init_state)
    train_step = make_train_step(run)
    eval_step = evaluation.EvalStep(run)
    logger = MetricsLogger(
        workdir,
        every_steps=cfg.log.every_steps,
        num_steps=cfg.num_steps,
        tensorboard=cfg.log.tensorboard,
        last_checkpoint=lambda: resume.describe_latest(checkpointer),
        is_writer=jax.process_index() == 0,
    )

    def run_evaluation(step: int) -> list[dict[str, Any]]:
        rows = evaluation.evaluate_lengths(eval_step, state["params"], source, cfg, mesh)
        for name, scalars in evaluation.logged_scalars(rows, source.task):
            logger.write_scalars(step, scalars, name)
        if jax.process_index() == 0:
            evaluation.write_results(rows, evaluation.results_dir(workdir, step), task=source.task)
        return rows

    start = int(jax.device_get(state["step"]))
    try:
        with jax.set_mesh(mesh), PreemptionWatch() as preemption:
            for step in range(start, cfg.num_steps):
                local_batch = source.train_batch(step)
                evaluation.check_readout(local_batch, cfg.model.readout)
                batch = sharding.global_batch(local_batch, cfg.mesh.rules, mesh)
                state, metrics = train_step(state, batch)
                done = step + 1
                logger.push(done, metrics)
                is_last = done == cfg.num_steps
                preempted = preemption.reached(done)
                if is_last or preempted or checkpointer.should_save(done):
                    # never checkpoint a state whose loss is not yet known to be finite
                    logger.flush()
                    checkpointer.save(done, state, force=is_last or preempted)
                if preempted:
                    checkpointer.wait_until_finished()
                    logger.close()
                    raise TrainingPreempted(done, resume.checkpoint_path(checkpointer, done))
                if cfg.eval.every_steps and done % cfg.eval.every_steps == 0 and not is_last:
                    logger.flush()
                    run_evaluation(done)
    finally:
        # Also on errors: an in-flight save finishes (the last good checkpoint), none is left half-written.
        checkpointer.wait_until_finished()
    logger.flush()
    final_rows = run_evaluation(cfg.num_steps)
    logger.close()
    checkpointer.wait_until_finished()
    checkpointer.close()
    return {"state": state, "eval": final_rows}
