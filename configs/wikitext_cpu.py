"""Byte-level language modelling at CPU scale on real WikiText-2 text.

The WikiText base (configs/wikitext_scaled_exact.py) on local text files and
a small model: trained on WikiText-2's validation text, evaluated on its test
text (the same articles as WikiText-103's validation and test splits).
d_model 128, 4 heads, 3 layers, MLP 2x, L = 256, batch 8, 200 steps,
lr 1e-3, weight decay 0.05; evaluation at 256 .. 2048 (8x L) on 16 fixed
test-text windows per length.

The text paths default to ``../shared/data/wikitext2/{valid,test}.txt``
relative to the repository root (where the development machines keep
WikiText-2); point them at any UTF-8 text, a file or a directory, with
--config.data.path and --config.data.eval_path.

Command (the four-method comparison below, run one after the other):

    for m in rope rope_alibi damped_rope jordan_exact_scaled; do
      python train.py --config=configs/wikitext_cpu.py \
          --config.pe.name=$m --workdir=runs/wikitext_cpu/$m/0
    done

Hardware: a 2-core CPU. The four runs took 960 s together (171 to 288 s
each) on a development machine whose 2 cores other jobs shared (load 7).

Measured result (seed 0, 2026-11-30; test-text loss in nats/byte, bits/byte
in brackets for the mean; 16 windows per length, so differences below a few
hundredths are within noise):

    method               256     512     1024    2048    mean
    rope                 2.0519  2.1541  2.2171  2.3059  2.1823 (3.148)
    rope_alibi           2.0516  2.1273  2.1592  2.1438  2.1205 (3.059)
    damped_rope          2.0771  2.2342  2.3036  2.3348  2.2374 (3.228)
    jordan_exact_scaled  2.0456  2.1192  2.1452  2.1464  2.1141 (3.050)
"""

import os

from configs import wikitext_scaled_exact

# <repo>/../shared/data/wikitext2, found from this file so that any working directory works.
_WIKITEXT2 = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "shared", "data", "wikitext2"
)


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
    config.num_steps = 200
    config.opt.learning_rate = 1e-3
    config.opt.weight_decay = 0.05
    config.checkpoint.every_steps = 200  # only the final state
    config.log.every_steps = 50
    config.eval.lengths = (256, 512, 1024, 2048)  # 1x .. 8x L
    config.eval.num_sequences = 16
    config.eval.batch_size = 8
    return config
