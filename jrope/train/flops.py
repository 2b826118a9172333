"""Model FLOPs of a train step, counted analytically from the config (for MFU).

benchmarks/mfu.py divides this count by the measured step time and a
measured matmul peak.
"""

from __future__ import annotations

from jrope.data.source import source_spec
from jrope.train.config import TrainConfig


def model_flops_per_step(
    cfg: TrainConfig,
    vocab_size: int | None = None,
    *,
    input_channels: int | None = None,
    output_channels: int | None = None,
) -> dict[str, float]:
    """Model FLOPs of one train step (forward + backward) of `cfg`'s Transformer.

    A multiply-add is 2 FLOPs; the backward pass is counted as twice the
    forward (an input and a weight gradient per matmul), so a step is 3x the
    forward. Only matmuls count: norms, GELU, softmax, the encoding's
    rotations, the loss and the optimizer are left out (standard MFU
    accounting), and rematerialised forward passes are not counted again.

    Shapes: B = cfg.batch_size, T = cfg.pe.train_context (the training
    window), D = d_model, N heads of H = D / N, F = mlp_ratio * D, V = the
    vocabulary. A block whose Q queries are the last Q of S key positions
    does, forward:

      dense      2 B D^2 (Q + 2 S)     q projection on Q rows, k and v on S rows
                 2 B Q D^2             output projection
                 4 B Q D F             MLP up and down
      attention  4 B D P               q.k scores and probabilities.v over the
                                       P = Q S - Q (Q - 1) / 2 causally visible
                                       (query, key) pairs, each 2 H FLOPs per head

    Every block has Q = S = T (P = T (T + 1) / 2, the causal half of T x T)
    except the last one with readout 'last' (jrope.model.transformer), which has Q = 1
    (its one query sees all S = T keys: P = T). The tied readout is
    2 B Q D V forward with Q the last block's Q; the input embedding is a
    gather (0 FLOPs; its gradient is a scatter-add, also not counted). A
    signal model (the regression task: input_channels C_in and
    output_channels C_out instead of a vocabulary) has an input projection,
    2 B T C_in D, and a regression head, 2 B Q D C_out, in their place.

    With Q = S = T in every block (readout 'all') the dense part is the usual
    6 x (matmul parameters) x tokens: 6 B T (layers (4 D^2 + 2 D F) + D V).

    Args:
      cfg: the train config (its model, pe.train_context and batch_size).
      vocab_size: V; default: the data config's vocab_size, else the data
        source class's (the synthetic task's 3).
      input_channels, output_channels: a signal model's (jrope.train.state.model_io);
        given, they replace the vocabulary.
    Returns:
      {'dense': ..., 'attention': ..., 'total': ...} in FLOPs per step.
    """
    signal = input_channels is not None
    if vocab_size is None and not signal:
        vocab_size = getattr(cfg.data, "vocab_size", None)
        if vocab_size is None:
            vocab_size = source_spec(cfg.data.source).load()[1].vocab_size
    m = cfg.model
    b, t, d, v = cfg.batch_size, cfg.pe.train_context, m.d_model, vocab_size
    f = m.mlp_ratio * d
    last_queries = 1 if m.readout == "last" else t
    dense = attention = 0
    for index in range(m.num_layers):
        q = last_queries if index == m.num_layers - 1 else t
        pairs = q * t - q * (q - 1) // 2
        dense += 2 * b * d * d * (q + 2 * t) + 2 * b * q * d * d + 4 * b * q * d * f
        attention += 4 * b * d * pairs
    if signal:
        dense += 2 * b * t * input_channels * d + 2 * b * last_queries * d * output_channels
    else:
        dense += 2 * b * last_queries * d * v  # tied readout on the last block's rows
    return {"dense": 3.0 * dense, "attention": 3.0 * attention, "total": 3.0 * (dense + attention)}
