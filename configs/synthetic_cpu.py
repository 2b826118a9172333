"""Jordan-friendly synthetic LM at CPU scale: the full config with L = 256.

Same model, optimizer and steps as configs/synthetic.py; the training length
is 256 and evaluation runs at 256 .. 2048 (the paper's 8x extrapolation).

Command:

    python train.py --config=configs/synthetic_cpu.py \
        --config.pe.name=jordan_rope --workdir=runs/synthetic_cpu_one
    python eval.py --config=configs/synthetic_cpu.py \
        --config.pe.name=jordan_rope --workdir=runs/synthetic_cpu_one

The paper's method list over seeds, with the comparison table
(resumable; finished runs are kept), on 256 evaluation sequences per length:
more than the reference's 32, for a tighter estimate at CPU scale:

    python -m jrope.compare --config=configs/synthetic_cpu.py \
        --config.eval.num_sequences=256 --seeds=0,1,2 --workdir=runs/synthetic_cpu \
        --methods=rope,direct_sum,jordan_rope,jordan_raw_tau,jordan_exact_scaled,rope_alibi

Hardware: a 2-core CPU; a 1200-step run with its evaluation on 256
sequences per length takes 5 to 20 minutes depending on the machine's load.

Measured result (the comparison command above, 2026-12-01; accuracy at
256 / 512 / 1024 / 2048, mean ± sample standard deviation over seeds 0, 1, 2;
docs/results.md, section 2):

    rope                 0.958 ± 0.006  0.918 ± 0.037  0.883 ± 0.008  0.836 ± 0.044
    direct_sum           0.909 ± 0.023  0.470 ± 0.035  0.492 ± 0.007  0.510 ± 0.026
    jordan_rope          0.932 ± 0.018  0.878 ± 0.029  0.885 ± 0.026  0.870 ± 0.039
    jordan_raw_tau       0.957 ± 0.004  0.919 ± 0.016  0.862 ± 0.024  0.784 ± 0.129
    jordan_exact_scaled  0.960 ± 0.010  0.833 ± 0.032  0.695 ± 0.012  0.578 ± 0.050
    rope_alibi           0.938 ± 0.041  0.833 ± 0.020  0.673 ± 0.009  0.568 ± 0.019
"""

from configs import synthetic


def get_config():
    config = synthetic.get_config()
    config.pe.train_context = 256  # L (the data's seq_len too)
    config.eval.lengths = (256, 512, 1024, 2048)  # 1x .. 8x the training length
    config.eval.batch_size = 8  # length 2048 fits easily in memory
    config.checkpoint.every_steps = 400  # three checkpoints over the run
    config.log.every_steps = 100  # a progress line every 100 steps
    return config
