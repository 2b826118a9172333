"""Byte-level WikiText-103, the paper's v2 setting.

The v1 base (configs/wikitext_scaled_exact.py) trained on the first 1% of
the training split's lines with a smaller model: d_model 192, 4 heads,
3 layers, MLP 2x, L = 512, batch 4, 500 steps, lr 5e-4, weight decay 0.05,
evaluation at 512 .. 8192 on 2 validation windows per length, as the
reference's configs/high_jet_wikitext103_subset_500_seeds012.yaml (2 batches
of one window), the same for every method and seed. Data set-up as in the
base's docstring.

Methods: the reference's twelve (METHODS below, its v2 config's list, seeds
0, 1, 2), among them the order-3 and order-4 chains and
`jordan_exact_c100_eta002`: scaled-exact Jordan-RoPE with c = 1 (initial
damping gamma = 1/L, as `jordan_exact_scaled`) started at eta 0.002 instead
of 0. The default encoding is `jordan_rope`, the list's stabilized
Jordan-RoPE. `jordan_exact_scaled` itself is in no WikiText config of the
reference.

Commands (one method and seed per run, or the whole grid):

    python train.py --config=configs/wikitext_v2.py \
        --config.pe.name=jordan_exact_c100_eta002 --workdir=runs/wikitext_v2/jordan_exact_c100_eta002/0
    python -m jrope.compare --config=configs/wikitext_v2.py --seeds=0,1,2 \
        --methods=rope,damped_rope,rope_alibi,direct_sum,jordan_rope,jordan_exact_c100_eta002,jordan_m3,jordan_m4,jordan_exact_m3_c010_eta100_eta1,jordan_exact_m3_c100_eta100_eta1,jordan_exact_m4_c010_eta100_eta1,jordan_exact_m4_c100_eta100_eta1 \
        --workdir=runs/wikitext_v2

Hardware: one GPU or TPU host with 1, 2 or 4 devices (batch 4); a CPU runs
it too, slowly (evaluation at 8192 dominates).

Expected result: not measured with this code. The paper reports mean losses
of 1.796 for rope_alibi, 1.869 for scaled-exact Jordan-RoPE (c = 1) and
1.884 for damped_rope (copied from the paper). Which setting they come from
is an inference: this one (rope_alibi, jordan_exact_c100_eta002, damped_rope)
or the v1 setting of configs/wikitext_scaled_exact.py (docs/reference.md,
section 5).
"""

from configs import wikitext_scaled_exact

# The reference's v2 method list, in its order (the --methods of the comparison above).
METHODS = (
    "rope",
    "damped_rope",
    "rope_alibi",
    "direct_sum",
    "jordan_rope",
    "jordan_exact_c100_eta002",
    "jordan_m3",
    "jordan_m4",
    "jordan_exact_m3_c010_eta100_eta1",
    "jordan_exact_m3_c100_eta100_eta1",
    "jordan_exact_m4_c010_eta100_eta1",
    "jordan_exact_m4_c100_eta100_eta1",
)


def get_config():
    config = wikitext_scaled_exact.get_config()
    config.pe.name = "jordan_rope"  # any of METHODS
    config.data.train_fraction = 0.01  # the split's first 1% of lines
    config.model.d_model = 192
    config.model.num_heads = 4  # head_dim 48
    config.model.num_layers = 3
    config.model.mlp_ratio = 2
    config.pe.train_context = 512  # L (the data's seq_len too)
    config.num_steps = 500
    config.opt.learning_rate = 5e-4
    config.opt.weight_decay = 0.05
    config.checkpoint.every_steps = 100
    config.eval.lengths = (512, 1024, 2048, 4096, 8192)  # 1x .. 16x L
    config.eval.num_sequences = 2  # validation windows per length, the reference's count
    config.eval.batch_size = 2
    return config
