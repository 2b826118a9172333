"""Jordan-friendly synthetic LM at CPU scale: the full config with L = 256.

Same model, optimizer and steps as configs/synthetic.py; the training length
is 256 and evaluation runs at 256 .. 2048 (the paper's 8x extrapolation).

Command:

    python train.py --config=configs/synthetic_cpu.py \
        --config.pe.name=jordan_rope --workdir=runs/synthetic_cpu_one
    python eval.py --config=configs/synthetic_cpu.py \
        --config.pe.name=jordan_rope --workdir=runs/synthetic_cpu_one

The paper's three headline methods over seeds, with the comparison table
(resumable; finished runs are kept), on 256 evaluation sequences per length:
more than the reference's 32, for a tighter estimate at CPU scale (add
jordan_raw_tau, jordan_exact_scaled, rope_alibi for the paper's other three):

    python -m jrope.compare --config=configs/synthetic_cpu.py \
        --config.eval.num_sequences=256 --seeds=0,1,2 --workdir=runs/synthetic_cpu \
        --methods=rope,direct_sum,jordan_rope

Hardware: a 2-core CPU; a 1200-step run with its evaluation on 256
sequences per length took 3.5 to 3.8 minutes (the kept runs' logs, a 2-core
AMD EPYC development machine beside other work).

Measured result (the comparison command above, 2026-12-05, at jrope 4283dc2, runs
kept in docs/runs/synthetic_cpu; accuracy at
256 / 512 / 1024 / 2048, mean ± sample standard deviation over seeds 0, 1, 2;
docs/results.md, section 2):

    rope         0.961 ± 0.014  0.935 ± 0.015  0.849 ± 0.016  0.794 ± 0.012
    direct_sum   0.884 ± 0.035  0.447 ± 0.016  0.518 ± 0.022  0.488 ± 0.027
    jordan_rope  0.961 ± 0.004  0.913 ± 0.015  0.874 ± 0.010  0.852 ± 0.023
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
