"""The sections every training experiment shares, with the paper's common settings.

Not a runnable experiment: configs/synthetic.py,
configs/wikitext_scaled_exact.py, configs/signal_regression.py and
configs/retrieval.py start from `get_config(...)` and add their `data`
section and what differs (the other training configs start from those). The paper's shared setup: decoder-only,
pre-norm RMSNorm, attention without biases, GELU MLP, tied embeddings, no
dropout, AdamW with a constant learning rate, gradient clipping at 1.0,
float32.
"""

from ml_collections import config_dict


def get_config(
    *, train_context: int, d_model: int, num_heads: int, num_layers: int, mlp_ratio: int
) -> config_dict.ConfigDict:
    """Every section but `data`; `seed` is a FieldReference the data section shares (its length,
    head dim and rotary base are set from the model and pe sections where it is built)."""
    config = config_dict.ConfigDict()
    # A FieldReference: the data section's seed follows an override (--config.seed=1).
    config.seed = config_dict.FieldReference(0)  # parameter initialisation and data seed
    config.num_steps = 1000  # optimizer steps
    config.batch_size = 4  # global batch (sequences per step)

    config.model = config_dict.ConfigDict()
    config.model.d_model = d_model  # residual width
    config.model.num_heads = num_heads  # heads; head_dim = d_model / num_heads
    config.model.num_layers = num_layers  # Transformer blocks
    config.model.mlp_ratio = mlp_ratio  # MLP hidden width = mlp_ratio * d_model
    config.model.compute_dtype = "float32"  # activations: float32 | bfloat16 (the paper: float32)
    # auto | xla | cudnn | splash | blockwise | einsum; 'auto': splash on TPU and cuDNN
    # on GPU where they apply, blockwise where one map origin could overflow, else dense
    # (jrope/attention/selection.py)
    config.model.attention_impl = "auto"
    config.model.blockwise_min_length = 4096  # 'auto' uses blockwise attention from this length on
    # the largest learned damping gamma 'auto' plans for: one map origin over S keys
    # only while max_damping * S <= 80, else blockwise
    config.model.max_damping = 0.02
    # q.k and p.v dots: auto | default | high | highest; 'auto' is full float32 for
    # encodings whose logits cancel large products, the backend's default otherwise
    config.model.attention_precision = "auto"
    config.model.matmul_precision = "default"  # every other matmul: default | high | highest
    config.model.block_size = 512  # blockwise attention block length
    config.model.remat = (
        "none"  # none | full | dots_saveable: recompute blocks in the backward pass
    )
    config.model.readout = "all"  # all | last: the last block computes the last position only
    config.model.dropout_rate = 0.0  # residual dropout after attention and MLP (the paper: none)

    config.pe = config_dict.ConfigDict()
    config.pe.name = "rope"  # any paper name (docs/mathematics.md, section 4)
    # L of the encodings: tau(t) = t/(1+|t|/L), gamma = c/L; also the training length
    config.pe.train_context = train_context
    config.pe.theta = 10000.0  # rotary base: omega_b = theta^(-2b/head_dim)
    config.pe.gamma_min = 1e-4  # damping floor: gamma = softplus(raw) + gamma_min
    config.pe.init_gamma = 1e-4  # initial damping
    config.pe.eta_max = 0.1  # shear bound: eta = eta_max * tanh(raw)
    config.pe.init_eta = 0.0  # initial shear

    config.opt = config_dict.ConfigDict()
    config.opt.learning_rate = 5e-4  # peak (here constant) learning rate
    config.opt.weight_decay = 0.01  # decoupled AdamW weight decay
    config.opt.b1 = 0.9  # Adam first-moment decay
    config.opt.b2 = 0.999  # Adam second-moment decay
    config.opt.eps = 1e-8  # Adam epsilon
    config.opt.clip_norm = 1.0  # global gradient-norm clip (0 = off)
    config.opt.schedule = "constant"  # constant | cosine
    config.opt.warmup_steps = 0  # linear warm-up steps
    config.opt.final_lr_ratio = 0.0  # cosine only: final / peak learning rate
    config.opt.nonfinite = "stop"  # NaN/Inf loss or grad norm: stop the run | skip the update
    config.opt.max_consecutive_skips = 10  # 'skip' stops the run after this many skips in a row

    config.mesh = config_dict.ConfigDict()
    config.mesh.data = -1  # data-parallel axis (-1: all devices left)
    config.mesh.fsdp = 1  # parameter-sharded data-parallel axis
    config.mesh.tensor = 1  # tensor-parallel axis (heads, MLP hidden)
    # Logical axis -> mesh axes (jrope.train.setup); dims that do not divide are replicated.
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
    # A checkpoint without its digests is refused unless this is True (restored unchecked).
    config.checkpoint.accept_missing_digests = False
    # Settings a resume may change beyond eval, log, checkpoint, runtime, mesh: "opt.learning_rate".
    config.checkpoint.accept_changes = ""

    config.log = config_dict.ConfigDict()
    config.log.every_steps = 50  # progress line / metrics.jsonl / TensorBoard interval
    config.log.tensorboard = True  # write <workdir>/tensorboard event files

    config.eval = config_dict.ConfigDict()
    config.eval.lengths = (1024, 2048, 4096, 8192)  # evaluation lengths
    config.eval.num_sequences = 32  # fixed evaluation sequences per length
    # Seed of the evaluation sequences: the same for every run's seed and method (paired runs).
    config.eval.seed = 0
    config.eval.batch_size = 4  # sequences per evaluation batch (memory at the longest length)
    config.eval.every_steps = 0  # evaluate during training every N steps (0: only at the end)

    config.runtime = config_dict.ConfigDict()
    # JAX's persistent compilation cache: a local folder or gs://bucket/...; '' = off
    config.runtime.compilation_cache_dir = ""
    # jax.profiler trace of train steps [from, to) into <workdir>/tensorboard; to <= from: none
    config.runtime.profile_from_step = 0
    config.runtime.profile_to_step = 0
    return config
