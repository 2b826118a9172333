"""jrope.flops (the count behind benchmarks/mfu.py) against independent counts."""

import math

import pytest
from flax import nnx
from helpers.tiny_config import tiny_config

from jrope.model import Transformer
from jrope.train.flops import model_flops_per_step

VOCAB = 5


def _config(readout):
    return tiny_config(
        **{
            "model.d_model": 12,
            "model.num_heads": 3,
            "model.num_layers": 2,
            "model.mlp_ratio": 3,
            "model.readout": readout,
            "pe.train_context": 6,
            "pe.name": "rope",
            "data.freq_index": 1,
            "data.second_freq_index": 1,
            "batch_size": 3,
        }
    )


def _by_hand(cfg, vocab):
    """Every matmul of the step, as (rows, fan_in, fan_out), and every visible (query, key) pair."""
    m = cfg.model
    b, t, d, f, h = (
        cfg.batch_size,
        cfg.pe.train_context,
        m.d_model,
        m.mlp_ratio * m.d_model,
        m.head_dim,
    )
    matmuls, pairs = [], 0
    for layer in range(m.num_layers):
        last_only = m.readout == "last" and layer == m.num_layers - 1
        query_rows = range(t - 1, t) if last_only else range(t)
        rows = b * len(query_rows)
        # k and v on every position, q on the query rows only.
        matmuls += [(b * t, d, d), (b * t, d, d), (rows, d, d)]
        matmuls += [(rows, d, d), (rows, d, f), (rows, f, d)]  # output projection, MLP up, MLP down
        for _ in range(b * m.num_heads):
            for query in query_rows:
                pairs += sum(1 for key in range(t) if key <= query)
    matmuls.append((rows, d, vocab))  # tied readout
    forward_dense = sum(2 * r * i * o for r, i, o in matmuls)
    # One score and one probability-weighted value per visible pair.
    forward_attention = pairs * (2 * h + 2 * h)
    return 3 * forward_dense, 3 * forward_attention


@pytest.mark.parametrize("readout", ["all", "last"])
def test_count_matches_a_matmul_by_matmul_count(readout):
    cfg = _config(readout)
    flops = model_flops_per_step(cfg, VOCAB)
    dense, attention = _by_hand(cfg, VOCAB)
    assert flops["dense"] == dense and flops["attention"] == attention
    assert flops["total"] == dense + attention


def test_dense_part_is_six_times_matmul_parameters_times_tokens():
    cfg = _config("all")
    model = nnx.eval_shape(
        lambda: Transformer(cfg.model, cfg.encoding, VOCAB, rngs=nnx.Rngs(params=0))
    )
    kernels = [model.embedding]  # the tied readout
    for block in model.blocks:
        kernels += [block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down]
    matmul_params = sum(math.prod(kernel.shape) for kernel in kernels)
    tokens = cfg.batch_size * cfg.pe.train_context
    assert model_flops_per_step(cfg, VOCAB)["dense"] == 6 * matmul_params * tokens


def test_vocabulary_defaults_to_the_data_source():
    cfg = _config("last")
    # The synthetic task's vocabulary is 3.
    assert model_flops_per_step(cfg) == model_flops_per_step(cfg, 3)


def test_a_signal_model_counts_its_input_projection_and_regression_head():
    # Readout 'all': every matmul's parameters are used once per position, as for tokens.
    cfg = _config("all")
    channels_in, channels_out = 3, 2
    model = nnx.eval_shape(
        lambda: Transformer(
            cfg.model,
            cfg.encoding,
            None,
            input_channels=channels_in,
            output_channels=channels_out,
            rngs=nnx.Rngs(params=0),
        )
    )
    kernels = [model.input_projection, model.regression_head]
    for block in model.blocks:
        kernels += [block.attn.qkv, block.attn.out, block.mlp.up, block.mlp.down]
    matmul_params = sum(math.prod(kernel.shape) for kernel in kernels)
    tokens = cfg.batch_size * cfg.pe.train_context
    flops = model_flops_per_step(cfg, input_channels=channels_in, output_channels=channels_out)
    assert flops["dense"] == 6 * matmul_params * tokens
