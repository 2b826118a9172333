"""The reference's bounded-shear (eta_max) scan on byte-level WikiText-103.

The reference's `phase2_wikitext103_subset_boundary_500*.yaml`: stabilized
Jordan-RoPE with its shear bound `eta_max` lowered from 0.1 to 0.05, 0.03,
0.02 and 0.01, beside RoPE and damped RoPE (which have no shear). v2's data
and steps (the first 1% of the training lines, L = 512, batch 4, 500 steps,
lr 5e-4, weight decay 0.05) with a smaller model: d_model 128, 4 heads, 3
layers, MLP 2x; evaluation at 512, 1024, 2048 on 4 validation windows per
length, seed 0. Data set-up as in configs/wikitext_scaled_exact.py.

Commands: the base run (`..._boundary_500.yaml`), then one comparison per
bound (`..._500_eta02`: rope, damped_rope and jordan_rope; `_eta01`,
`_eta03`, `_eta05`: jordan_rope alone):

    python -m jrope.compare --config=configs/wikitext_boundary.py \
        --methods=rope,damped_rope,jordan_rope --seeds=0 --workdir=runs/wikitext_boundary/eta_max_0.1
    python -m jrope.compare --config=configs/wikitext_boundary.py --config.pe.eta_max=0.02 \
        --methods=rope,damped_rope,jordan_rope --seeds=0 --workdir=runs/wikitext_boundary/eta_max_0.02
    python -m jrope.compare --config=configs/wikitext_boundary.py --config.pe.eta_max=0.01 \
        --methods=jordan_rope --seeds=0 --workdir=runs/wikitext_boundary/eta_max_0.01

(and likewise 0.03, 0.05). The reference's `_seeds12` variants are the same
commands with --seeds=1,2, which join seed 0's runs in the same workdir. A
bound only limits how far training can move the shear: every run starts at
eta = 0.

The long-context evaluation of the 0.02 runs
(`..._500_eta02_longctx_eval.yaml`: seeds 0, 1, 2, lengths 4096 and 8192, 2
windows per length; the reference trains the runs again for it) evaluates
the finished runs of the 0.02 comparison with --seeds=0,1,2:

    for method in rope damped_rope jordan_rope; do for seed in 0 1 2; do
      python eval.py --workdir=runs/wikitext_boundary/eta_max_0.02/$method/seed$seed \
          '--config.eval.lengths=(4096,8192)' --config.eval.num_sequences=2 --config.eval.batch_size=2
    done; done

Each run's eval_step500/ then holds lengths 512 .. 8192. The windows at a
length are the first ones of any count, so the 2 at 4096 and 8192 do not
depend on the 4 at the shorter lengths.

Hardware: one GPU or TPU host with 1, 2 or 4 devices; a 2-core CPU runs it
too (not timed).

Expected result: not measured with this code. The reference ships no
results; the paper's text ties a smaller bound to a smaller long-length
loss gap only through these runs (docs/reference.md, section 5).
"""

from configs import wikitext_v2


def get_config():
    config = wikitext_v2.get_config()
    config.pe.name = "jordan_rope"  # rope | damped_rope | jordan_rope
    config.pe.eta_max = 0.1  # the scanned bound: 0.1 | 0.05 | 0.03 | 0.02 | 0.01
    config.model.d_model = 128
    config.model.num_heads = 4  # head_dim 32
    config.model.num_layers = 3
    config.model.mlp_ratio = 2
    config.eval.lengths = (512, 1024, 2048)  # 1x .. 4x L
    config.eval.num_sequences = 4  # the reference's 4 batches of one window
    config.eval.batch_size = 4
    return config
