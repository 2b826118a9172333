"""bfloat16 logit error of the shear-weight kernel against RoPE's own, at lengths L..8L and far offsets.

For RoPE and each raw-shear encoding (eta near its bound, some damping), the
logits from bfloat16 q, k at the default precision against the float64
formula with exact time lags (tests/helpers/shear_oracle.py): the largest
error over the causal pairs relative to the largest logit. Three paths:

  rope        RoPE's maps, q2 and k2 rounded to bfloat16 (its usual path);
  shear       jrope.attention.shear.shear_logits with bfloat16 q, k;
  maps bf16   the maps with their float32 q2, k2 rounded to bfloat16 (what a
              bfloat16 kernel on the mapped q, k would see; keeps_float32 exists
              to prevent it).

    python benchmarks/shear_accuracy.py
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

import jrope
from jrope.attention import shear
from tests.helpers.shear_oracle import reference_logits

_CONTEXT = flags.DEFINE_integer("train_context", 32, "L; lengths L, 2L, 4L, 8L.")
NAMES = ("rope", "jordan_rope", "jordan_raw_tau", "jordan_exact_scaled", "jordan_m3", "direct_sum")
OFFSETS = (0, 65536, 2**30)


def _error(name, context, length, offset):
    cfg = jrope.pe_config_from_name(name, train_context=context)
    enc = jrope.make_encoding(cfg, 2, 48)
    params = {}
    for i, (key, value) in enumerate(enc.init_params().items()):
        noise = 0.3 * jax.random.normal(jax.random.PRNGKey(i), value.shape)
        params[key] = value + (2.0 if key == "eta_raw" else 0.0) + noise
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    q, k = (jax.random.normal(key, (1, length, 2, 48)).astype(jnp.bfloat16) for key in keys)
    positions = jnp.arange(length) + offset
    reference = reference_logits(enc, params, q, k, positions, positions)
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
    ) / np.sqrt(48)
    if name == "rope":
        return error(rounded), None
    return error(shear.shear_logits(enc, params, q, k, positions, positions)), error(rounded)


def main(argv):
    del argv
    context = _CONTEXT.value
    print(f"L = {context}, 2 heads of 48, error relative to the largest causal logit")
    print(
        "| length | offset | RoPE | "
        + " | ".join(f"{n} shear / maps bf16" for n in NAMES[1:])
        + " |"
    )
    print("|---" * (len(NAMES) + 2) + "|")
    for length in (context, 2 * context, 4 * context, 8 * context):
        for offset in OFFSETS:
            rope, _ = _error("rope", context, length, offset)
            cells = []
            for name in NAMES[1:]:
                new, old = _error(name, context, length, offset)
                cells.append(f"{new:.2e} / {old:.2e}")
            print(f"| {length} | {offset} | {rope:.2e} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    app.run(main)
