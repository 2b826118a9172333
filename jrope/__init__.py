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
from jrope.pe_config import ACCEPTED_NAMES, PAPER_METHODS, PEConfig, pe_config_from_name

# The package's version, in this one place (pyproject.toml reads it without importing jrope).
__version__ = "0.1.0"

__all__ = [
    "__version__",
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

# jrope.layers builds on the model's config and axes: loaded on first use, so that
# `import jrope` (and so `import jrope.attention`) does not load the model package.
_LAYERS = ("PositionalEncoding", "causal_self_attention", "dot_product_attention")


def __getattr__(name: str):
    if name in _LAYERS:
        from jrope import layers

        return getattr(layers, name)
    raise AttributeError(f"module 'jrope' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The loaded names and the lazy ones, so that dir() and help() list them all."""
    return sorted(set(globals()) | set(_LAYERS))
