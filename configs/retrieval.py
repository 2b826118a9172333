"""Key-value retrieval at the reference's scale: recall a key's value across a long context.

A sequence of length L holds 32 (key, value) token pairs (128 keys, 128
values) in filler and ends with [QUERY, key]; the model predicts that key's
value at the last position (cross-entropy over the whole vocabulary;
jrope/data/retrieval.py). The reference's settings (configs/full_research.yaml,
retrieval): d_model 256, 8 heads, 4 layers, MLP 4x, L = 1024, batch 16,
2000 steps, AdamW 3e-4, weight decay 0.01; evaluation at 1024 .. 8192 on 256
fixed sequences per length with random key-to-query distances, and at each
controlled distance 64 .. 4096 that fits the length.

Command (one method and seed per run; the reference's methods are nope,
rope, alibi, rope_alibi, damped_rope, real_jordan, direct_sum, jordan_rope,
and the ablations jordan_no_gamma, jordan_raw_tau):

    python train.py --config=configs/retrieval.py --config.pe.name=jordan_rope \
        --workdir=runs/retrieval/jordan_rope/0
    python -m jrope.compare --config=configs/retrieval.py --methods=rope,jordan_rope \
        --seeds=0,1,2 --workdir=runs/retrieval

Results: <workdir>/eval_step2000/eval.{csv,md} hold accuracy per length and,
in the rows with a distance, per length and key-to-query distance.

Hardware: one GPU or TPU host (the global batch of 16 is split over the
`data` axis: 1, 2, 4, 8 or 16 devices); evaluation at 4096 and 8192 runs
blockwise. A 2-core CPU needs configs/retrieval_cpu.py.

Expected result: not measured with this code at this scale (no accelerator
was available); configs/retrieval_cpu.py has the CPU-scale measurement.
"""

from ml_collections import config_dict

from configs import base


def get_config() -> config_dict.ConfigDict:
    config = base.get_config(
        train_context=1024, d_model=256, num_heads=8, num_layers=4, mlp_ratio=4
    )
    config.num_steps = 2000  # optimizer steps
    config.batch_size = 16  # global batch (sequences per step)
    config.model.readout = "last"  # the loss reads the last position only, so only it is computed
    config.pe.name = "jordan_rope"

    config.data = config_dict.ConfigDict()  # jrope.data.retrieval.RetrievalConfig
    config.data.source = "retrieval"  # the data source (jrope.data.source.SOURCES)
    config.data.seed = config.get_ref("seed")  # data seed (the same as the run's seed)
    config.data.num_pairs = 32  # (key, value) pairs per sequence
    config.data.num_keys = 128  # key tokens (distinct within a sequence)
    config.data.num_values = 128  # value tokens
    # key-to-query distances evaluated at every evaluation length they fit in (d < length - 2;
    # the reference's list: 8192 fits none of the lengths)
    config.data.eval_distances = (64, 128, 256, 512, 1024, 2048, 4096, 8192)

    config.opt.learning_rate = 3e-4  # constant learning rate
    config.opt.weight_decay = 0.01  # decoupled AdamW weight decay

    config.checkpoint.every_steps = 500  # periodic save interval
    config.log.every_steps = 100  # progress line interval
    config.eval.lengths = (1024, 2048, 4096, 8192)  # evaluation lengths (1x .. 8x L)
    # Per length and per distance: the reference's count (32 batches of 8), which it draws from
    # the run's own generator; here fixed by eval.seed, the same for every seed and method.
    config.eval.num_sequences = 256
    config.eval.batch_size = 8  # sequences per evaluation batch
    return config
