"""Model-FLOP utilisation (MFU) of the jitted train step against a measured matmul peak.

For each shape and encoding: the model FLOPs of one train step, counted
analytically from the config (`jrope.flops.model_flops_per_step`), divided by the
measured step time, over the best float32 matmul throughput measured on this
machine in the same process. Two shapes, one device:

  wikitext  the v1 WikiText shape (configs/wikitext_scaled_exact.py): d_model
            384, 6 heads, 6 layers, MLP 4x, L 1024, batch 4, byte vocabulary
            257, logits at every position (readout 'all').
  synthetic the synthetic CPU shape (configs/synthetic_cpu.py): d_model 128,
            4 heads, 3 layers, MLP 2x, L 256, batch 24, vocabulary 3, logits
            at the last position only (readout 'last').

The step is the project's own (jrope.train.setup, jrope.train.trainer.make_train_step):
forward, backward, AdamW with clipping, state donated. The WikiText step runs
on random bytes, so the corpus need not be present (a step's cost does not
depend on which bytes it sees); the synthetic step runs on the task's batches.

Timing: every (shape, method) step is compiled and warmed up first, then all
are timed side by side in interleaved rounds (machines are shared and noisy:
only numbers measured together mean much); step times are the median over
rounds. The peak is the best float32 `jnp.dot` throughput over the sizes,
measured before the first round and after the last: the first program run
after these matmuls (compiled with XLA's library fusions, which the train steps
are not) is slowed, and one RoPE program timed in the first and the last
slot of each round at the WikiText shape ran 30 to 50 % (median 44 %) slower
in the slot right after them. So an untimed round comes first, and each round
opens with an untimed run of its first step.

    python benchmarks/mfu.py                    # both shapes, rope and jordan_exact_scaled
    python benchmarks/mfu.py --shapes=synthetic --methods=rope,jordan_rope
    python benchmarks/mfu.py --shapes=wikitext --batch_size=1 --rounds=3
    python benchmarks/mfu.py --compute_dtype=bfloat16 --remat=full

--steps=0 (the default) times as many steps per round as fill about a
second (at least 2). The WikiText shape is slow on a 2-core CPU: at its batch
of 4 a step took 6.5 to 8 s on the loaded development machine, and the
default run about 5 minutes. --batch_size (it applies to every chosen shape)
and --shapes keep a run short.

Columns: model GFLOP per step (dense: every projection, MLP and readout
matmul; attention: the score and value matmuls over the causal half),
XLA's own count for the compiled step (`cost_analysis()['flops']`, which also
counts elementwise work, the optimizer, any rematerialised forward, and the
attention logits the kernel actually forms: all T x T of them for 'xla',
5/8 for the 4-block 'einsum' kernel), ms/step, achieved model GFLOP/s, the
measured peak, and MFU = achieved / peak. The peak is the float32 matmul's
(docs/performance.md, Yardsticks).
"""

import math
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from benchmarks.random_bytes import RandomBytes
from configs import synthetic_cpu, wikitext_scaled_exact
from jrope.flops import model_flops_per_step
from jrope.model.config import ATTENTION_IMPLS
from jrope.train import runtime, setup
from jrope.train.config import TrainConfig
from jrope.train.setup import RunSetup, model_io, set_up_run
from jrope.train.trainer import make_train_step

SHAPES = {"wikitext": wikitext_scaled_exact, "synthetic": synthetic_cpu}

