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

Hardware: a 2-core CPU. On the development machine, shared with other jobs,
training ran at about 0.9 steps/s (about 23 minutes for 1200 steps); a run
of 250 steps with its evaluation on 256 sequences per length took about 8.

Measured result (seed 0, 250 steps, --config.num_steps=250; accuracy on 256
sequences per length at 256 / 512 / 1024 / 2048):

    rope                 0.883  0.805  0.879  0.816
    direct_sum           0.629  0.461  0.480  0.496
    jordan_rope          0.930  0.895  0.867  0.824
    jordan_raw_tau       0.863  0.820  0.820  0.738
    jordan_exact_scaled  0.930  0.719  0.598  0.480
    rope_alibi           0.934  0.812  0.668  0.547

The full 1200 steps (the command above, seed 0; accuracy on the config's
32 sequences per length at 256 / 512 / 1024 / 2048; about 16 to 18 minutes
each on the shared machine, 1.3 GB peak memory):

    rope                 0.938  0.906  0.875  0.750
    jordan_rope          1.000  0.938  0.875  0.812

Three seeds and the other methods at 1200 steps have not been run at this
scale yet.
"""

from configs import synthetic


def get_config():
    config = synthetic.get_config()
    config.pe.train_context = 256  # L (shared with task.seq_len)
    config.eval.lengths = (256, 512, 1024, 2048)  # 1x .. 8x the training length
    config.eval.batch_size = 8  # length 2048 fits easily in memory
    config.checkpoint.every_steps = 400  # three checkpoints over the run
    config.log.every_steps = 100  # a progress line every 100 steps
    return config
