"""jrope: Jordan-RoPE and its baselines as exact, jit-tested JAX functions.

The library (this package's top level: encodings, attention, model) imports
nothing of the training harness (jrope.train) or the data (jrope.data).

    cfg = jrope.pe_config_from_name(name, train_context=L)
    enc = jrope.make_encoding(cfg, num_heads=N, head_dim=H)
    params = enc.init_params()
    q2, k2 = enc.transform_qk(params, q, k, q_positions, k_positions)
    q2 = enc.map_queries(params, q, q_positions)       # the two halves of transform_qk
    k2 = enc.map_keys(params, k, k_positions)
    bias = enc.logit_bias(params, q_positions, k_positions)
    logits = jrope.attention_logits(enc, params, q, k, q_positions, k_positions)
"""

from jrope import pe_math
from jrope.encodings import Encoding, alibi_slopes, attention_logits, make_encoding
from jrope.layers import PositionalEncoding, causal_self_attention, dot_product_attention
from jrope.pe_config import ACCEPTED_NAMES, PAPER_METHODS, PEConfig, pe_config_from_name

__all__ = [
    "ACCEPTED_NAMES",
    "Encoding",
    "PAPER_METHODS",
    "PEConfig",
    "PositionalEncoding",
    "alibi_slopes",
    "attention_logits",
    "causal_self_attention",
    "dot_product_attention",
    "make_encoding",
    "pe_config_from_name",
    "pe_math",
]
