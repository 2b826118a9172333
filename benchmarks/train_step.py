"""Speed of the jitted train step at the synthetic CPU config, per encoding.

d_model 128, 4 heads, 3 layers, mlp 2, L 256, batch 24 (configs/synthetic_cpu.py),
one device. The methods are timed side by side in one process, in
interleaved rounds (machines are shared and noisy: only ratios measured
together mean much), and reported as the median over rounds.

    python benchmarks/train_step.py                      # float32
    python benchmarks/train_step.py --compute_dtype=bfloat16 --remat=full

Prints ms/step, steps/s, tokens/s, the ratio of each method's step time to
RoPE's, and the speed-up over the paper's PyTorch reference (195 ms/step for
RoPE at this config on a 2-core CPU, performance.md). A plain matmul timed in
the same rounds says how loaded the machine was: compare absolute numbers
only when it reads near its idle value.
"""

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from configs import synthetic_cpu  # noqa: E402
from jrope import sharding  # noqa: E402
from jrope.config_types import TrainConfig  # noqa: E402
from jrope.train_state import build_source, init_state, state_layout  # noqa: E402
from jrope.trainer import make_train_step  # noqa: E402

REFERENCE_MS_PER_STEP = {"rope": 195.0, "jordan_rope": 240.0, "jordan_exact_scaled": 246.0}

_METHODS = flags.DEFINE_list("methods", ["rope", "jordan_rope", "jordan_exact_scaled"], "Encodings to time.")
_DTYPE = flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Activation dtype.")
_REMAT = flags.DEFINE_enum("remat", "none", ["none", "full", "dots_saveable"], "Block rematerialisation.")
_IMPL = flags.DEFINE_enum("attention_impl", "auto", ["auto", "xla", "einsum", "blockwise"], "Attention kernel.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per method per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (the median is reported).")


def _prepare(method: str):
    config = synthetic_cpu.get_config()
    config.pe.name = method
    config.model.compute_dtype = _DTYPE.value
    config.model.remat = _REMAT.value
    config.model.attention_impl = _IMPL.value
    config.mesh.data = 1
    cfg = TrainConfig.from_config_dict(config)
    mesh = sharding.make_mesh(cfg.mesh, devices=jax.devices()[:1])
    source = build_source(cfg)
    layout = state_layout(cfg, source.vocab_size, mesh)
    state = init_state(cfg, source.vocab_size, layout, mesh)
    step_fn = make_train_step(cfg, layout, source.num_classes, mesh)
    with jax.set_mesh(mesh):
        batches = [sharding.global_batch(source.train_batch(i), cfg.mesh.rules, mesh) for i in range(2)]
        for batch in batches:  # compile and warm up
            state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
    return {"state": state, "step_fn": step_fn, "batches": batches, "mesh": mesh, "cfg": cfg}


def _time_steps(run: dict, num_steps: int) -> float:
    """Seconds per step over `num_steps` steps (data already on device)."""
    state = run["state"]
    with jax.set_mesh(run["mesh"]):
        start = time.perf_counter()
        for i in range(num_steps):
            state, metrics = run["step_fn"](state, run["batches"][i % 2])
        jax.block_until_ready((state, metrics))
        elapsed = time.perf_counter() - start
    run["state"] = state
    return elapsed / num_steps


def _matmul_gflops() -> float:
    """Float32 2048^3 matmul throughput now: how busy the machine is (about 450 on an idle 2-core host)."""
    a = jax.numpy.ones((2048, 2048), jax.numpy.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e9


def main(argv):
    del argv
    runs = {method: _prepare(method) for method in _METHODS.value}
    times = {method: [] for method in runs}
    gflops = []
    for _ in range(_ROUNDS.value):
        gflops.append(_matmul_gflops())
        for method, run in runs.items():
            times[method].append(_time_steps(run, _STEPS.value))
    cfg = next(iter(runs.values()))["cfg"]
    tokens = cfg.batch_size * cfg.pe.train_context
    baseline = statistics.median(times["rope"]) if "rope" in times else None
    print(
        f"train step, d_model {cfg.model.d_model}, {cfg.model.num_heads} heads, {cfg.model.num_layers} layers, "
        f"L {cfg.pe.train_context}, batch {cfg.batch_size}, {_DTYPE.value}, remat {_REMAT.value}, "
        f"attention {_IMPL.value}; median of {_ROUNDS.value} rounds x {_STEPS.value} steps; "
        f"{jax.devices()[0].platform}; plain 2048^3 matmul {statistics.median(gflops):.0f} GFLOP/s "
        "(an idle 2-core host: about 450)"
    )
    print("| method | ms/step | steps/s | tokens/s | vs rope | speed-up vs PyTorch reference |")
    print("|---|---|---|---|---|---|")
    for method, samples in times.items():
        seconds = statistics.median(samples)
        ratio = f"{seconds / baseline:.3f}" if baseline else "-"
        reference = REFERENCE_MS_PER_STEP.get(method)
        speedup = f"{reference / (1000 * seconds):.2f}x" if reference else "-"
        print(
            f"| {method} | {1000 * seconds:.1f} | {1 / seconds:.2f} | {tokens / seconds:,.0f} | {ratio} | {speedup} |"
        )


if __name__ == "__main__":
    app.run(main)
