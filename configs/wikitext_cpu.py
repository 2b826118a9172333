"""Byte-level language modelling at CPU scale on WikiText-2.

The WikiText base (configs/wikitext_scaled_exact.py) with a small model on
WikiText-2 (raw), through the same TFDS builder machinery as WikiText-103
(jrope/data/wikitext.py): trained on its train split, evaluated on its
validation split. d_model 128, 4 heads, 3 layers, MLP 2x, L = 256, batch 8,
200 steps, lr 1e-3, weight decay 0.05; evaluation at 256 .. 2048 (8x L) on
16 fixed windows per length.

Data: prepared once on first use (4.5 MiB download where the network
allows, else put wikitext-2-raw-v1.zip, or the extracted
wiki.{train,valid,test}.raw, in --config.data.manual_dir; without either the
command stops at once and says what to do), or any UTF-8 text with
--config.data.source=text --config.data.path=... --config.data.eval_path=....

Command (one run; docs/results.md, section 3, has the comparison over seeds):

    python train.py --config=configs/wikitext_cpu.py \
        --config.pe.name=jordan_exact_scaled --workdir=runs/wikitext_cpu_one

Hardware: a 2-core CPU; a run with its evaluation took 0.8 to 1.6 minutes (the kept
runs' logs, a 2-core AMD EPYC development machine beside other work).

Measured result (docs/results.md, section 3; 2026-12-04/05 at jrope 4283dc2, seeds
0-2, runs kept in docs/runs/wikitext_cpu): on WikiText-2's
word-level validation text (training) and test text (evaluation) through
--config.data.source=text, scaled-exact Jordan-RoPE and RoPE+ALiBi lose
least out to 8x the training length (test loss at 2048: 2.164 and 2.188
nats/byte, means over seeds, up 0.103 and 0.142 from 256; RoPE+ALiBi's seed
2 from 2.057 to 2.293) while RoPE (2.367), damped RoPE (2.380), the direct
sum (2.370) and stabilized Jordan-RoPE (2.373) degrade more.
"""

from configs import wikitext_scaled_exact


def get_config():
    config = wikitext_scaled_exact.get_config()
    config.data.source = "wikitext2"
    config.model.d_model = 128
    config.model.num_heads = 4  # head_dim 32
    config.model.num_layers = 3
    config.model.mlp_ratio = 2
    config.pe.train_context = 256  # L (the data's seq_len too)
    config.batch_size = 8
    config.num_steps = 200
    config.opt.learning_rate = 1e-3
    config.opt.weight_decay = 0.05
    config.checkpoint.every_steps = 200  # only the final state
    config.log.every_steps = 50
    config.eval.lengths = (256, 512, 1024, 2048)  # 1x .. 8x L
    config.eval.num_sequences = 16  # the v1 config's (and the reference's) count
    config.eval.batch_size = 8
    return config
