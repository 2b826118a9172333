"""The quick start: Jordan-RoPE on the paper's synthetic task, small enough for a laptop CPU.

    python train.py --config=configs/quickstart.py --workdir=runs/quickstart

The synthetic CPU experiment (configs/synthetic_cpu.py: d_model 128, 4
heads, 3 layers, L 256, batch 24, generated data, nothing to download),
stabilized Jordan-RoPE, 250 steps, then evaluated on 32 fixed sequences at
1x to 8x the training length (256 .. 2048). The console shows the progress,
the evaluation table and what to run next.

Hardware: a 2-core CPU (README, Quick start, for the time it took).

Measured result (seed 0, 2026-12-06, the 2-core Intel Xeon development
machine; tests/test_documented_results.py checks it): accuracy 0.906, 0.906,
0.906 and 0.781 at lengths 256, 512, 1024 and 2048 (mean 0.875), each on 32
sequences. Another CPU model prints numbers a little apart: a 2-core AMD EPYC
machine printed 0.875 at 256 (mean 0.867; README, Quick start).
"""

from configs import synthetic_cpu


def get_config():
    config = synthetic_cpu.get_config()
    config.pe.name = "jordan_rope"  # stabilized Jordan-RoPE (the paper's method)
    config.num_steps = 250  # enough to beat chance well at 8x the training length
    config.checkpoint.every_steps = 125  # one checkpoint half-way, and the final one
    config.log.every_steps = 50  # five progress lines
    config.eval.num_sequences = 32  # per length: a quick estimate (binomial error up to 0.09)
    return config
