"""Structured kernel probes on head_dim 96, for the higher-order Jordan methods (the paper's v2).

The structured probe (configs/structured_probe.py: the same ten targets,
L = 1024, T up to 8192, ridge 1e-4, seed 0) on head_dim 96, which 2m divides
for m = 2, 3, 4, with the reference's high-order method list
(configs/high_jet_structured.yaml of the reference code), in its order: RoPE,
its parameter-matched variants (the first 16 // m frequencies, m = 2, 3, 4),
RoPE + ALiBi, the direct sum and its polynomial variant (RoPE with the
bounded-time ramps tau/L, (tau/L)^2, (tau/L)^3), stabilized Jordan-RoPE of
orders 2, 3, 4 and scaled-exact Jordan jets of orders 3 and 4 with the v2
damping c = 0.1 (gamma = 0.1/L). The matched, polynomial and scaled names are
the reference's probe baselines (jrope.pe_config.ProbeBaseline): features
only, no encoding.

Command:

    python eval.py --config=configs/structured_probe_high_order.py \
        --workdir=runs/structured_probe_high_order

Writes kernel_probe.{csv,md} and one kernel_probe_<target>_T8192.png per target.
Add --config.probe.solver_dtype=float32 for the reference's float32 solve.

Hardware: any CPU; about a minute on the shared 2-core development machine.

Expected result: on the high jets x^r cos(w d), the order-m bases fit r < m
by orders of magnitude better than lower orders; the scaled jets of order m
hold x^r e^{-0.1 x} cos(w d) for r < m exactly.

Measured (the command above, 2026-12-04, float64 solver; train MSE on
[0, L), full table in docs/results.md, "Structured kernel probes"):

    method                  high_jet_r1  high_jet_r2  high_jet_r3
    rope, rope_matched_m4   0.042        0.044-0.045  0.040
    jordan_rope             1.9e-03      8.8e-03      1.3e-02
    jordan_m4               2.6e-05      2.9e-04      9.7e-04
    jordan_scaled_m4_c010   2.6e-11      5.7e-10      2.4e-07

The matched and polynomial variants are within 2 % of RoPE everywhere (the
target frequency, index 3, is among the first 16 // 4 = 4 frequencies); at
T = 8192 jordan_scaled_m4_c010 is the best fit of high_jet_r1..3 and
scaled_high_jet_r3, jordan_scaled_m3_c010 of scaled_high_jet_r2 (3.5e-06).
"""

from configs import structured_probe

# The reference's high-order structured-benchmark methods, in its order.
HIGH_ORDER_METHODS = (
    "rope",
    "rope_matched_m2",
    "rope_matched_m3",
    "rope_matched_m4",
    "rope_alibi",
    "direct_sum",
    "direct_sum_poly_m4",
    "jordan_rope",
    "jordan_m3",
    "jordan_m4",
    "jordan_scaled_m3_c010",
    "jordan_scaled_m4_c010",
)


def get_config():
    config = structured_probe.get_config()
    config.probe.methods = HIGH_ORDER_METHODS
    config.probe.head_dim = 96  # divisible by 2m for m = 2, 3, 4
    config.probe.seeds = (0,)
    return config
