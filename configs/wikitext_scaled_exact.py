"""Byte-level WikiText-103, the v1 setting, with scaled-exact Jordan-RoPE.

The base of every WikiText config (wikitext_v2.py and wikitext_cpu.py start
from it). Other methods are the same config with another encoding:
--config.pe.name=rope | rope_alibi | damped_rope | direct_sum | jordan_rope.
The setting is the reference's configs/lm_focused.yaml; its runs are eight
other methods, plain alibi among them and scaled-exact Jordan-RoPE not: the
last command below runs them.

Data: the raw WikiText-103 bytes through the TFDS builder of
jrope/data/wikitext.py, prepared once on first use (download where the
network allows; else put wikitext-103-raw-v1.zip, or the extracted
wiki.{train,valid,test}.raw, in --config.data.manual_dir, by default
~/tensorflow_datasets/downloads/manual). Without either the command stops at
once and says what to do. Training windows come from the train split,
evaluation windows from the validation split: 16 per length, as the
reference's configs/lm_focused.yaml (16 batches of one window), fixed by
eval.seed whatever the run's seed and method, so every method and seed is
scored on the same windows (the reference fixes them by its own evaluation
seed; its windows are not these, being drawn by another generator).

Commands (one method and seed per run; seeds 0, 1, 2), and the reference's v1
list over seeds:

    python train.py --config=configs/wikitext_scaled_exact.py \
        --workdir=runs/wikitext/jordan_exact_scaled/0
    python train.py --config=configs/wikitext_scaled_exact.py --config.pe.name=rope_alibi \
        --config.seed=1 --workdir=runs/wikitext/rope_alibi/1
    python -m jrope.compare --config=configs/wikitext_scaled_exact.py --seeds=0,1,2 \
        --methods=rope,alibi,rope_alibi,damped_rope,direct_sum,jordan_rope,jordan_eta020,jordan_eta050 \
        --workdir=runs/wikitext_v1

Results: <workdir>/eval_step1000/ (CSV, markdown table, plot) with loss in
nats per byte and bits per byte at each evaluation length.

Hardware: one GPU or TPU host with 1, 2 or 4 devices (the global batch of 4
is split over the `data` axis; with more devices set --config.mesh.data=4
--config.mesh.tensor=-1, the rest splitting the heads).
Evaluation at length 8192 runs through blockwise attention.

Expected result: not measured with this code at this scale. The paper reports
mean evaluation losses over lengths 1024 .. 8192 of 1.869 nats/byte for
scaled-exact Jordan-RoPE (c = 1), 1.884 for damped_rope and 1.796 for
rope_alibi (copied from the paper). That they come from this setting is an
inference: the reference runs scaled-exact c = 1 in no v1 config, and its v2
config (configs/wikitext_v2.py) runs it, as jordan_exact_c100_eta002, beside
rope_alibi and damped_rope on seeds 0-2 (docs/reference.md, section 5).
"""

from ml_collections import config_dict

from configs import base


def get_config() -> config_dict.ConfigDict:
    config = base.get_config(
        train_context=1024, d_model=384, num_heads=6, num_layers=6, mlp_ratio=4
    )
    config.num_steps = 1000  # optimizer steps
    config.batch_size = 4  # global batch (windows per step)
    config.pe.name = (
        "jordan_exact_scaled"  # or rope | rope_alibi | damped_rope | direct_sum | jordan_rope
    )

    config.data = config_dict.ConfigDict()  # jrope.data.text_bytes.TextDataConfig
    # wikitext103 | wikitext2 (TFDS builders) | text (local UTF-8 files) | audio_tokens
    config.data.source = "wikitext103"
    config.data.path = ""  # 'text', 'audio_tokens': training text (a file or a directory)
    config.data.eval_path = ""  # 'text', 'audio_tokens': evaluation text (a file or a directory)
    config.data.train_split = "train"  # WikiText: split to train on
    config.data.eval_split = "validation"  # WikiText: split to evaluate on
    config.data.train_fraction = 1.0  # leading fraction of the training rows (v2: 0.01)
    # 257: token = byte + 1, 0 reserved (the reference) | 256: the byte
    config.data.vocab_size = 257
    config.data.seed = config.get_ref("seed")  # data seed (the same as the run's seed)
    config.data.cache_dir = ""  # corpus byte caches ('' = ~/.cache/jrope/text_bytes)
    config.data.data_dir = ""  # TFDS data directory ('' = ~/tensorflow_datasets)
    config.data.manual_dir = ""  # archive or extracted files ('' = <data_dir>/downloads/manual)
    # How the rows become bytes: 'reference' is the paper's code's stream (blank lines empty,
    # every other line followed by an empty one); 'file' is the official file's text.
    config.data.wikitext_rows = "reference"
    # True: each training window is cut into articles at their title lines, positions restarting
    # at each, attention within an article only (jrope/data/text_bytes.py, "packing"); the
    # evaluation windows stay whole. The synthetic task does not pack (its label sits at the last
    # position of one fixed-length sequence).
    config.data.pack = False

    config.opt.learning_rate = 3e-4  # constant learning rate
    config.opt.weight_decay = 0.1  # decoupled AdamW weight decay

    config.eval.lengths = (1024, 2048, 4096, 8192)  # evaluation lengths (1x .. 8x L)
    config.eval.num_sequences = 16  # validation windows per length, the reference's count
    return config
