"""What the shear-weight kernels cost against the maps for the raw-shear encodings.

Two tables from one run:

1. Measured here (the CPU this runs on): forward + backward time of one
   attention layer (raw q, k, v [B, T, N, H] through
   jrope.attention.causal_attention, encoding included) and its compiled
   scratch memory (`memory_analysis().temp_size_in_bytes`, XLA's buffer
   assignment, not a measured RSS), for jordan_rope with
     maps      the einsum kernel on the maps' float32 q, k at HIGHEST,
     shear     the XLA shear-weight kernel (jrope.attention.shear),
     flash     the Pallas flash kernel in interpret mode (slow by nature on a
               CPU: it runs the kernel's body as XLA loops),
   at the synthetic shape (T 1024, N 4, H 32: configs/synthetic.py) and the
   WikiText shape (T 1024, N 6, H 64: configs/wikitext_scaled_exact.py),
   batch 1, interleaved rounds, medians, ratios to `maps` in the same group.

2. Counted from programs exported for TPU and CUDA (jax.export, no
   hardware): per attention call (forward + backward), the dots over a
   [.., T, S] array with their precision, the kernel custom calls, and the
   number of distinct T x S float32 values the program holds outside custom
   calls; for jordan_rope through the maps (XLA, HIGHEST), the shear and
   flash kernels, and RoPE through splash (TPU) or cuDNN (CUDA, where this
   jax can lower it). Nothing here is a time or a byte count on an accelerator.

    python benchmarks/shear_cost.py
    python benchmarks/shear_cost.py --rounds=3 --shapes=synthetic
"""

import os
import re
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
from jax import export

import jrope
from jrope import attention

SHAPES = {"synthetic": (1024, 4, 32), "wikitext": (1024, 6, 64)}
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved timing rounds.")
_SHAPES = flags.DEFINE_list("shapes", list(SHAPES), "Shapes to time: synthetic, wikitext.")
_FLASH = flags.DEFINE_bool("flash", True, "Time the Pallas kernel in interpret mode too.")
_MEASURE = flags.DEFINE_bool("measure", True, "Time on this machine (else only the counts).")


def _layer(name, length, heads, head_dim, kernel, dtype):
    cfg = jrope.pe_config_from_name(name, train_context=length)
    enc = jrope.make_encoding(cfg, heads, head_dim)
    params = enc.init_params()
    params = {k: v + (1.0 if k == "eta_raw" else 0.0) for k, v in params.items()}
    positions = jnp.arange(length)
    settings = attention.AttentionSettings(head_dim=head_dim, compute_dtype=jnp.dtype(dtype).name)
    precision = attention.attention_precision(settings, enc, kernel)

    def loss(q, k, v):
        out = attention.causal_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            positions=positions,
            kernel=kernel,
            precision=precision,
            block_size=128,
        )
        return jnp.sum(out.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def _inputs(length, heads, head_dim, dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return [jax.random.normal(key, (1, length, heads, head_dim)).astype(dtype) for key in keys]


def measured_table(shapes, rounds, flash):
    print("| shape | path | q, k, v | fwd+bwd s | ratio | scratch MiB | ratio |")
    print("|---|---|---|---|---|---|---|")
    for shape in shapes:
        length, heads, head_dim = SHAPES[shape]
        paths = [
            ("maps", "einsum", jnp.float32),
            ("shear", "shear", jnp.float32),
            ("shear", "shear", jnp.bfloat16),
        ]
        if flash:
            paths.append(("flash", "shear_flash", jnp.bfloat16))
        compiled = []
        for label, kernel, dtype in paths:
            inputs = _inputs(length, heads, head_dim, dtype)
            fn = jax.jit(_layer("jordan_rope", length, heads, head_dim, kernel, dtype))
            executable = fn.lower(*inputs).compile()
            jax.block_until_ready(executable(*inputs))
            scratch = executable.memory_analysis().temp_size_in_bytes
            compiled.append((label, dtype, executable, inputs, scratch, []))
        for _ in range(rounds):
            for *_, executable, inputs, _, times in compiled:
                start = time.perf_counter()
                jax.block_until_ready(executable(*inputs))
                times.append(time.perf_counter() - start)
        base_time = statistics.median(compiled[0][5])
        base_bytes = compiled[0][4]
        for label, dtype, _, _, scratch, times in compiled:
            seconds = statistics.median(times)
            print(
                f"| {shape} T{length} N{heads} H{head_dim} | {label} | {jnp.dtype(dtype).name} | "
                f"{seconds:.3f} | {seconds / base_time:.2f} | {scratch / 2**20:.1f} | "
                f"{scratch / base_bytes:.2f} |"
            )


def _exported_counts(name, kernel, platform, backend, length, heads, head_dim):
    fn = _layer(name, length, heads, head_dim, kernel, jnp.bfloat16)
    spec = jax.ShapeDtypeStruct((1, length, heads, head_dim), jnp.bfloat16)
    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    real_backend = jax.default_backend
    jax.default_backend = lambda: backend
    try:
        text = export.export(jax.jit(fn), platforms=(platform,), disabled_checks=[triton])(
            spec, spec, spec
        ).mlir_module()
    finally:
        jax.default_backend = real_backend
    dots = {}
    for line in text.splitlines():
        if "stablehlo.dot_general" in line and re.search(rf"[x<]{length}x{length}x", line):
            match = re.search(r"precision = \[(\w+), (\w+)\]", line)
            precision = match.group(1) if match else "DEFAULT"
            operand = "bf16" if re.search(r"\(tensor<[^>]*bf16>", line) else "f32"
            key = f"{precision} {operand}"
            dots[key] = dots.get(key, 0) + 1
    calls = len(
        re.findall(r"custom_call @(tpu_custom_call|__gpu\$xla\.gpu\.triton|__cudnn\$\w+)", text)
    )
    square = len(set(re.findall(rf"%[\w#]+ = [^\n]*-> tensor<[^>]*{length}x{length}xf32>", text)))
    return dots, calls, square


def counted_table(length=1024, heads=6, head_dim=64):
    print(
        "\n| target | encoding, path | dots over T x S (precision, inputs) "
        "| kernel calls | T x S f32 values |"
    )
    print("|---|---|---|---|---|")
    cases = [
        ("tpu", "tpu", "rope", "splash"),
        ("tpu", "tpu", "jordan_rope", "xla"),
        ("tpu", "tpu", "jordan_rope", "shear"),
        ("tpu", "tpu", "jordan_rope", "shear_flash"),
        ("cuda", "gpu", "rope", "cudnn"),
        ("cuda", "gpu", "jordan_rope", "xla"),
        ("cuda", "gpu", "jordan_rope", "shear"),
        ("cuda", "gpu", "jordan_rope", "shear_flash"),
    ]
    for platform, backend, name, kernel in cases:
        try:
            dots, calls, square = _exported_counts(
                name, kernel, platform, backend, length, heads, head_dim
            )
        except Exception as error:  # cuDNN lowering needs cuDNN installed
            print(
                f"| {platform} | {name}, {kernel} | not lowered here: {type(error).__name__} | | |"
            )
            continue
        shown = (
            ", ".join(f"{n} x {k}" for k, n in sorted(dots.items())) or "none outside the kernel"
        )
        print(f"| {platform} | {name}, {kernel} | {shown} | {calls} | {square} |")


def main(argv):
    del argv
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {os.cpu_count()} CPUs")
    if _MEASURE.value:
        measured_table(_SHAPES.value, _ROUNDS.value, _FLASH.value)
    counted_table()


if __name__ == "__main__":
    app.run(main)
