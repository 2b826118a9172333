"""Logical axis names of the model's parameters and activations.

Parameters carry these names as `nnx.Param` metadata (`LOGICAL_AXES_KEY`);
a run's config maps each name to mesh axes (jrope.train.sharding), so the
model never names a device layout itself.
"""

BATCH = "batch"
LENGTH = "length"
EMBED = "embed"
HEADS = "heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
LOGICAL_AXES = (BATCH, LENGTH, EMBED, HEADS, HEAD_DIM, MLP, VOCAB)

# Metadata key on nnx.Param holding its tuple of logical axis names.
LOGICAL_AXES_KEY = "logical_axes"
