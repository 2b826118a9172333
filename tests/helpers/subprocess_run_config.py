"""A tiny synthetic-task config file for tests that run train.py as a subprocess.

    python train.py --config=tests/helpers/subprocess_run_config.py --workdir=...

RoPE, d_model 16 (2 heads of 8), 1 layer, L 8, batch 8, 60 steps, a
checkpoint every 8 steps (3 kept), metrics every step: a run is mostly
start-up and compilation, and the step counter moves slowly enough for a
test to interrupt it part-way.
"""

from configs import synthetic


def get_config():
    config = synthetic.get_config()
    config.model.d_model = 16
    config.model.num_heads = 2
    config.model.num_layers = 1
    config.pe.name = "rope"
    config.pe.train_context = 8
    config.data.second_freq_index = 1  # below head_dim / 2 = 4
    config.num_steps = 60
    config.batch_size = 8
    config.mesh.data = -1
    config.eval.lengths = (8,)
    config.eval.num_sequences = 8
    config.eval.batch_size = 8
    config.checkpoint.every_steps = 8
    config.checkpoint.max_to_keep = 3
    config.log.every_steps = 1
    config.log.tensorboard = False
    return config
