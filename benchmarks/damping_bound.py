"""What the damping bound costs when it triggers: evaluation with one map origin vs blockwise.

A damping past model.max_damping moves evaluation from the single-origin
kernel ('auto' on CPU below model.blockwise_min_length: einsum) to the
blockwise kernel, in blocks that carry the damping (jrope.model.damping:
128 for gamma = 0.5). The synthetic CPU config's model (d_model 128, 4 heads,
3 layers, mlp 2, float32, readout 'last' or, as text, 'all') evaluates a batch of 8 sequences of
--length tokens with each kernel, jitted, in interleaved rounds in one
process; reported are the medians and the ratio to the single-origin kernel
per round (median).

    python benchmarks/damping_bound.py
    python benchmarks/damping_bound.py --readout=all
    python benchmarks/damping_bound.py --length=1024 --method=rope
"""

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

import jrope
from jrope.model.config import ModelConfig
from jrope.model.transformer import Transformer

_LENGTH = flags.DEFINE_integer("length", 2048, "Evaluation length.")
_METHOD = flags.DEFINE_string("method", "jordan_rope", "Encoding.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds.")
_CALLS = flags.DEFINE_integer("calls", 3, "Timed evaluations per kernel per round.")
_READOUT = flags.DEFINE_enum(
    "readout", "last", ["last", "all"], "'last': the synthetic task's; 'all': language modelling."
)

BATCH, TRAIN_LENGTH, VOCAB = 8, 256, 3
# (label, attention_impl, block_size): the kernel within the bound, and the blockwise
# kernel at the config's blocks and at the blocks a damping of 0.5 needs.
KERNELS = (
    ("einsum (one origin)", "einsum", 512),
    ("blockwise, blocks of 512", "blockwise", 512),
    ("blockwise, blocks of 128", "blockwise", 128),
)


def _timed_evaluation(impl: str, block_size: int, length: int):
    """A function of n that runs n compiled evaluations and returns seconds per evaluation."""
    cfg = ModelConfig(
        d_model=128,
        num_heads=4,
        num_layers=3,
        mlp_ratio=2,
        compute_dtype="float32",
        attention_impl=impl,
        blockwise_min_length=4096,
        block_size=block_size,
        remat="none",
        readout=_READOUT.value,
    )
    pe = jrope.pe_config_from_name(_METHOD.value, train_context=TRAIN_LENGTH)
    encoding = jrope.make_encoding(
        pe, num_heads=cfg.num_heads, head_dim=cfg.head_dim, max_length=length
    )
    model = Transformer(cfg, encoding, VOCAB, rngs=nnx.Rngs(params=0))
    graph, params = nnx.split(model, nnx.Param)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (BATCH, length), 0, VOCAB)
    positions = jnp.arange(length, dtype=jnp.int32)
    evaluate = jax.jit(lambda params: nnx.merge(graph, params)(tokens, positions))
    jax.block_until_ready(evaluate(params))

    def run(num_calls: int) -> float:
        start = time.perf_counter()
        for _ in range(num_calls):
            jax.block_until_ready(evaluate(params))
        return (time.perf_counter() - start) / num_calls

    return run


def main(argv):
    del argv
    length = _LENGTH.value
    runs = {label: _timed_evaluation(impl, block, length) for label, impl, block in KERNELS}
    times = {label: [] for label in runs}
    for _ in range(_ROUNDS.value):
        for label, run in runs.items():
            times[label].append(run(_CALLS.value))
    baseline = KERNELS[0][0]
    print(
        f"{_METHOD.value}, length {length}, batch {BATCH}, readout {_READOUT.value!r}, "
        f"{jax.devices()[0].device_kind}; "
        f"median of {_ROUNDS.value} rounds of {_CALLS.value} evaluations"
    )
    print("| kernel | seconds per evaluation | ratio to one origin |")
    print("|---|---|---|")
    for label, values in times.items():
        ratios = [value / base for value, base in zip(values, times[baseline], strict=True)]
        print(f"| {label} | {statistics.median(values):.3f} | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    app.run(main)
