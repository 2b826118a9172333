"""The forced-shear (eta) ablation on byte-level WikiText-103, the paper's v1 setting.

Stabilized Jordan-RoPE with a forced initial shear: `jordan_eta020` and
`jordan_eta050` start eta at 0.02 and 0.05 (bound eta_max 0.1, bounded shear
time) where `jordan_rope` starts it at 0. The paper reports that the larger
forced eta worsens the long-length loss, against scaled-exact Jordan-RoPE
(`jordan_exact_scaled`, configs/wikitext_scaled_exact.py).

The setting is the reference's configs/lm_focused.yaml, the one reference
config that runs these two names on WikiText: WikiText-103 (raw, bytes),
d_model 384, 6 heads, 6 layers, MLP 4x, L = 1024, batch 4, 1000 steps, lr
3e-4, weight decay 0.1, evaluation at 1024 .. 8192 on 16 windows of one
sequence per length, seeds 0, 1, 2, with jordan_rope (eta 0) beside the two
(the reference has no WikiText config with jordan_exact_scaled, so the runs
behind the paper's comparison with it are an inference: docs/reference.md,
section 5). This is configs/wikitext_scaled_exact.py with the
encoding and the window count changed.

Commands (one method and seed per run, on one GPU or TPU host), or the whole
grid through the comparison:

    python train.py --config=configs/wikitext_eta.py --workdir=runs/wikitext_eta/jordan_eta020/0
    python -m jrope.compare --config=configs/wikitext_eta.py \
        --methods=jordan_exact_scaled,jordan_rope,jordan_eta020,jordan_eta050 \
        --seeds=0,1,2 --workdir=runs/wikitext_eta

Data and hardware: as configs/wikitext_scaled_exact.py.

Measured at CPU scale (configs/wikitext_cpu.py on WikiText-2 text, three
seeds): docs/results.md, "The forced-shear (eta) ablation".
"""

from configs import wikitext_scaled_exact


def get_config():
    config = wikitext_scaled_exact.get_config()
    config.pe.name = "jordan_eta020"  # or jordan_eta050 | jordan_rope | jordan_exact_scaled
    config.eval.num_sequences = 16  # the reference's lm_focused.yaml: 16 windows per length
    return config
