"""Speed of the jitted train step at the synthetic CPU config, per encoding.

d_model 128, 4 heads, 3 layers, mlp 2, L 256, batch 24 (configs/synthetic_cpu.py),
one device. The methods are timed side by side in one process, in
interleaved rounds (machines are shared and noisy: only ratios measured
together mean much), and reported as the median over rounds.

    python benchmarks/train_step.py                      # float32
    python benchmarks/train_step.py --compute_dtype=bfloat16 --remat=full
    python benchmarks/train_step.py --xla_defaults=rope,jordan_rope   # also compiled with XLA defaults

Prints ms/step, steps/s, tokens/s and the ratio of each method's step time
to RoPE's: the median over rounds of the two times measured in the same
round, with its quartiles (pairing by round cancels most of the drift in the
machine's load, which moves single times by 10 to 20 %). The machines are
shared, so the speed-up over the paper's PyTorch reference is estimated
through a yardstick timed in the same rounds: the straightforward JAX step
(docs/performance.md: its own textbook RoPE in float32,
jax.nn.dot_product_attention, plain autodiff, AdamW with clipping; no jrope
code, so the yardstick stays fixed as the library changes), which ran at 283
ms/step where the reference ran RoPE at 195 ms/step. So the reference would
take 195/283 of the yardstick's measured time, and the speed-up is that over
the method's time. A plain matmul timed before and after the rounds says how
loaded the machine was. The last column counts the process's minor page
faults per timed step: the host allocator decides them (docs/performance.md,
benchmarks/host_allocator.py).
"""

import functools
import os
import resource
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from configs import synthetic_cpu  # noqa: E402
from jrope.train import runtime, setup  # noqa: E402
from jrope.train.config import TrainConfig  # noqa: E402
from jrope.train.setup import set_up_run  # noqa: E402
from jrope.train.trainer import make_train_step  # noqa: E402

# Measured once on an idle 2-core development machine (docs/performance.md): the paper's
# PyTorch code's RoPE step and the naive JAX step.
REFERENCE_ROPE_MS = 195.0
NAIVE_JAX_ROPE_MS = 283.0
YARDSTICK = "naive_jax_rope"

_METHODS = flags.DEFINE_list(
    "methods", ["rope", "jordan_rope", "jordan_exact_scaled"], "Encodings to time."
)
_DTYPE = flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Activation dtype.")
_READOUT = flags.DEFINE_enum(
    "readout", "last", ["all", "last"], "Positions the last block computes."
)
_REMAT = flags.DEFINE_enum(
    "remat", "none", ["none", "full", "dots_saveable"], "Block rematerialisation."
)
_IMPL = flags.DEFINE_enum(
    "attention_impl", "auto", ["auto", "xla", "einsum", "blockwise"], "Attention kernel."
)
_XLA_DEFAULTS = flags.DEFINE_list(
    "xla_defaults",
    [],
    "Methods also timed compiled with XLA's default options instead of jrope.train.runtime "
    "(rows named '<method> (XLA defaults)').",
)
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per method per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds (the median is reported).")


def _prepare(method: str, compiler_options: dict | None = None):
    """Compiled, warmed-up step of `method`; compiler_options None: the project's own."""
    config = synthetic_cpu.get_config()
    config.pe.name = method
    config.model.compute_dtype = _DTYPE.value
    config.model.remat = _REMAT.value
    config.model.readout = _READOUT.value
    config.model.attention_impl = _IMPL.value
    config.mesh.data = 1
    cfg = TrainConfig.from_config_dict(config)
    run = set_up_run(cfg, devices=jax.devices()[:1])
    source, mesh = run.source, run.mesh
    state = run.init_state()
    step_fn = make_train_step(run, compiler_options=compiler_options)
    with jax.set_mesh(mesh):
        batches = [
            setup.global_batch(source.train_batch(i), cfg.mesh.rules, mesh) for i in range(2)
        ]
        for batch in batches:  # compile and warm up
            state, metrics = step_fn(state, batch)
        jax.block_until_ready(metrics)
    return {"state": state, "step_fn": step_fn, "batches": batches, "mesh": mesh, "cfg": cfg}


def _prepare_yardstick():
    """The straightforward JAX train step (docs/performance.md: 283 ms there; same model, same batch)."""
    config = synthetic_cpu.get_config()
    config.pe.name = "rope"
    config.mesh.data = 1
    cfg = TrainConfig.from_config_dict(config)
    d, n, f = cfg.model.d_model, cfg.model.num_heads, cfg.model.mlp_ratio * cfg.model.d_model
    h = d // n
    omega = cfg.pe.theta ** (-2.0 * jnp.arange(h // 2) / h)  # [H/2]

    def rope(x, positions):
        """Textbook RoPE on interleaved (re, im) pairs, float32: the library is not the yardstick."""
        angle = positions[:, None, None] * omega  # [T, 1, H/2]
        re, im = x[..., 0::2], x[..., 1::2]
        cos, sin = jnp.cos(angle), jnp.sin(angle)
        return jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x.shape)

    keys = iter(jax.random.split(jax.random.PRNGKey(0), 4 * cfg.model.num_layers + 1))

    def uniform(shape):
        return jax.random.uniform(next(keys), shape, jnp.float32, -1, 1) / jnp.sqrt(shape[0])

    params = {
        "embedding": jax.random.normal(next(keys), (3, d)),
        "final_norm": jnp.ones(d),
        "layers": [
            {
                "norm1": jnp.ones(d),
                "qkv": uniform((d, 3 * d)),
                "out": uniform((d, d)),
                "norm2": jnp.ones(d),
                "up": uniform((d, f)),
                "down": uniform((f, d)),
            }
            for _ in range(cfg.model.num_layers)
        ],
    }

    def norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * w

    def loss_fn(params, batch):
        tokens = batch["inputs"]
        b, t = tokens.shape
        positions = jnp.arange(t, dtype=jnp.int32)
        x = params["embedding"][tokens]
        for layer in params["layers"]:
            q, k, v = jnp.split(
                (norm(x, layer["norm1"]) @ layer["qkv"]).reshape(b, t, 3 * n, h), 3, axis=2
            )
            q, k = rope(q, positions), rope(k, positions)
            x = (
                x
                + jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
                @ layer["out"]
            )
            x = (
                x
                + jax.nn.gelu(norm(x, layer["norm2"]) @ layer["up"], approximate=False)
                @ layer["down"]
            )
        logits = norm(x[:, -1], params["final_norm"]) @ params["embedding"][:2].T
        return -jnp.mean(
            jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][:, -1:], axis=1)
        )

    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(5e-4, weight_decay=0.01))

    @functools.partial(jax.jit, donate_argnums=0)
    def step_fn(state, batch):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    run = set_up_run(cfg, devices=jax.devices()[:1])
    source, mesh = run.source, run.mesh
    batches = [{k: jnp.asarray(v) for k, v in source.train_batch(i).items()} for i in range(2)]
    state = (params, optimizer.init(params))
    for batch in batches:
        state, loss = step_fn(state, batch)
    jax.block_until_ready(loss)
    return {"state": state, "step_fn": step_fn, "batches": batches, "mesh": mesh, "cfg": cfg}


