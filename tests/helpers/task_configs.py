"""Tiny configs of the signal regression and retrieval tasks, for the end-to-end tests.

d_model 32, 2 heads of 16, 2 layers, L 16, batch 8 (as tests/helpers/tiny_config.py):
the tests' cost is compilation, not computation.
"""

from configs import retrieval, signal_regression
from helpers.tiny_config import apply_overrides
from jrope.train.config import TrainConfig


def _shrink(config, **overrides):
    config.model.d_model = 32
    config.model.num_heads = 2
    config.model.num_layers = 2
    config.pe.train_context = 16
    config.num_steps = 2
    config.batch_size = 8
    config.mesh.data = -1  # the batch of 8 over the 8 test devices
    config.eval.lengths = (16, 32)
    config.eval.num_sequences = 4
    config.eval.batch_size = 4
    config.checkpoint.every_steps = 2
    config.log.every_steps = 1
    config.log.tensorboard = False
    return apply_overrides(config, overrides)


def tiny_signal_config(**overrides) -> TrainConfig:
    """configs/signal_regression.py shrunk; `overrides` maps dotted keys to values."""
    return TrainConfig.from_config_dict(_shrink(signal_regression.get_config(), **overrides))


def tiny_retrieval_config(**overrides) -> TrainConfig:
    """configs/retrieval.py shrunk (3 pairs of 6 keys and 5 values, distances 4, 12, 24)."""
    config = retrieval.get_config()
    config.data.num_pairs = 3
    config.data.num_keys = 6
    config.data.num_values = 5
    config.data.eval_distances = (4, 12, 24)
    return TrainConfig.from_config_dict(_shrink(config, **overrides))
