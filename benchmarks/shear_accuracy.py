"""bfloat16 error of the shear-weight kernels against RoPE's own, at lengths L..8L and far offsets.

Two tables, both against the float64 oracle (jrope.oracle), which takes the
same bfloat16-rounded q, k, v, so only the computation's error is measured.

logits: for RoPE and each raw-shear encoding (eta near its bound, some damping),
the largest logit error over the causal pairs relative to the largest logit,
for bfloat16 q, k at the default precision:

  rope        RoPE's maps, q2 and k2 rounded to bfloat16 (its usual path);
  shear       jrope.attention.shear.shear_logits with bfloat16 q, k;
  maps bf16   the maps with their float32 q2, k2 rounded to bfloat16 (what a
              bfloat16 kernel on the mapped q, k would see; keeps_float32 exists
              to prevent it).

outputs (--outputs): the attention output's relative RMS error of the shear and
shear_flash kernels for bfloat16 q, k, v, as a multiple of RoPE's own (RoPE
through the einsum kernel, the same q, k, v), at L, over the shear eta and the
damping gamma that training reaches (eta up to its bound 0.1, gamma from its
floor to model.max_damping 0.02) and offsets 0 .. 2^30.

    python benchmarks/shear_accuracy.py
    python benchmarks/shear_accuracy.py --outputs --train_context=256
"""

import math
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import jrope
from jrope import attention, oracle
from jrope.attention import shear

_CONTEXT = flags.DEFINE_integer("train_context", 32, "L; lengths L, 2L, 4L, 8L.")
_OUTPUTS = flags.DEFINE_bool("outputs", False, "The output table instead of the logits table.")
NAMES = ("rope", "jordan_rope", "jordan_raw_tau", "jordan_exact_scaled", "jordan_m3", "direct_sum")
OFFSETS = (0, 65536, 2**30)
HEADS, HEAD_DIM = 2, 48
# (eta / eta_max, gamma) of the outputs table: no shear, half, near the bound; damping at the
# floor and at model.max_damping.
SETTINGS = ((0.0, 1e-4), (0.5, 1e-4), (0.9, 1e-4), (0.9, 0.02))


def _encoding(name, context):
    return jrope.make_encoding(
        jrope.pe_config_from_name(name, train_context=context), HEADS, HEAD_DIM
    )


def _learned(enc):
    """Parameters around the initial ones, the shear near its bound."""
    params = {}
    for i, (key, value) in enumerate(enc.init_params().items()):
        noise = 0.3 * jax.random.normal(jax.random.PRNGKey(i), value.shape)
        params[key] = value + (2.0 if key == "eta_raw" else 0.0) + noise
    return params


def _set(enc, eta_fraction, gamma):
    """Every head and block at eta = eta_fraction * eta_max and gamma (where the encoding has them)."""
    params = dict(enc.init_params())
    if "eta_raw" in params:
        params["eta_raw"] = jnp.full_like(params["eta_raw"], math.atanh(eta_fraction))
    if "gamma_raw" in params:
        excess = max(gamma - enc.cfg.gamma_min, 1e-8)  # softplus^-1 of gamma above its floor
        params["gamma_raw"] = jnp.full_like(
            params["gamma_raw"], excess + math.log(-math.expm1(-excess))
        )
    return params


def _bfloat16(length, count, seed=7):
    keys = jax.random.split(jax.random.PRNGKey(seed), count)
    return [
        jax.random.normal(key, (1, length, HEADS, HEAD_DIM)).astype(jnp.bfloat16) for key in keys
    ]


def _logit_errors(name, context, length, offset):
    enc = _encoding(name, context)
    params = _learned(enc)
    q, k = _bfloat16(length, 2)
    positions = jnp.arange(length) + offset
    with oracle.float64():
        reference = np.asarray(
            jax.jit(oracle.logits, static_argnums=0)(
                enc, *oracle.as_float64((params, q, k)), positions, positions
            )
        )
    causal = np.tril(np.ones((length, length), bool))
    scale = np.abs(reference[..., causal]).max()

    def error(logits):
        return float(np.abs(np.asarray(logits) - reference)[..., causal].max() / scale)

    q2, k2 = enc.transform_qk(params, q, k, positions, positions)
    rounded = jnp.einsum(
        "btnh,bsnh->bnts",
        q2.astype(jnp.bfloat16),
        k2.astype(jnp.bfloat16),
        preferred_element_type=jnp.float32,
    ) / np.sqrt(HEAD_DIM)
    if name == "rope":
        return error(rounded), None
    return error(shear.shear_logits(enc, params, q, k, positions, positions)), error(rounded)


def _output_error(enc, params, kernel, q, k, v, positions):
    """The output's RMS error relative to the oracle's RMS."""
    with oracle.float64():
        want = np.asarray(
            jax.jit(oracle.attention, static_argnums=0)(
                enc, *oracle.as_float64((params, q, k, v)), positions
            )
        )
    got = attention.causal_attention(
        q, k, v, enc=enc, params=params, positions=positions, kernel=kernel, block_size=128
    )
    return float(np.sqrt(np.mean((oracle.as_float64(got) - want) ** 2) / np.mean(want**2)))


def logits_table(context):
    print(f"L = {context}, {HEADS} heads of {HEAD_DIM}, error relative to the largest causal logit")
    print(
        "| length | offset | RoPE | "
        + " | ".join(f"{n} shear / maps bf16" for n in NAMES[1:])
        + " |"
    )
    print("|---" * (len(NAMES) + 2) + "|")
    for length in (context, 2 * context, 4 * context, 8 * context):
        for offset in OFFSETS:
            rope, _ = _logit_errors("rope", context, length, offset)
            cells = []
            for name in NAMES[1:]:
                new, old = _logit_errors(name, context, length, offset)
                cells.append(f"{new:.2e} / {old:.2e}")
            print(f"| {length} | {offset} | {rope:.2e} | " + " | ".join(cells) + " |", flush=True)


def outputs_table(context):
    q, k, v = _bfloat16(context, 3)
    print(
        f"L = {context} = length, {HEADS} heads of {HEAD_DIM}, bfloat16 q, k, v: output RMS error "
        "of shear / shear_flash as a multiple of RoPE's (einsum)"
    )
    names = [
        name
        for name in NAMES[1:]
        if attention.feature_refusal("shear", _encoding(name, context)) is None
    ]
    print("| eta | gamma | offset | RoPE | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 4) + "|")
    rope = _encoding("rope", context)
    for eta_fraction, gamma in SETTINGS:
        for offset in OFFSETS:
            positions = jnp.arange(context, dtype=jnp.int32) + offset
            base = _output_error(rope, {}, "einsum", q, k, v, positions)
            cells = []
            for name in names:
                enc = _encoding(name, context)
                params = _set(enc, eta_fraction, gamma)
                ratios = [
                    _output_error(enc, params, kernel, q, k, v, positions) / base
                    for kernel in ("shear", "shear_flash")
                ]
                cells.append(" / ".join(f"{ratio:.2f}" for ratio in ratios))
            eta = eta_fraction * 0.1
            print(
                f"| {eta:.3g} | {gamma:g} | {offset} | {base:.2e} | " + " | ".join(cells) + " |",
                flush=True,
            )


def main(argv):
    del argv
    print(f"backend {jax.default_backend()}")
    (outputs_table if _OUTPUTS.value else logits_table)(_CONTEXT.value)


if __name__ == "__main__":
    app.run(main)
