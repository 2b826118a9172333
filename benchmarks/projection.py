"""Train step with the plain projections against jrope.model.projection.cpu_projection.

The synthetic CPU config's shape (d_model 128, 4 heads, 3 layers, mlp 2, L 256,
batch 24, readout 'last'; AdamW), built from the library alone, one device.
The two are timed in interleaved rounds in one process and reported as
medians with the ratio plain / cpu_projection per round (its median and
quartiles): only ratios measured together mean much on a shared machine.

    python benchmarks/projection.py
    python benchmarks/projection.py --compute_dtype=bfloat16 --methods=rope
"""

import statistics
import time

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from flax import nnx

import jrope
from jrope.model import projection
from jrope.model.config import ModelConfig
from jrope.model.transformer import Transformer

_METHODS = flags.DEFINE_list("methods", ["rope", "jordan_rope"], "Encodings to time.")
_DTYPE = flags.DEFINE_enum("compute_dtype", "float32", ["float32", "bfloat16"], "Activation dtype.")
_STEPS = flags.DEFINE_integer("steps", 8, "Timed steps per variant per round.")
_ROUNDS = flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds.")

BATCH, LENGTH, VOCAB = 24, 256, 256


def _timed_step(method: str, projection_fn):
    """A function of n that runs n compiled, warmed-up train steps and returns seconds per step."""
    cfg = ModelConfig(
        d_model=128,
        num_heads=4,
        num_layers=3,
        mlp_ratio=2,
        compute_dtype=_DTYPE.value,
        attention_impl="auto",
        blockwise_min_length=4096,
        block_size=512,
        remat="none",
        readout="last",
    )
    pe = jrope.pe_config_from_name(method, train_context=LENGTH)
    encoding = jrope.make_encoding(pe, num_heads=cfg.num_heads, head_dim=cfg.head_dim)
    model = Transformer(cfg, encoding, VOCAB, rngs=nnx.Rngs(params=0), projection=projection_fn)
    graph, params = nnx.split(model, nnx.Param)
    optimizer = optax.adamw(1e-3)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, LENGTH + 1), 0, VOCAB)
    positions = jnp.arange(LENGTH, dtype=jnp.int32)

    def loss(params):
        logits = nnx.merge(graph, params)(tokens[:, :-1], positions)
        targets = tokens[:, tokens.shape[1] - logits.shape[1] :]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    state = step(params, optimizer.init(params))[:2]
    jax.block_until_ready(state)

    def run(num_steps: int) -> float:
        nonlocal state
        start = time.perf_counter()
        for _ in range(num_steps):
            state = step(*state)[:2]
        jax.block_until_ready(state)
        return (time.perf_counter() - start) / num_steps

    return run


def main(argv):
    del argv
    print(f"backend {jax.default_backend()}, compute_dtype {_DTYPE.value}")
    for method in _METHODS.value:
        runs = {
            "plain": _timed_step(method, projection.contract),
            "cpu_projection": _timed_step(method, projection.cpu_projection),
        }
        times = {name: [] for name in runs}
        ratios = []
        for _ in range(_ROUNDS.value):
            for name, run in runs.items():
                times[name].append(run(_STEPS.value))
            ratios.append(times["plain"][-1] / times["cpu_projection"][-1])
        median_ms = {name: 1e3 * statistics.median(values) for name, values in times.items()}
        low, _, high = statistics.quantiles(ratios, n=4)
        print(
            f"{method:12s} plain {median_ms['plain']:7.1f} ms/step  cpu_projection "
            f"{median_ms['cpu_projection']:7.1f} ms/step  plain/cpu_projection "
            f"{statistics.median(ratios):.3f} (quartiles {low:.3f}-{high:.3f})",
            flush=True,
        )


if __name__ == "__main__":
    app.run(main)
