"""The reference's damping x forced-shear (c x eta) scan on the Jordan-friendly synthetic LM.

The reference's `phase2_kernel_lm_stage3_c_eta_scan.yaml`: scaled-exact
Jordan-RoPE `jordan_exact_c{010,050,100,200}_eta{002,005,010}`, initial
damping gamma = c/L (c = 0.1, 0.5, 1, 2) and a forced initial shear eta0 =
0.002, 0.005, 0.01, with the training recipe of configs/synthetic_eta_scan.py
(300 steps, batch 16, seed 0, L 1024, evaluation at 1024 .. 8192).

Command (the reference's scale, for an accelerator):

    python -m jrope.compare --config=configs/synthetic_c_eta_scan.py --seeds=0 --workdir=runs/c_eta_scan \
        --methods=jordan_exact_c010_eta002,jordan_exact_c010_eta005,jordan_exact_c010_eta010,jordan_exact_c050_eta002,jordan_exact_c050_eta005,jordan_exact_c050_eta010,jordan_exact_c100_eta002,jordan_exact_c100_eta005,jordan_exact_c100_eta010,jordan_exact_c200_eta002,jordan_exact_c200_eta005,jordan_exact_c200_eta010

CPU scale (L 256, evaluation at 256 .. 2048, the same 8x; 256 sequences per
length instead of the reference's 8, whose accuracies move in steps of
0.125): the same command with

    --config.pe.train_context=256 '--config.eval.lengths=(256,512,1024,2048)' \
        --config.eval.num_sequences=256 --config.eval.batch_size=8 --seeds=0,1,2

Hardware: one GPU or TPU host at the reference's scale; a 2-core CPU runs
the CPU scale in 1.0 to 4.4 minutes a run (the kept runs' logs, beside other
work).

Expected result: none known. The reference ships no results of this scan,
and the paper's statement that a larger forced shear hurts the long lengths
(copied) is about WikiText (configs/wikitext_eta.py), not this scan. Measured here at CPU
scale (jrope 4283dc2, 2026-12-05, the 2-core development machine, seeds 0, 1,
2; docs/results.md, the forced-shear ablation, runs kept in
docs/runs/c_eta_scan_cpu): the damping decides accuracy at 2048 (0.77 to 0.83
for c 0.1, 0.58 to 0.61 for c 0.5, about 0.5 for c 1 and 2), and eta from
0.002 to 0.01 moves it in no consistent direction: at c 0.1 by less than
the seed spread, at c 0.5 by up to 0.035, more than two of its three seed
spreads.
"""

from configs import synthetic_eta_scan


def get_config():
    config = synthetic_eta_scan.get_config()
    config.pe.name = "jordan_exact_c100_eta002"  # jordan_exact_c{010,050,100,200}_eta{002,005,010}
    return config