def _time_steps(run: dict, num_steps: int) -> float:
    """Seconds per step over `num_steps` steps (data already on device).

    Also adds the process's minor page faults over these steps to run["faults"].
    """
    state = run["state"]
    with jax.set_mesh(run["mesh"]):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        for i in range(num_steps):
            state, metrics = run["step_fn"](state, run["batches"][i % 2])
        jax.block_until_ready((state, metrics))
        elapsed = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    run["state"] = state
    run["faults"] = run.get("faults", 0) + faults
    return elapsed / num_steps


def _matmul_gflops() -> float:
    """Float32 2048^3 matmul throughput now, in GFLOP/s: how busy the machine is."""
    a = jax.numpy.ones((2048, 2048), jax.numpy.float32)
    matmul = jax.jit(lambda a: a @ a)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e9


def _untimed_steps(run: dict, num_steps: int) -> None:
    """Steps of `run` that count in neither its times nor its page faults."""
    faults = run.get("faults", 0)
    _time_steps(run, num_steps)
    run["faults"] = faults


def _paired_ratio(samples: list[float], baseline: list[float]) -> str:
    """Median and quartiles over rounds of samples[i] / baseline[i], as 'median (q1-q3)'."""
    ratios = [a / b for a, b in zip(samples, baseline, strict=False)]
    if len(ratios) < 2:
        return f"{ratios[0]:.3f}"
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{median:.3f} ({q1:.2f}-{q3:.2f})"


def main(argv):
    del argv
    runs = {method: _prepare(method) for method in _METHODS.value}
    for method in _XLA_DEFAULTS.value:
        runs[f"{method} (XLA defaults)"] = _prepare(method, compiler_options={})
    runs[YARDSTICK] = _prepare_yardstick()
    times = {method: [] for method in runs}
    # The first program run after one compiled with XLA's library fusions (the
    # matmul, the yardstick) is slowed: with the matmul at the start of each round,
    # the same RoPE program ran 13 % slower in the round's first slot than in its
    # last, 3 % with one untimed step in between, and 3 % when it followed the
    # yardstick. So the matmul runs only before the first round and after the last,
    # and each round opens with an untimed step of its first method. An untimed
    # round comes first: the yardstick's first steps after the others ran took 2.7
    # to 3.8 s instead of about 0.6.
    gflops = [_matmul_gflops()]
    for run in runs.values():
        _untimed_steps(run, _STEPS.value)
    first = next(iter(runs.values()))
    for _ in range(_ROUNDS.value):
        _untimed_steps(first, 1)
        for method, run in runs.items():
            times[method].append(_time_steps(run, _STEPS.value))
    gflops.append(_matmul_gflops())
    cfg = runs[_METHODS.value[0]]["cfg"]
    tokens = cfg.batch_size * cfg.pe.train_context
    medians = {method: statistics.median(samples) for method, samples in times.items()}
    reference_estimate = medians[YARDSTICK] * REFERENCE_ROPE_MS / NAIVE_JAX_ROPE_MS
    print(
        f"train step, d_model {cfg.model.d_model}, {cfg.model.num_heads} heads, {cfg.model.num_layers} layers, "
        f"L {cfg.pe.train_context}, batch {cfg.batch_size}, {_DTYPE.value}, remat {_REMAT.value}, "
        f"attention {_IMPL.value}, readout {cfg.model.readout}; median of {_ROUNDS.value} rounds x "
        f"{_STEPS.value} steps; {jax.devices()[0].platform}; plain 2048^3 matmul "
        f"{gflops[0]:.0f} GFLOP/s before the rounds, {gflops[1]:.0f} after; "
        f"host allocator {runtime.host_allocator()}"
    )
    print(
        "| method | ms/step | steps/s | tokens/s | vs rope (quartiles) | est. speed-up vs PyTorch reference (RoPE) | page faults/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for method, seconds in medians.items():
        ratio = _paired_ratio(times[method], times["rope"]) if "rope" in times else "-"
        print(
            f"| {method} | {1000 * seconds:.1f} | {1 / seconds:.2f} | {tokens / seconds:,.0f} | {ratio} | "
            f"{reference_estimate / seconds:.2f}x | "
            f"{runs[method]['faults'] / (_ROUNDS.value * _STEPS.value):,.0f} |"
        )


if __name__ == "__main__":
    app.run(main)
