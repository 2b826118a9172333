"""High-order kernel probe (the paper's v2): the finite-jet hierarchy of Jordan blocks.

Targets (d/L)^r cos(w d), r = 1, 2, 3. An order-m Jordan block carries the
features d^r e^{i w d} for r < m, so order m should fit r < m and fail for
r >= m. head_dim 96 is divisible by 2m for m = 2, 3, 4.

Command:

    python eval.py --config=configs/kernel_probe_high_order.py --workdir=runs/kernel_probe_high_order

Writes kernel_probe.{csv,md} and kernel_probe_high_jet_r2_T8192.png into the workdir.

Hardware: any CPU; a few seconds.

Expected result: for each r, the error drops by orders of magnitude once the
Jordan order m exceeds r (the exact jordan_exact_c000[_m{m}] bases, no
damping, fit exactly); rope and damped_rope fit none of the targets.

Measured (this config, the command above, 5 s on a 2-core CPU, 2026-12-04): train MSE on
[0, L) of the undamped exact bases, order m (rows) against target power r:

              r = 1     r = 2     r = 3
    m = 2     2.3e-11   2.8e-03   6.4e-03
    m = 3     2.6e-11   7.3e-11   1.7e-04
    m = 4     4.5e-11   2.0e-09   7.0e-08

At T = 8192 the matching order (m = r + 1) stays the best fit of each target
(1.1e-07, 1.2e-05, 5.3). With the reference's damping c = 0.1 the same
pattern holds less sharply (r = 2: 3.4e-03, 1.9e-06, 5.7e-10 for m = 2, 3, 4).
"""

from configs import kernel_probe


def get_config():
    config = kernel_probe.get_config()
    config.probe.methods = (
        "rope",
        "damped_rope",
        # stabilized (bounded shear time tau), orders 2, 3, 4
        "jordan_rope",
        "jordan_m3",
        "jordan_m4",
        # exact, raw shear time, no damping (c = 0), orders 2, 3, 4
        "jordan_exact_c000",
        "jordan_exact_c000_m3",
        "jordan_exact_c000_m4",
        # exact with the reference's v2 damping c = 0.1 (gamma = 0.1/L), orders 2, 3, 4
        "jordan_exact_c010",
        "jordan_exact_c010_m3",
        "jordan_exact_c010_m4",
    )
    config.probe.targets = ("high_jet_r1", "high_jet_r2", "high_jet_r3")  # (d/L)^r cos(w d)
    config.probe.head_dim = 96  # divisible by 2m for m = 2, 3, 4
    config.probe.plot_targets = ("high_jet_r2",)
    return config
