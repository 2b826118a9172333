"""Byte-level WikiText-103, the paper's v1 setting, scaled-exact Jordan-RoPE (experiments.md section 3).

The base of every WikiText config (wikitext_v2.py and wikitext_cpu.py start
from it). Other methods are the same config with another encoding:
--config.pe.name=rope | rope_alibi | damped_rope | direct_sum | jordan_rope.

Data: the raw WikiText-103 bytes through the TFDS builder of
jrope/data/wikitext.py, prepared once on first use (download where the
network allows; else put wikitext-103-raw-v1.zip, or the extracted
wiki.{train,valid,test}.raw, in --config.data.manual_dir, by default
~/tensorflow_datasets/downloads/manual). Without either the command stops at
once and says what to do. Training windows come from the train split,
evaluation windows from the validation split.

Command (one method and seed per run; seeds 0, 1, 2):

    python train.py --config=configs/wikitext_scaled_exact.py \
        --workdir=runs/wikitext/jordan_exact_scaled/0
    python train.py --config=configs/wikitext_scaled_exact.py --config.pe.name=rope_alibi \
        --config.seed=1 --workdir=runs/wikitext/rope_alibi/1

Results: <workdir>/eval_step1000/ (CSV, markdown table, plot) with loss in
nats per byte and bits per byte at each evaluation length.

Hardware: one GPU or TPU host with 1, 2 or 4 devices (the global batch of 4
is split over the `data` axis; with more devices set --config.mesh.data=4).
Evaluation at length 8192 runs through blockwise attention.

Expected result (the paper's, not yet reproduced with this code): mean
evaluation loss over lengths 1024 .. 8192 of about 1.869 nats/byte for
jordan_exact_scaled, 1.884 for damped_rope and 1.796 for rope_alibi (the best).
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    config = config_dict.ConfigDict()
    # Settings that two sections must share are FieldReferences: overriding one
    # (e.g. --config.pe.train_context=512) updates the other.
    train_length = config_dict.FieldReference(1024)
    seed = config_dict.FieldReference(0)

    config.experiment = "text_bytes"  # selects the data source (jrope.config_types.DATA_SOURCES)
    config.seed = seed  # parameter initialisation and data seed
    config.num_steps = 1000  # optimizer steps
    config.batch_size = 4  # global batch (windows per step)

    config.model = config_dict.ConfigDict()
    config.model.d_model = 384  # residual width
    config.model.num_heads = 6  # attention heads; head_dim = 64
    config.model.num_layers = 6  # Transformer blocks
    config.model.mlp_ratio = 4  # MLP hidden width = mlp_ratio * d_model
    config.model.compute_dtype = "float32"  # activations: float32 | bfloat16 (the paper: float32)
    config.model.attention_impl = "auto"  # auto | xla | einsum | blockwise
    config.model.blockwise_min_length = 4096  # 'auto' uses blockwise attention from this length on
    config.model.block_size = 512  # blockwise attention block length
    # none | full | dots_saveable: recompute blocks in the backward pass
    config.model.remat = "none"
    config.model.dropout_rate = 0.0  # residual dropout after attention and MLP (the paper: none)

    config.pe = config_dict.ConfigDict()
    # any paper name (math.md section 4), e.g. rope, rope_alibi
    config.pe.name = "jordan_exact_scaled"
    config.pe.train_context = train_length  # L of the encodings: tau(t) = t/(1+|t|/L), gamma = c/L
    config.pe.theta = 10000.0  # rotary base: omega_b = theta^(-2b/head_dim)
    config.pe.gamma_min = 1e-4  # damping floor: gamma = softplus(raw) + gamma_min
    config.pe.init_gamma = 1e-4  # initial damping
    config.pe.eta_max = 0.1  # shear bound: eta = eta_max * tanh(raw)
    config.pe.init_eta = 0.0  # initial shear

    config.data = config_dict.ConfigDict()  # jrope.data.text_bytes.TextDataConfig
    config.data.source = "wikitext103"  # 'wikitext103' (TFDS builder) | 'text' (local UTF-8 files)
    config.data.path = ""  # 'text' only: training text, a file or a directory
    config.data.eval_path = ""  # 'text' only: evaluation text, a file or a directory
    config.data.train_split = "train"  # 'wikitext103': split to train on
    config.data.eval_split = "validation"  # 'wikitext103': split to evaluate on
    config.data.train_fraction = 1.0  # leading fraction of the training rows (v2: 0.01)
    # 257: token = byte + 1, 0 reserved (the reference) | 256: the byte
    config.data.vocab_size = 257
    config.data.seq_len = train_length  # training window length L
    config.data.seed = seed  # data seed (the same as the run's seed)
    config.data.cache_dir = ""  # corpus byte caches ('' = ~/.cache/jrope/text_bytes)
    config.data.data_dir = ""  # TFDS data directory ('' = ~/tensorflow_datasets)
    config.data.manual_dir = ""  # archive or extracted files ('' = <data_dir>/downloads/manual)

    config.opt = config_dict.ConfigDict()
    config.opt.learning_rate = 3e-4  # constant learning rate
    config.opt.weight_decay = 0.1  # decoupled AdamW weight decay
    config.opt.b1 = 0.9  # Adam first-moment decay
    config.opt.b2 = 0.999  # Adam second-moment decay
    config.opt.eps = 1e-8  # Adam epsilon
    config.opt.clip_norm = 1.0  # global gradient-norm clip (0 = off)
    config.opt.schedule = "constant"  # constant | cosine
    config.opt.warmup_steps = 0  # linear warm-up steps
    config.opt.final_lr_ratio = 0.0  # cosine only: final / peak learning rate
    config.opt.nonfinite = "stop"  # NaN/Inf loss or grad norm: stop the run | skip the update

    config.mesh = config_dict.ConfigDict()
    config.mesh.data = -1  # data-parallel axis (-1: all devices left)
    config.mesh.fsdp = 1  # parameter-sharded data-parallel axis
    config.mesh.tensor = 1  # tensor-parallel axis (heads, MLP hidden)
    # Logical axis -> mesh axes (jrope.sharding); dims that do not divide are replicated.
    config.mesh.rules = (
        ("batch", ("data", "fsdp")),
        ("length", None),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("head_dim", None),
        ("mlp", "tensor"),
        ("vocab", None),
    )

    config.checkpoint = config_dict.ConfigDict()
    config.checkpoint.every_steps = 200  # periodic save interval (the last step is always saved)
    config.checkpoint.max_to_keep = 2  # older checkpoints are deleted

    config.log = config_dict.ConfigDict()
    config.log.every_steps = 50  # progress line / metrics.jsonl / TensorBoard interval
    config.log.tensorboard = True  # write <workdir>/tensorboard event files

    config.eval = config_dict.ConfigDict()
    config.eval.lengths = (1024, 2048, 4096, 8192)  # evaluation lengths (1x .. 8x L)
    config.eval.num_sequences = 32  # fixed validation windows per length
    config.eval.batch_size = 4  # windows per evaluation batch (memory at length 8192)
    config.eval.every_steps = 0  # evaluate during training every N steps (0: only at the end)
    return config
