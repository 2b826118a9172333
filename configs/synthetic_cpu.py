"""Jordan-friendly synthetic LM at CPU scale: the full config with L = 256.

Same model, optimizer and steps as configs/synthetic.py; the training length
is 256 and evaluation runs at 256 .. 2048 (the paper's 8x extrapolation).

Command:

    python train.py --config=configs/synthetic_cpu.py \
        --config.pe.name=jordan_rope --workdir=runs/synthetic_cpu/jordan_rope/0
    python eval.py --config=configs/synthetic_cpu.py \
        --config.pe.name=jordan_rope --workdir=runs/synthetic_cpu/jordan_rope/0

The paper's method list over seeds, with the comparison table
(resumable; finished runs are kept):

    python -m jrope.compare --config=configs/synthetic_cpu.py \
        --config.eval.num_sequences=256 --seeds=0,1,2 --workdir=runs/synthetic_cpu \
        --methods=rope,direct_sum,jordan_rope,jordan_raw_tau,jordan_exact_scaled,rope_alibi

Hardware: a 2-core CPU. A 1200-step run with its evaluation on 256
sequences per length took 8 to 13 minutes on the development machine.

Measured result, 1200 steps (seeds 0, 1, 2, --config.eval.num_sequences=256;
accuracy at 256 / 512 / 1024 / 2048, mean ± sample standard deviation over
seeds):

    rope                 0.948 ± 0.018  0.918 ± 0.004  0.875 ± 0.031  0.836 ± 0.038
    jordan_rope          0.958 ± 0.009  0.888 ± 0.045  0.900 ± 0.025  0.897 ± 0.053

All six methods at 250 steps (--config.num_steps=250, same seeds and
evaluation):

    rope                 0.848 ± 0.040  0.785 ± 0.031  0.741 ± 0.133  0.673 ± 0.160
    direct_sum           0.633 ± 0.049  0.507 ± 0.040  0.487 ± 0.011  0.497 ± 0.022
    jordan_rope          0.902 ± 0.041  0.836 ± 0.079  0.805 ± 0.143  0.767 ± 0.171
    jordan_raw_tau       0.902 ± 0.034  0.848 ± 0.024  0.854 ± 0.030  0.740 ± 0.018
    jordan_exact_scaled  0.893 ± 0.057  0.715 ± 0.072  0.559 ± 0.064  0.496 ± 0.031
    rope_alibi           0.889 ± 0.039  0.740 ± 0.069  0.642 ± 0.023  0.539 ± 0.007
"""

from configs import synthetic


def get_config():
    config = synthetic.get_config()
    config.pe.train_context = 256  # L (shared with data.seq_len)
    config.eval.lengths = (256, 512, 1024, 2048)  # 1x .. 8x the training length
    config.eval.batch_size = 8  # length 2048 fits easily in memory
    config.checkpoint.every_steps = 400  # three checkpoints over the run
    config.log.every_steps = 100  # a progress line every 100 steps
    return config
