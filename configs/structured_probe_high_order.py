"""Structured kernel probes on head_dim 96, for the higher-order Jordan methods (the paper's v2).

The structured probe (configs/structured_probe.py: the same ten targets,
L = 1024, T up to 8192, ridge 1e-4) on head_dim 96, which 2m divides for
m = 2, 3, 4, with the reference's high-order method list: RoPE (+ ALiBi),
the direct sum, stabilized Jordan-RoPE of orders 2, 3, 4 and scaled-exact
Jordan-RoPE of orders 3 and 4 with the v2 damping c = 0.1. (The
reference's parameter-matched RoPE and polynomial direct-sum variants have no
jrope encoding and are left out.)

Command:

    python eval.py --config=configs/structured_probe_high_order.py \
        --workdir=runs/structured_probe_high_order

Writes kernel_probe.{csv,md} and one kernel_probe_<target>_T8192.png per target.

Hardware: any CPU; about a minute on the shared 2-core development machine.

Expected result: on the high jets x^r cos(w d), the order-m bases fit r < m
by orders of magnitude better than lower orders; scaled-exact order 4 is
the best fit of high_jet_r3 and scaled_high_jet_r3.

Measured (the command above, 2026-12-01; train MSE on [0, L), full table in
docs/results.md, section 4):

    method                        high_jet_r1  high_jet_r2  high_jet_r3
    jordan_rope                   1.9e-03      8.8e-03      1.3e-02
    jordan_m4                     2.6e-05      2.9e-04      9.7e-04
    jordan_exact_scaled_c010_m4   2.6e-11      5.7e-10      2.4e-07
"""

from configs import structured_probe


def get_config():
    config = structured_probe.get_config()
    config.probe.methods = (
        "rope",
        "rope_alibi",
        "direct_sum",
        # stabilized (bounded shear time tau), orders 2, 3, 4
        "jordan_rope",
        "jordan_m3",
        "jordan_m4",
        # scaled-exact with the v2 damping c = 0.1 (gamma = 0.1/L), orders 3, 4
        "jordan_exact_scaled_c010_m3",
        "jordan_exact_scaled_c010_m4",
    )
    config.probe.head_dim = 96  # divisible by 2m for m = 2, 3, 4
    return config
