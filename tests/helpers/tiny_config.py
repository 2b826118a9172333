"""Tiny training configs shared by the tests: the synthetic task, and byte-level text.

d_model 32, 2 heads of 16, L 16, batch 8 (2 layers for the synthetic task,
1 for text): small enough that the tests' cost is compilation, not
computation.
"""

from configs import synthetic, wikitext_cpu
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


def tiny_config(**overrides) -> TrainConfig:
    return TrainConfig.from_config_dict(tiny_config_dict(**overrides))


def tiny_text_config_dict(tmp_path, **overrides):
    """configs/wikitext_cpu.py shrunk, on a small UTF-8 file written into tmp_path (no download)."""
    text = tmp_path / "corpus.txt"
    text.write_text(
        "".join(f" = Section {i} = \n Le homard européen – 龍蝦 , line {i} .\n" for i in range(60)),
        encoding="utf-8",
    )
    config = wikitext_cpu.get_config()
    config.data.source = "text"
    config.data.path = str(text)
    config.data.eval_path = str(text)
    config.data.cache_dir = str(tmp_path / "cache")
    config.model.d_model = 32
    config.model.num_heads = 2
    config.model.num_layers = 1
    config.pe.train_context = 16
    config.num_steps = 2
    config.batch_size = 8
    config.mesh.data = -1  # the 8 fake devices: one window each
    config.checkpoint.every_steps = 2
    config.log.every_steps = 1
    config.log.tensorboard = False
    config.eval.lengths = (16, 32)
    config.eval.num_sequences = 8
    config.eval.batch_size = 8
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


def result_row(**changes) -> dict:
    """A row of a length's evaluation, as eval.csv holds it: rope, seed 0, step 8, length 8."""
    from jrope.train import evaluation

    row = {"method": "rope", "seed": 0, "step": 8, "length": 8, "distance": None}
    row |= {"num_sequences": 8, **dict.fromkeys(evaluation.METRIC_COLUMNS, 0.5)}
    return row | {"compute_dtype": "float32", "eval_seed": 0} | changes
