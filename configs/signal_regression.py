"""Signal regression: predict a causal convolution of white noise with a structured lag kernel.

The paper's signal benchmark (the reference's configs/signal_benchmarks.yaml):
inputs x_t ~ N(0, 1), one channel; targets y_i = sum_{j<i} K(i - j) x_j with
K one of seasonal_trend, damped_wave, rhythm_envelope, motif_spacing
(K(0) = 0, normalised by its norm over the training lags, so it keeps
growing beyond them; jrope/data/signal.py). A Transformer reads x through an
input projection and predicts y at every position with a linear regression
head (d_model 128, 4 heads, 3 layers, MLP 2x), trained at L = 512 with the
mean squared error (300 steps, batch 8, AdamW 5e-4, weight decay 0.01,
clipping 1.0), evaluated at 512 .. 8192 on 4 fixed sequences per length
(every position of every sequence is a target: 2048 to 32768 per length).
Reports MSE and R^2 per length.

Command (one method, kernel and seed per run; the reference's methods are
nope, rope, alibi, rope_alibi, damped_rope, direct_sum, jordan_rope,
jordan_raw_tau, and its kernels seasonal_trend and damped_wave):

    python train.py --config=configs/signal_regression.py --config.pe.name=jordan_rope \
        --config.data.kernel=seasonal_trend --workdir=runs/signal/seasonal_trend/jordan_rope/0
    python -m jrope.compare --config=configs/signal_regression.py --config.data.kernel=damped_wave \
        --methods=nope,rope,alibi,rope_alibi,damped_rope,direct_sum,jordan_rope,jordan_raw_tau \
        --seeds=0,1,2 --workdir=runs/signal/damped_wave

Hardware: a CPU runs it (a run with its evaluation took 1.0 to 1.6 minutes
on seasonal_trend and 1.8 to 3.8 on damped_wave: the kept runs' logs, a
2-core AMD EPYC development machine beside other work, 2026-12-04);
evaluation at 4096 and 8192 runs blockwise.

Expected result: the structured probe's ordering (docs/results.md,
section 4): the Jordan encodings, which carry the features
d e^{-gamma d} cos(w d), extrapolate a growing kernel better than RoPE and
ALiBi.

Measured (seasonal_trend, seed 0, 2026-12-04 at jrope 4283dc2, runs kept in
docs/runs/signal/seasonal_trend; r2 at 512 / 1024 / 2048; all methods in
docs/results.md, section 5):

    rope            0.820  0.635  0.241
    damped_rope     0.957  0.788  0.434
    jordan_rope     0.947  0.820  0.460
    jordan_raw_tau  0.922  0.816  0.670
"""

from ml_collections import config_dict

from configs import base


def get_config() -> config_dict.ConfigDict:
    config = base.get_config(train_context=512, d_model=128, num_heads=4, num_layers=3, mlp_ratio=2)
    config.num_steps = 300  # optimizer steps
    config.batch_size = 8  # global batch (sequences per step)
    config.pe.name = "jordan_rope"

    config.data = config_dict.ConfigDict()  # jrope.data.signal.SignalRegressionConfig
    config.data.source = "signal"  # the data source (jrope.data.source.SOURCES)
    config.data.seed = config.get_ref("seed")  # data seed (the same as the run's seed)
    # seasonal_trend | damped_wave | rhythm_envelope | motif_spacing
    config.data.kernel = "seasonal_trend"
    config.data.input_channels = 1  # noise channels (input projection and regression head width)
    # The kernel's frequencies are the model's rotary ones (head_dim and theta from the model and
    # pe sections, as the length seq_len = pe.train_context: set where the source is built).
    config.data.freq_index = 3  # w = theta^(-2*3/head_dim)
    config.data.second_freq_index = 5  # w2 (rhythm_envelope, motif_spacing)
    config.data.gamma = 1e-4  # damping of damped_wave

    config.opt.learning_rate = 5e-4  # constant learning rate
    config.opt.weight_decay = 0.01  # decoupled AdamW weight decay

    config.checkpoint.every_steps = 300  # only the final state
    config.eval.lengths = (512, 1024, 2048, 4096, 8192)  # 1x .. 16x L
    # The reference's count (4 batches of one), which it draws from the run's own generator;
    # here fixed by eval.seed, the same for every seed and method.
    config.eval.num_sequences = 4
    config.eval.batch_size = 1  # one sequence at a time at 8192
    return config
