"""Jordan-friendly synthetic LM at the paper's full scale (experiments.md section 2).

Command (one method and seed per run; the paper's methods are nope, rope,
alibi, rope_alibi, damped_rope, direct_sum, jordan_rope, jordan_no_gamma,
jordan_raw_tau, jordan_exact_scaled; seeds 0, 1, 2):

    python train.py --config=configs/synthetic.py \
        --config.pe.name=jordan_rope --config.seed=0 --workdir=runs/synthetic/jordan_rope/0
    python eval.py --config=configs/synthetic.py \
        --config.pe.name=jordan_rope --config.seed=0 --workdir=runs/synthetic/jordan_rope/0

Hardware: one GPU or TPU host (any device count: the batch of 24 is split
over the `data` axis, so use 1, 2, 3, 4, 6, 8, 12 or 24 devices, or set
mesh.data). Evaluation reaches length 8192.

Expected result (the paper, not yet reproduced with this code at this
scale): accuracy at length 8192 of about 0.906 for jordan_rope, 0.781 for
rope and 0.500 for direct_sum.
"""

from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
    config = config_dict.ConfigDict()
    # Settings that two sections must share are FieldReferences: overriding one
    # (e.g. --config.pe.train_context=512) updates the other.
    train_length = config_dict.FieldReference(1024)
    d_model = config_dict.FieldReference(128)
    num_heads = config_dict.FieldReference(4)
    theta = config_dict.FieldReference(10000.0)
    seed = config_dict.FieldReference(0)

    config.experiment = "synthetic"  # selects the data source (jrope.config_types.DATA_SOURCES)
    config.seed = seed  # parameter initialisation and data seed
    config.num_steps = 1200  # optimizer steps
    config.batch_size = 24  # global batch (sequences per step)

    config.model = config_dict.ConfigDict()
    config.model.d_model = d_model  # residual width
    config.model.num_heads = num_heads  # attention heads; head_dim = d_model / num_heads = 32
    config.model.num_layers = 3  # Transformer blocks
    config.model.mlp_ratio = 2  # MLP hidden width = mlp_ratio * d_model
    config.model.compute_dtype = "float32"  # activations: float32 | bfloat16 (the paper: float32)
    config.model.attention_impl = "auto"  # auto | xla | einsum | blockwise
    config.model.blockwise_min_length = 4096  # 'auto' uses blockwise attention from this length on
    config.model.block_size = 512  # blockwise attention block length
    # none | full | dots_saveable: recompute blocks in the backward pass
    config.model.remat = "none"
    config.model.dropout_rate = 0.0  # residual dropout after attention and MLP (the paper: none)
    # last: the loss reads the last position only, so only it is computed
    config.model.readout = "last"

    config.pe = config_dict.ConfigDict()
    # any paper name (math.md section 4), e.g. rope, jordan_exact_scaled
    config.pe.name = "jordan_rope"
    config.pe.train_context = train_length  # L of the encodings: tau(t) = t/(1+|t|/L), gamma = c/L
    config.pe.theta = theta  # rotary base: omega_b = theta^(-2b/head_dim)
    config.pe.gamma_min = 1e-4  # damping floor: gamma = softplus(raw) + gamma_min
    config.pe.init_gamma = 1e-4  # initial damping
    config.pe.eta_max = 0.1  # shear bound: eta = eta_max * tanh(raw)
    config.pe.init_eta = 0.0  # initial shear

    config.task = config_dict.ConfigDict()  # jrope.data.synthetic.SyntheticTaskConfig
    config.task.seq_len = train_length  # training length L (bits then QUERY)
    config.task.seed = seed  # data seed (the same as the run's seed)
    config.task.kernel = "mixed_raw"  # K(d) = (d/L) cos(w d), the paper's kernel
    config.task.head_dim = d_model // num_heads  # the kernel's frequencies are the model's
    config.task.freq_index = 3  # w = theta^(-2*3/head_dim)
    config.task.second_freq_index = 5  # second carrier ('rhythm_envelope' only)
    config.task.theta = theta  # rotary base of the kernel's frequencies
    config.task.label_mode = "threshold"  # label = 1[S > 0] | 'stochastic'
    config.task.temperature = 1.0 / 3.0  # 'stochastic' labels: Bernoulli(sigmoid(S / temperature))
    config.task.jet_power = 2  # r of the 'high_jet' kernels
    config.task.jet_decay = 0.1  # c of 'scaled_high_jet'
    config.task.damping_gamma = 1e-4  # gamma of 'damped_mixed'
    config.task.damping_sin_weight = 0.75  # sine weight of 'damped_mixed'
    config.task.envelope_offset = 0.25  # 'rhythm_envelope' envelope e0 + e1 d/L
    config.task.envelope_slope = 0.85
    config.task.carrier_cos_weight = 0.65  # 'rhythm_envelope' carrier c1 cos(w d) + c2 sin(w2 d)
    config.task.carrier_sin_weight = 0.35

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
    config.eval.lengths = (1024, 2048, 4096, 8192)  # evaluation lengths (8x extrapolation)
    config.eval.num_sequences = 32  # fixed evaluation sequences per length
    config.eval.batch_size = 4  # sequences per evaluation batch (memory at length 8192)
    config.eval.every_steps = 0  # evaluate during training every N steps (0: only at the end)
    return config
