"""A tiny synthetic-task training config shared by the trainer tests.

d_model 32, 2 heads of 16, 2 layers, L 16, batch 8: small enough that the
tests' cost is compilation, not computation.
"""

from configs import synthetic
from jrope.train.config import TrainConfig


def tiny_config_dict(**overrides):
    """configs/synthetic.py shrunk; `overrides` maps dotted keys ('model.num_heads') to values."""
    config = synthetic.get_config()
    config.model.d_model = 32
    config.model.num_heads = 2
    config.model.num_layers = 2
    config.pe.train_context = 16
    config.pe.name = "jordan_rope"
    config.data.second_freq_index = 1  # stays valid for 4 heads of 8
    config.num_steps = 2
    config.batch_size = 8
    config.mesh.data = 1
    config.eval.lengths = (16,)
    config.eval.num_sequences = 4
    config.eval.batch_size = 4
    config.checkpoint.every_steps = 2
    config.log.every_steps = 1
    config.log.tensorboard = False
    return apply_overrides(config, overrides)


def apply_overrides(config, overrides):
    """`config` with each dotted key of `overrides` ('model.num_heads') set to its value."""
    for dotted, value in overrides.items():
        section, _, key = dotted.rpartition(".")
        target = config
        for part in filter(None, section.split(".")):
            target = target[part]
        target[key] = value
    return config


def tiny_config(**overrides) -> TrainConfig:
    return TrainConfig.from_config_dict(tiny_config_dict(**overrides))
