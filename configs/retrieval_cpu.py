"""Key-value retrieval at CPU scale: the reference's task, shrunk to train in minutes on 2 cores.

configs/retrieval.py with L = 64, 4 pairs of 16 keys and 16 values, a model
of d_model 128, 4 heads, 2 layers, MLP 2x, batch 64, lr 1e-3, 3000 steps,
evaluated at 64 .. 512 (8x L) on 128 fixed sequences per length, with random
key-to-query distances and at the distances 8 .. 500 that fit each length.

Command:

    python -m jrope.compare --config=configs/retrieval_cpu.py \
        --methods=rope,rope_alibi,jordan_rope,jordan_raw_tau --seeds=0 --workdir=runs/retrieval_cpu

Hardware: a 2-core CPU; 3.0 to 4.9 minutes a run (the kept runs' logs, a 2-core AMD EPYC
development machine beside other work).

Measured (seed 0, 2026-12-05 at jrope 4283dc2, runs kept in docs/runs/retrieval_cpu;
docs/results.md, section 6): none of rope, rope_alibi, jordan_rope,
jordan_raw_tau learns the retrieval in 3000 steps;
each stays near the plateau of picking one of the 4 values present (accuracy
0.117 to 0.391 at every length), so this scale does not order the encodings.
"""

from configs import retrieval


def get_config():
    config = retrieval.get_config()
    config.model.d_model = 128
    config.model.num_heads = 4  # head_dim 32
    config.model.num_layers = 2
    config.model.mlp_ratio = 2
    config.pe.train_context = 64  # L (the data's seq_len too)
    config.num_steps = 3000
    config.batch_size = 64
    config.data.num_pairs = 4
    config.data.num_keys = 16
    config.data.num_values = 16
    config.data.eval_distances = (8, 16, 32, 60, 120, 250, 500)
    config.opt.learning_rate = 1e-3
    config.checkpoint.every_steps = 1000
    config.log.every_steps = 250
    config.eval.lengths = (64, 128, 256, 512)  # 1x .. 8x L
    config.eval.num_sequences = 128  # CPU scale: half the reference's 256, to fit the time
    config.eval.batch_size = 32
    return config
