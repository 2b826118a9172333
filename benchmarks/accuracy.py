"""Accuracy of every variant family against a float64 evaluation of its formulas.

For each variant, offset (the first position), length (multiples of the
training length L), compute dtype and kernel, the worst relative error over
every query row, head and batch row of

  logits   jrope.attention_logits (the encoding's maps and the q.k dot), causal
           pairs only: max |logit - logit64| / max |logit64| per head;
  <kernel> jrope.attention.causal_attention's output with that kernel:
           max |o - o64| / max |o64| per row, o64 = softmax(logits64) v.

The float64 reference is jrope.oracle: the encoding's maps and bias evaluated
in float64 from the window's midpoint (exact by the group law, and what keeps
e^{gamma p} finite at offset 2^30). q, k, v are rounded to the compute dtype
first and the reference takes the rounded values, so only the computation's
error is measured. The parameters are the initial ones perturbed (seeded),
with eta at 0.9 eta_max and jet gates at 0.9 of their bound, the conditions
where the shear terms are largest.

    python benchmarks/accuracy.py                      # L 32, lengths L, 4L, 8L
    python benchmarks/accuracy.py --variants=jordan_m4,jordan_m6 --kernels=einsum
"""

import math
import os
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jrope  # noqa: E402
from jrope import attention, oracle  # noqa: E402

VARIANTS = (
    "rope",
    "alibi",
    "damped_rope",
    "direct_sum",
    "real_jordan",
    "jordan_rope",
    "jordan_raw_tau",
    "jordan_m4",
    "jordan_m6",
    "jordan_exact",
    "jordan_exact_scaled_eta1",
    "jordan_exact_m4_eta1",
    "jordan_exact_m6_eta1",
    "jordan_jetmix_m4_c150_g050_g030_g020",
    "jordan_jetmixfull_m3_c150_g100_g050_g030",
)
_VARIANTS = flags.DEFINE_list("variants", list(VARIANTS), "Encodings (paper names).")
_KERNELS = flags.DEFINE_list("kernels", ["xla", "einsum", "blockwise"], "Attention kernels.")
_OFFSETS = flags.DEFINE_list("offsets", ["0", "65536", "1073741824"], "First positions.")
_MULTIPLES = flags.DEFINE_list("multiples", ["1", "4", "8"], "Lengths as multiples of L.")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "Compute dtypes.")
_TRAIN_CONTEXT = flags.DEFINE_integer("train_context", 32, "L, the training length.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 32, "Block length of the blockwise kernel.")

NUM_HEADS, HEAD_DIM, BATCH = 2, 24, 1


def _parameters(enc: jrope.Encoding) -> dict[str, jax.Array]:
    """Initial parameters perturbed, eta and jet gates at 0.9 of their bound (seeded)."""
    params = dict(enc.init_params())
    keys = jax.random.split(jax.random.PRNGKey(0), len(params))
    for key, name in zip(keys, sorted(params), strict=True):
        params[name] = params[name] + 0.3 * jax.random.normal(key, params[name].shape)
    for name in ("eta_raw", "jet_gates_raw"):
        if name in params:
            params[name] = jnp.full_like(params[name], math.atanh(0.9))
    return params


def reference_logits(enc, params, q, k, positions):
    """float64 logits [B, N, T, T] of every pair (jrope.oracle; the future ones masked by the caller)."""
    positions = jnp.asarray(positions, jnp.int32)
    with oracle.float64():
        arrays = oracle.as_float64((params, q, k))
        return np.asarray(_ORACLE_LOGITS(enc, *arrays, positions, positions))


_ORACLE_LOGITS = jax.jit(oracle.logits, static_argnums=0)


def _head_error(got, want, visible):
    """Worst over heads of max |got - want| / max |want| over the visible (causal) logits.

    Per head, not per row: a row with one visible logit near zero (a q.k
    that cancels) would measure the dot's cancellation, not the encoding.
    """
    error = np.where(visible, np.abs(got - want), 0.0).max((-2, -1))
    scale = np.where(visible, np.abs(want), 0.0).max((-2, -1))
    return float(np.max(error / np.maximum(scale, 1e-300)))


def main(argv):
    del argv
    start = time.perf_counter()
    train_context = _TRAIN_CONTEXT.value
    print(
        f"backend {jax.default_backend()}, L {train_context}, {NUM_HEADS} heads of {HEAD_DIM}, "
        f"blockwise block {_BLOCK_SIZE.value}; worst relative error (see the docstring)"
    )
    columns = ["logits", *_KERNELS.value]
    print(f"| variant | offset | length | dtype | {' | '.join(columns)} |")
    print("|---|---:|---:|---|" + "---:|" * len(columns))
    for name in _VARIANTS.value:
        lengths = [int(m) * train_context for m in _MULTIPLES.value]
        pe = jrope.pe_config_from_name(name, train_context=train_context)
        enc = jrope.make_encoding(pe, NUM_HEADS, HEAD_DIM, max_length=max(lengths))
        params = _parameters(enc)
        for dtype_name in _DTYPES.value:
            dtype = jnp.dtype(dtype_name)
            precision = enc.dot_precision
            logits_fn = jax.jit(
                lambda p, q, k, pos, enc=enc, precision=precision: jrope.attention_logits(
                    enc, p, q, k, pos, pos, precision=precision
                )
            )
            kernel_fns = {
                kernel: jax.jit(
                    lambda p, q, k, v, pos, enc=enc, kernel=kernel, precision=precision: (
                        attention.causal_attention(
                            q,
                            k,
                            v,
                            enc=enc,
                            params=p,
                            positions=pos,
                            kernel=kernel,
                            block_size=_BLOCK_SIZE.value,
                            precision=precision,
                        )
                    )
                )
                for kernel in _KERNELS.value
                if attention.feature_refusal(kernel, enc) is None
            }
            for length in lengths:
                keys = jax.random.split(jax.random.PRNGKey(length), 3)
                shape = (BATCH, length, NUM_HEADS, HEAD_DIM)
                q, k, v = (jax.random.normal(key, shape).astype(dtype) for key in keys)
                v64 = oracle.as_float64(v)
                visible = np.tril(np.ones((length, length), bool))[None, None]
                for offset in (int(o) for o in _OFFSETS.value):
                    positions = offset + np.arange(length, dtype=np.int64)
                    pos32 = jnp.asarray(positions, jnp.int32)
                    want = reference_logits(enc, params, q, k, positions)
                    got = np.asarray(logits_fn(params, q, k, pos32), np.float64)
                    row = [_head_error(got, want, visible)]
                    masked = np.where(visible, want, -np.inf)
                    probs = np.exp(masked - masked.max(-1, keepdims=True))
                    probs /= probs.sum(-1, keepdims=True)
                    out64 = np.einsum("bnts,bsnh->btnh", probs, v64)
                    for kernel in _KERNELS.value:
                        if kernel not in kernel_fns:
                            row.append(float("nan"))
                            continue
                        out = np.asarray(
                            kernel_fns[kernel](params, q, k, v, pos32).astype(jnp.float32),
                            np.float64,
                        )
                        error = np.abs(out - out64).max(-1)
                        scale = np.maximum(np.abs(out64).max(-1), 1e-300)
                        row.append(float(np.max(error / scale)))
                    cells = " | ".join("n/a" if math.isnan(x) else f"{x:.1e}" for x in row)
                    print(f"| {name} | {offset} | {length} | {dtype_name} | {cells} |", flush=True)
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    app.run(main)
