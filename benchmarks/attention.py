"""Speed and memory of one attention layer per encoding: forward, and forward + backward.

Raw q, k, v [B, T, N, H] (default B 1, N 4 as in the synthetic model, and
H 48 rather than its 32: an order-3 Jordan head needs H divisible by 6) go
through jrope.attention.causal_attention, encoding included, with two kernels:

  dense      the einsum kernel, what attention_impl='auto' picks below its
             blockwise threshold; it forms the T x T logits of every head.
  blockwise  jrope.attention.blockwise (online softmax over key blocks).

Every (kernel, length) group is compiled first and then timed side by side,
in interleaved rounds, in one process (the machines are shared and noisy:
only ratios measured together mean much); the median over rounds is
reported, with each method's ratio to RoPE in the same group. Memory is the
compiled executable's scratch memory from XLA's buffer assignment
(`jax.jit(f).lower(...).compile().memory_analysis().temp_size_in_bytes`):
what the layer allocates beyond its inputs and outputs, not a measured RSS.

On an NVIDIA GPU (jax.default_backend() == 'gpu') it also runs RoPE and the
exact Jordan variants through the model's cuDNN kernel (jrope.attention.cudnn:
bfloat16 q, k, v after the float32 positional transform) and through its XLA
kernel with the same inputs, and reports both errors (output and gradients)
against float32 XLA attention at HIGHEST precision, and both forward +
backward times side by side. Elsewhere that part prints that it was skipped.

    python benchmarks/attention.py
    python benchmarks/attention.py --lengths=512,2048 --kernels=blockwise --rounds=5
"""

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

import jrope
from jrope import attention
from jrope.train import runtime

METHODS = (
    "nope", "rope", "alibi", "rope_alibi", "damped_rope", "jordan_rope",
    "jordan_exact_scaled", "jordan_exact_m3",
)  # fmt: skip
CUDNN_METHODS = ("rope", "jordan_exact_scaled", "jordan_exact_m3")

_METHODS = flags.DEFINE_list(
    "methods", list(METHODS), "Encodings to measure (rope is the baseline)."
)
_LENGTHS = flags.DEFINE_list("lengths", ["512", "2048", "8192"], "Sequence lengths T.")
_KERNELS = flags.DEFINE_list("kernels", ["dense", "blockwise"], "dense and/or blockwise.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size B.")
_HEADS = flags.DEFINE_integer("heads", 4, "Heads N.")
_HEAD_DIM = flags.DEFINE_integer(
    "head_dim", 48, "Head dim H (divisible by 2m for every order m used)."
)
_BLOCK = flags.DEFINE_integer("block_size", 512, "Block length of blockwise attention.")
_TRAIN_CONTEXT = flags.DEFINE_integer("train_context", 256, "L of the encodings.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved timing rounds (the median is reported).")
_MIN_SECONDS = flags.DEFINE_float(
    "min_seconds", 0.2, "Each timing repeats the call for at least this long."
)


def _encoding(name: str):
    cfg = jrope.pe_config_from_name(name, train_context=_TRAIN_CONTEXT.value)
    return jrope.make_encoding(cfg, num_heads=_HEADS.value, head_dim=_HEAD_DIM.value)


def _inputs(length: int, dtype=jnp.float32):
    shape = (_BATCH.value, length, _HEADS.value, _HEAD_DIM.value)
    keys = jax.random.split(jax.random.key(length), 4)
    return [jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys]


def _layer(enc, kernel: str, length: int):
    """(params, q, k, v) -> [B, T, N, H] through the model's attention entry point."""
    positions = jnp.arange(length, dtype=jnp.int32)

    def forward(params, q, k, v):
        return attention.causal_attention(
            q, k, v, enc=enc, params=params, positions=positions,
            kernel="blockwise" if kernel == "blockwise" else "einsum", block_size=_BLOCK.value,
        )  # fmt: skip

    return forward


