"""The reference's forced-shear scan on the Jordan-friendly synthetic LM.

The reference's `phase2_kernel_lm_stage3_bounded_eta_scan.yaml`: stabilized
Jordan-RoPE started at a forced shear eta0 = 0, 0.002, 0.005, 0.01, 0.02,
0.05 (`jordan_rope`, `jordan_eta002` .. `jordan_eta050`; bound eta_max 0.1),
the model of configs/synthetic.py trained for 300 steps at batch 16 and
evaluated at 1024 .. 8192 on 8 sequences per length, seed 0.

Command:

    python -m jrope.compare --config=configs/synthetic_eta_scan.py --seeds=0 \
        --methods=jordan_rope,jordan_eta002,jordan_eta005,jordan_eta010,jordan_eta020,jordan_eta050 \
        --workdir=runs/synthetic_eta_scan

The reference's `phase2_kernel_lm_stage3_bounded_candidates_seeds12.yaml`
runs three of these methods on seeds 1 and 2: the same command with
--methods=jordan_rope,jordan_eta002,jordan_eta010 --seeds=1,2.

Hardware: one GPU or TPU host (batch 16 over 1, 2, 4, 8 or 16 devices); a
2-core CPU runs it too (not timed).

Expected result: not measured at this scale; the reference ships no results.
With 8 sequences per length an accuracy moves in steps of 0.125. Measured
here at CPU scale (L 256, evaluated to 2048 on 256 sequences, seeds 0, 1, 2:
the command in docs/results.md, the forced-shear ablation, runs kept in
docs/runs/eta_scan_cpu; jrope 4283dc2, 2026-12-05, the 2-core development
machine): accuracy at 2048 0.794 ± 0.072 at eta 0, 0.827 ± 0.035 at 0.002,
0.69 to 0.73 at 0.005 to 0.02 and 0.628 ± 0.015 at 0.05. Only 0.05 is lower
than eta 0 in every seed: 0.005 ties it in seed 0, 0.01 in seed 1, and 0.02
is higher in seed 1.
"""

from configs import synthetic


def get_config():
    config = synthetic.get_config()
    config.num_steps = 300  # optimizer steps
    config.batch_size = 16  # global batch
    config.checkpoint.every_steps = 100
    config.eval.num_sequences = 8  # the reference's 8 batches of one sequence
    config.eval.batch_size = 4
    return config
