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

# The package's version, in this one place (pyproject.toml reads it without importing jrope).
__version__ = "0.1.0"

# Every public name is loaded on first use: `import jrope` (and so the commands' --help and their
# command-line mistakes) does not load JAX, and `import jrope.attention` does not load the model
# package (jrope.layers builds on the model's config and axes).
_LAZY = {
    "pe_math": "jrope.pe_math",
    "Encoding": "jrope.encodings",
    "alibi_slopes": "jrope.encodings",
    "attention_logits": "jrope.encodings",
    "make_encoding": "jrope.encodings",
    "ACCEPTED_NAMES": "jrope.pe_config",
    "PAPER_METHODS": "jrope.pe_config",
    "PEConfig": "jrope.pe_config",
    "pe_config_from_name": "jrope.pe_config",
    "PositionalEncoding": "jrope.layers",
    "causal_self_attention": "jrope.layers",
    "dot_product_attention": "jrope.layers",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module  # here: the package's namespace holds its API alone

        module = import_module(_LAZY[name])
        return module if module.__name__ == f"jrope.{name}" else getattr(module, name)
    raise AttributeError(f"module 'jrope' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The loaded names and the lazy ones, so that dir() and help() list them all."""
    return sorted(set(globals()) | set(_LAZY))