def _compile(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, compiled.memory_analysis().temp_size_in_bytes


def _prepare(method: str, kernel: str, length: int) -> dict:
    enc = _encoding(method)
    params = enc.init_params()
    q, k, v, cotangent = _inputs(length)
    forward = _layer(enc, kernel, length)

    def loss(params, q, k, v):
        return jnp.vdot(forward(params, q, k, v), cotangent)

    fwd, fwd_bytes = _compile(forward, params, q, k, v)
    train, train_bytes = _compile(jax.grad(loss, argnums=(0, 1, 2, 3)), params, q, k, v)
    jax.block_until_ready((fwd(params, q, k, v), train(params, q, k, v)))  # first-run allocations
    return {
        "args": (params, q, k, v), "fwd": fwd, "train": train,
        "fwd_bytes": fwd_bytes, "train_bytes": train_bytes, "fwd_s": [], "train_s": [],
    }  # fmt: skip


def _seconds_per_call(fn, args) -> float:
    """Repeats fn(*args) for at least --min_seconds (once, for long calls); seconds per call."""
    calls, start = 0, time.perf_counter()
    while True:
        jax.block_until_ready(fn(*args))
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= _MIN_SECONDS.value:
            return elapsed / calls


def _measure_group(kernel: str, length: int) -> None:
    runs = {method: _prepare(method, kernel, length) for method in _METHODS.value}
    for _ in range(_ROUNDS.value):
        for run in runs.values():
            run["fwd_s"].append(_seconds_per_call(run["fwd"], run["args"]))
            run["train_s"].append(_seconds_per_call(run["train"], run["args"]))
    base = runs.get("rope")
    for method, run in runs.items():
        fwd, train = statistics.median(run["fwd_s"]), statistics.median(run["train_s"])
        fwd_ratio = f"{fwd / statistics.median(base['fwd_s']):.2f}" if base else "-"
        train_ratio = f"{train / statistics.median(base['train_s']):.2f}" if base else "-"
        label = "blockwise" if kernel == "blockwise" else "einsum"
        print(
            f"| {length} | {label} | {method} | {1000 * fwd:.2f} | {fwd_ratio} | {1000 * train:.2f} | "
            f"{train_ratio} | {run['fwd_bytes'] / 2**20:.1f} | {run['train_bytes'] / 2**20:.1f} |",
            flush=True,
        )


def _layer_in(dtype, enc, kernel: str, length: int, precision=None):
    """(params, q, k, v) -> float32 [B, T, N, H] through `kernel`, q, k, v cast to `dtype`."""
    positions = jnp.arange(length, dtype=jnp.int32)

    def forward(params, q, k, v):
        out = attention.causal_attention(
            q.astype(dtype), k.astype(dtype), v.astype(dtype), enc=enc, params=params,
            positions=positions, kernel=kernel, precision=precision,
        )  # fmt: skip
        return out.astype(jnp.float32)

    return forward


def _value_and_grads(forward, cotangent):
    def loss(params, q, k, v):
        return jnp.vdot(forward(params, q, k, v), cotangent)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _max_relative_error(got, want) -> float:
    """Largest |got - want| over the largest |want|, over every array of two matching pytrees."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=False)
    return max(float(jnp.max(jnp.abs(g - w)) / jnp.max(jnp.abs(w))) for g, w in pairs)


def _cudnn_check(lengths) -> None:
    """cuDNN against XLA attention, both in bfloat16 after the float32 transform (GPU only).

    Errors are against float32 XLA attention at HIGHEST precision (output, and
    the gradients of the encoding's parameters, q, k and v); times are medians
    over interleaved rounds, and the ratio is taken per round.
    """
    print("\ncuDNN check: bfloat16 q, k, v (positional transform in float32), causal; errors")
    print("against float32 XLA attention at HIGHEST precision, relative to the largest value")
    print(
        "| T | method | cuDNN out err | XLA out err | cuDNN grad err | XLA grad err | "
        "cuDNN fwd+bwd ms | XLA fwd+bwd ms | cuDNN / XLA |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    highest = jax.lax.Precision.HIGHEST
    for length in lengths:
        q, k, v, cotangent = _inputs(length)
        for method in CUDNN_METHODS:
            enc = _encoding(method)
            args = (enc.init_params(), q, k, v)
            ref_fwd, ref_grad = _value_and_grads(
                _layer_in(jnp.float32, enc, "xla", length, highest), cotangent
            )
            want_out, want_grads = ref_fwd(*args), ref_grad(*args)
            cells, runs = {}, {}
            for kernel in ("cudnn", "xla"):
                fwd, grad = _value_and_grads(
                    _layer_in(jnp.bfloat16, enc, kernel, length), cotangent
                )
                cells[kernel] = (
                    _max_relative_error(fwd(*args), want_out),
                    _max_relative_error(grad(*args), want_grads),
                )
                runs[kernel] = (grad, [])
            ratios = []
            for _ in range(_ROUNDS.value):
                for grad, times in runs.values():
                    times.append(_seconds_per_call(grad, args))
                ratios.append(runs["cudnn"][1][-1] / runs["xla"][1][-1])
            cudnn_ms, xla_ms = (1000 * statistics.median(runs[k][1]) for k in ("cudnn", "xla"))
            print(
                f"| {length} | {method} | {cells['cudnn'][0]:.2e} | {cells['xla'][0]:.2e} | "
                f"{cells['cudnn'][1]:.2e} | {cells['xla'][1]:.2e} | {cudnn_ms:.2f} | "
                f"{xla_ms:.2f} | {statistics.median(ratios):.2f} |",
                flush=True,
            )


def main(argv):
    del argv
    lengths = [int(x) for x in _LENGTHS.value]
    for kernel in _KERNELS.value:
        if kernel not in ("dense", "blockwise"):
            raise ValueError(f"--kernels takes dense and/or blockwise, got {kernel!r}.")
    print(
        f"attention layer, B {_BATCH.value}, N {_HEADS.value}, H {_HEAD_DIM.value}, float32, "
        f"block {_BLOCK.value}, L {_TRAIN_CONTEXT.value}; median of {_ROUNDS.value} interleaved rounds; "
        f"scratch = XLA temp buffer bytes of the compiled executable; {jax.default_backend()}; "
        f"1-min load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        f"host allocator {runtime.host_allocator()}"
    )
    print(
        "| T | kernel | method | fwd ms | fwd vs rope | fwd+bwd ms | fwd+bwd vs rope | "
        "fwd scratch MiB | fwd+bwd scratch MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for length in lengths:
        for kernel in _KERNELS.value:
            _measure_group(kernel, length)
    if jax.default_backend() == "gpu":
        _cudnn_check(lengths)
    else:
        print(f"\ncuDNN check skipped: backend is {jax.default_backend()}, not gpu.")


if __name__ == "__main__":
    app.run(main)
