"""How far stabilized Jordan-RoPE's damping moves in training: its gradient against the shear's.

`jordan_rope` learns gamma = gamma_min + softplus(gamma_raw) with gamma_min = init_gamma = 1e-4
(the paper's code), so training starts with softplus(gamma_raw) = 1e-8 and the gradient
reaching gamma_raw is dL/dgamma times sigmoid(gamma_raw), about 1e-8 of it. This trains the
quick start's run (configs/quickstart.py: the synthetic task, 250 steps) with its own train
step and, every --every steps, takes the gradient of that step's batch loss: the largest
|dL/dgamma_raw| and |dL/deta_raw| over layers and heads, their ratio, and the largest
gamma - gamma_min so far.

    python benchmarks/jordan_damping.py
    python benchmarks/jordan_damping.py --config.num_steps=50 --every=10
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from ml_collections import config_flags

from jrope import losses
from jrope.train import setup
from jrope.train.config import convert_config, load_config_file
from jrope.train.trainer import make_train_step

_CONFIG = config_flags.DEFINE_config_dict("config", load_config_file("configs/quickstart.py"))
_EVERY = flags.DEFINE_integer("every", 50, "Measure the gradient every this many steps.")


def _leaves(tree, name: str) -> np.ndarray:
    """Every layer's `name` parameter (or its gradient), stacked: [L, N, ...]."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return np.stack([np.asarray(leaf) for path, leaf in flat if name in jax.tree_util.keystr(path)])


def main(argv):
    del argv
    cfg, problems = convert_config(_CONFIG.value)
    if problems:
        raise app.UsageError("\n".join(problems))
    run = setup.set_up_run(cfg, devices=jax.devices()[:1])
    state, train_step = run.init_state(), make_train_step(run)

    @jax.jit
    def gradient(params, batch):
        positions = jnp.arange(batch["inputs"].shape[1], dtype=jnp.int32)

        def loss(params):
            model = setup.model_from_params(run.layout.graphdef, params)
            sums = losses.task_sums(
                model(batch["inputs"], positions), batch, run.source.task, run.source.num_classes
            )
            return sums["loss_sum"] / sums["weight_sum"]

        return jax.grad(loss)(params)

    gamma_min = cfg.pe.gamma_min
    print(f"{cfg.pe.name}: gamma_min = init_gamma = {gamma_min:g}, {cfg.num_steps} steps")
    print("| step | max abs dL/dgamma_raw | max abs dL/deta_raw | ratio | max gamma - gamma_min |")
    print("|---|---|---|---|---|")
    for step in range(cfg.num_steps + 1):
        batch = run.source.train_batch(step)
        if step % _EVERY.value == 0 or step == cfg.num_steps:
            grads = gradient(state["params"], batch)
            gamma_grad = np.abs(_leaves(grads, "gamma_raw")).max()
            eta_grad = np.abs(_leaves(grads, "eta_raw")).max()
            raw = _leaves(state["params"], "gamma_raw").astype(np.float64)
            moved = np.logaddexp(0.0, raw).max()  # softplus: gamma - gamma_min
            ratio = gamma_grad / eta_grad
            print(f"| {step} | {gamma_grad:.2e} | {eta_grad:.2e} | {ratio:.1e} | {moved:.2e} |")
        if step < cfg.num_steps:
            state, _ = train_step(state, batch)


if __name__ == "__main__":
    app.run(main)
