"""Key-value retrieval at CPU scale: the reference's task, shrunk to train in minutes on 2 cores.

configs/retrieval.py with L = 128, 8 pairs of 32 keys and 32 values, a model
of d_model 128, 4 heads, 2 layers, MLP 2x, batch 32, lr 1e-3, evaluated at
128 .. 1024 (8x L) on 128 fixed sequences per length, with random key-to-query
distances and at the distances 16 .. 1000 that fit each length.

Command:

    python -m jrope.compare --config=configs/retrieval_cpu.py \
        --methods=nope,rope,alibi,rope_alibi,damped_rope,direct_sum,jordan_rope,jordan_raw_tau \
        --seeds=0 --workdir=runs/retrieval_cpu

Hardware: a 2-core CPU.

Measured result: README, "Key-value retrieval".
"""

from configs import retrieval


def get_config():
    config = retrieval.get_config()
    config.model.d_model = 128
    config.model.num_heads = 4  # head_dim 32
    config.model.num_layers = 2
    config.model.mlp_ratio = 2
    config.pe.train_context = 128  # L (shared with data.seq_len)
    config.num_steps = 1500
    config.batch_size = 32
    config.data.num_pairs = 8
    config.data.num_keys = 32
    config.data.num_values = 32
    config.data.eval_distances = (16, 32, 64, 120, 250, 500, 1000)
    config.opt.learning_rate = 1e-3
    config.checkpoint.every_steps = 500
    config.log.every_steps = 100
    config.eval.lengths = (128, 256, 512, 1024)  # 1x .. 8x L
    config.eval.num_sequences = 128
    config.eval.batch_size = 32
    return config