_SHAPES = flags.DEFINE_list("shapes", list(SHAPES), f"Shapes to measure: any of {sorted(SHAPES)}.")
_METHODS = flags.DEFINE_list("methods", ["rope", "jordan_exact_scaled"], "Encodings to time.")
_DTYPE = flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Activation dtype.")
_REMAT = flags.DEFINE_enum("remat", "none", ["none", "full", "dots_saveable"], "Block remat.")
_IMPL = flags.DEFINE_enum("attention_impl", "auto", list(ATTENTION_IMPLS), "Attention kernel.")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Batch of every shape (0: the config's).")
_STEPS = flags.DEFINE_integer("steps", 0, "Timed steps per run and round (0: about 1 s).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (the median is reported).")
_PEAK_SIZES = flags.DEFINE_list("peak_sizes", ["1024", "2048", "4096"], "n of the n^3 matmuls.")

# --steps=0: time this many seconds of steps per run and round (at least 2 steps).
_AUTO_STEP_SECONDS = 1.0


def _train_config(shape: str, method: str) -> TrainConfig:
    config = SHAPES[shape].get_config()
    config.pe.name = method
    config.model.compute_dtype = _DTYPE.value
    config.model.remat = _REMAT.value
    config.model.attention_impl = _IMPL.value
    config.mesh.data = 1
    if _BATCH.value:
        config.batch_size = _BATCH.value
    return TrainConfig.from_config_dict(config)


def _set_up(cfg: TrainConfig) -> RunSetup:
    """The run on one device; byte-level text runs on random bytes."""
    source = None if cfg.data.source == "synthetic" else RandomBytes(cfg)
    return set_up_run(cfg, devices=jax.devices()[:1], source=source)


def _prepare(shape: str, method: str) -> dict:
    """The compiled, warmed-up train step of (shape, method), its state, batches and FLOPs."""
    cfg = _train_config(shape, method)
    run = _set_up(cfg)
    mesh = run.mesh
    state = run.init_state()
    with jax.set_mesh(mesh):
        batches = [
            setup.global_batch(run.source.train_batch(i), cfg.mesh.rules, mesh) for i in range(2)
        ]
        # Compiled once, ahead of time: the executable that is timed is the one XLA's count is of.
        step_fn = make_train_step(run).lower(state, batches[0]).compile()
        cost = step_fn.cost_analysis()
        state, metrics = step_fn(state, batches[0])  # warm up
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        state, metrics = step_fn(state, batches[1])
        jax.block_until_ready(metrics)
        first = time.perf_counter() - start
    if isinstance(cost, (list, tuple)):  # older jax: one dict per executable
        cost = cost[0]
    steps = _STEPS.value or max(2, math.ceil(_AUTO_STEP_SECONDS / first))
    return {
        "cfg": cfg,
        "mesh": mesh,
        "state": state,
        "step_fn": step_fn,
        "batches": batches,
        "steps": steps,
        "flops": model_flops_per_step(
            cfg.model, cfg.batch_size, cfg.pe.train_context, **model_io(run.source)
        ),
        "xla_flops": float(cost.get("flops", float("nan"))),
    }


def _time_steps(run: dict) -> float:
    """Seconds per step over run['steps'] steps (data already on device)."""
    state = run["state"]
    with jax.set_mesh(run["mesh"]):
        start = time.perf_counter()
        for i in range(run["steps"]):
            state, metrics = run["step_fn"](state, run["batches"][i % 2])
        jax.block_until_ready((state, metrics))
        elapsed = time.perf_counter() - start
    run["state"] = state
    return elapsed / run["steps"]


def _matmuls(sizes: list[int]) -> dict[int, tuple]:
    """Jitted float32 n x n matmuls with their operands, compiled and warmed up."""
    matmuls = {}
    for n in sizes:
        keys = jax.random.split(jax.random.PRNGKey(n))
        a, b = (jax.random.normal(key, (n, n), jnp.float32) for key in keys)
        fn = jax.jit(jnp.dot)
        fn(a, b).block_until_ready()
        matmuls[n] = (fn, a, b)
    return matmuls


def _peak_gflops(matmuls: dict[int, tuple], repeats: int = 3) -> float:
    """Best GFLOP/s of the float32 matmuls now (best of `repeats` per size)."""
    best = 0.0
    for n, (fn, a, b) in matmuls.items():
        for _ in range(repeats):
            start = time.perf_counter()
            fn(a, b).block_until_ready()
            best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


def main(argv):
    del argv
    unknown = sorted(set(_SHAPES.value) - set(SHAPES))
    if unknown:
        raise app.UsageError(f"Unknown shapes {unknown}; choose from {sorted(SHAPES)}.")
    runs = {
        (shape, method): _prepare(shape, method)
        for shape in _SHAPES.value
        for method in _METHODS.value
    }
    matmuls = _matmuls([int(n) for n in _PEAK_SIZES.value])
    times = {key: [] for key in runs}
    peaks = [_peak_gflops(matmuls)]
    for run in runs.values():  # an untimed round first: see the module docstring
        _time_steps(run)
    first = next(iter(runs.values()))
    for _ in range(_ROUNDS.value):
        _time_steps(first)  # untimed: see the module docstring
        for key, run in runs.items():
            times[key].append(_time_steps(run))
    peaks.append(_peak_gflops(matmuls))
    peak = max(peaks)
    print(
        f"MFU of the train step; {_DTYPE.value}, remat {_REMAT.value}, attention {_IMPL.value}; "
        f"median of {_ROUNDS.value} interleaved rounds; {jax.devices()[0].device_kind}; peak: best "
        f"float32 n^3 matmul, n in {','.join(_PEAK_SIZES.value)}: {peak:.0f} GFLOP/s "
        f"(before the rounds {peaks[0]:.0f}, after {peaks[1]:.0f}); "
        f"host allocator {runtime.host_allocator()}"
    )
    print(
        "| shape | method | batch x L | model GFLOP/step | dense | attention | XLA GFLOP/step | "
        "steps x rounds | ms/step | achieved GFLOP/s | peak GFLOP/s | MFU % |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (shape, method), run in runs.items():
        cfg, flops = run["cfg"], run["flops"]
        seconds = statistics.median(times[shape, method])
        achieved = flops["total"] / seconds / 1e9
        cells = [
            shape,
            method,
            f"{cfg.batch_size} x {cfg.pe.train_context}",
            *(f"{flops[part] / 1e9:.2f}" for part in ("total", "dense", "attention")),
            f"{run['xla_flops'] / 1e9:.2f}",
            f"{run['steps']} x {_ROUNDS.value}",
            f"{1000 * seconds:.1f}",
            f"{achieved:.0f}",
            f"{peak:.0f}",
            f"{100 * achieved / peak:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    app.run(main)
