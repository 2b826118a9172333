"""AdamW with global-norm clipping and a configurable learning-rate schedule.

The paper trains with a constant learning rate and clipping at 1.0; warm-up
and cosine decay are available for longer runs. Weight decay applies to
every parameter, as in the reference (PyTorch AdamW over all parameters).
"""

from __future__ import annotations

import optax

from jrope.config_types import OptimConfig


def learning_rate_schedule(cfg: OptimConfig, num_steps: int) -> optax.Schedule:
    """Step -> learning rate: linear warm-up from 0, then constant or cosine decay."""
    if cfg.schedule == "constant":
        main = optax.constant_schedule(cfg.learning_rate)
    else:
        decay_steps = max(num_steps - cfg.warmup_steps, 1)
        main = optax.cosine_decay_schedule(cfg.learning_rate, decay_steps, alpha=cfg.final_lr_ratio)
    if cfg.warmup_steps == 0:
        return main
    warmup = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return optax.join_schedules([warmup, main], boundaries=[cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig, num_steps: int) -> optax.GradientTransformation:
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(cfg, num_steps),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
    if cfg.clip_norm == 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
