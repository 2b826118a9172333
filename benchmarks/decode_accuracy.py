"""bfloat16 error of a KV cache's decode step: shear terms against mapped keys and RoPE's own.

One decode step of a one-layer cache (tests/helpers/cache_decoding.py): the
first S - 1 keys prefilled, the last token decoded over them, its output's
relative RMS error against the float64 formula. q, k, v are bfloat16; eta
near its bound, some damping (tests/helpers/shear_oracle.py's set-up). Paths:

  rope          RoPE's cache (bfloat16 mapped keys), its queries scaled to the
                variant's logit RMS, so that both spread their logits alike;
  shear terms   the cache of shear terms in bfloat16, term dots at the default
                precision (what the cache keeps where the model takes the
                shear kernels);
  mapped f32    float32 mapped keys, exact float32 dots (the other cache on
                CPU, and on TPU and GPU at HIGHEST);
  mapped 1-pass the same with q2 and k2 rounded to bfloat16: what the q . k dot
                would see at a TPU's default precision (one bfloat16 pass).

    python benchmarks/decode_accuracy.py
"""

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tests.helpers.cache_decoding import decoded_output, logit_rms, reference_output, relative_rms  # noqa: E402
from tests.helpers.shear_oracle import TRAIN_CONTEXT  # noqa: E402
from tests.helpers.shear_oracle import setup_encoding as setup  # noqa: E402

_LENGTH = flags.DEFINE_integer("length", 4 * TRAIN_CONTEXT, "S, the keys the decoded token sees.")
NAMES = ("jordan_rope", "jordan_raw_tau", "jordan_exact_m3_eta1", "jordan_m3", "direct_sum")
OFFSETS = (0, 65536, 2**30)


class _OnePass:
    """An encoding whose mapped queries and keys come rounded to bfloat16."""

    def __init__(self, encoding):
        self._encoding = encoding

    def __getattr__(self, name):
        return getattr(self._encoding, name)

    def map_queries(self, *args, **kwargs):
        return _rounded(self._encoding.map_queries(*args, **kwargs))

    def map_keys(self, *args, **kwargs):
        return _rounded(self._encoding.map_keys(*args, **kwargs))


def _rounded(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def main(argv):
    del argv
    length = _LENGTH.value
    print(f"L = {TRAIN_CONTEXT}, S = {length}, 2 heads of 48, relative RMS error of the output")
    print("| encoding | offset | rope | shear terms | mapped f32 | mapped 1-pass |")
    print("|---|---|---|---|---|---|")
    rope, rope_params, rq, rk, rv = setup("rope", length)
    for name in NAMES:
        enc, params, q, k, v = setup(name, length)
        for offset in OFFSETS:
            positions = np.arange(length) + offset
            scale = logit_rms(enc, params, q, k, positions)
            scale /= logit_rms(rope, rope_params, rq, rk, positions)
            low = [x.astype(jnp.bfloat16) for x in (rq * scale, rk, rv)]
            reference = reference_output(rope, rope_params, *low, positions)
            rope_error = relative_rms(
                decoded_output(
                    rope, rope_params, *low, positions, shear_terms=False, key_dtype=jnp.bfloat16
                ),
                reference,
            )
            low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
            reference = reference_output(enc, params, *low, positions)
            cells = [
                decoded_output(
                    enc, params, *low, positions, shear_terms=True, key_dtype=jnp.bfloat16
                ),
                decoded_output(
                    enc, params, *low, positions, shear_terms=False, key_dtype=jnp.float32
                ),
                decoded_output(
                    _OnePass(enc), params, *low, positions, shear_terms=False, key_dtype=jnp.float32
                ),
            ]
            errors = " | ".join(f"{relative_rms(c, reference):.2e}" for c in cells)
            print(f"| {name} | {offset} | {rope_error:.2e} | {errors} |")


if __name__ == "__main__":
    app.run(main)
