"""Cost of the checkpoint digests (jrope.train.checkpoints) against the train step they ride along with.

Every checkpoint save computes one digest pass over the whole train state
(parameters and both Adam moments) on its devices and brings two uint32 per
array to the host; every restore computes it once more. This times that pass
and the train step side by side in interleaved rounds, at the synthetic CPU
shape (configs/synthetic_cpu.py: d_model 128, 4 heads, 3 layers, L 256, batch
24) and the v1 WikiText shape (configs/wikitext_scaled_exact.py: d_model 384,
6 heads, 6 layers, L 1024, batch 4, on random bytes), one device.

    python benchmarks/checkpoint_digest.py
    python benchmarks/checkpoint_digest.py --shapes=synthetic --rounds=9

Prints per shape: the state's size, ms per train step, ms per digest pass
(medians over rounds), their ratio (the median of the per-round ratios, with
its quartiles), and the digest's share of the training time at the config's
checkpoint interval: digest / (checkpoint.every_steps x step).
"""

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from benchmarks.random_bytes import RandomBytes  # noqa: E402
from configs import synthetic_cpu, wikitext_scaled_exact  # noqa: E402
from jrope.train import runtime, setup  # noqa: E402
from jrope.train.checkpoints import state_digests  # noqa: E402
from jrope.train.config import TrainConfig  # noqa: E402
from jrope.train.setup import set_up_run  # noqa: E402
from jrope.train.trainer import make_train_step  # noqa: E402

_SHAPES = flags.DEFINE_list("shapes", ["synthetic", "wikitext"], "Shapes to time.")
_ROUNDS = flags.DEFINE_integer(
    "rounds", 7, "Interleaved timing rounds (2 or more: the table gives quartiles).", lower_bound=2
)
_STEPS = flags.DEFINE_integer("steps", 3, "Train steps (and digest passes) timed per round.")


def _config(shape: str) -> TrainConfig:
    if shape == "synthetic":
        config = synthetic_cpu.get_config()
    else:
        config = wikitext_scaled_exact.get_config()
        config.data.source = "text"  # replaced by random bytes below: no corpus needed
        config.data.path = config.data.eval_path = __file__
    config.mesh.data = 1
    return TrainConfig.from_config_dict(config)


def _prepare(shape: str):
    cfg = _config(shape)
    source = None if shape == "synthetic" else RandomBytes(cfg)
    run = set_up_run(cfg, devices=jax.devices()[:1], source=source)
    local = run.source.train_batch(0)
    state = run.init_state()
    step = make_train_step(run)
    with jax.set_mesh(run.mesh):
        batch = setup.global_batch(local, cfg.mesh.rules, run.mesh)
        for _ in range(2):  # compile and warm up both
            state, metrics = step(state, batch)
            state_digests(state)
        jax.block_until_ready(metrics)
    return {"cfg": cfg, "state": state, "step": step, "batch": batch, "mesh": run.mesh}


def _time_steps(prepared) -> float:
    state = prepared["state"]
    with jax.set_mesh(prepared["mesh"]):
        started = time.perf_counter()
        for _ in range(_STEPS.value):
            state, metrics = prepared["step"](state, prepared["batch"])
        jax.block_until_ready(metrics)
    prepared["state"] = state
    return (time.perf_counter() - started) / _STEPS.value


def _time_digests(prepared) -> float:
    started = time.perf_counter()
    for _ in range(_STEPS.value):
        state_digests(prepared["state"])  # returns host integers: the pass has finished
    return (time.perf_counter() - started) / _STEPS.value


def main(argv):
    del argv
    prepared = {shape: _prepare(shape) for shape in _SHAPES.value}
    times = {shape: {"step": [], "digest": []} for shape in prepared}
    # Round -1 is untimed: the first round's digest passes took up to a second where later ones
    # took 4 ms (synthetic shape; cause not found), which skewed the quartiles of short runs.
    for round_index in range(-1, _ROUNDS.value):
        for shape, run in prepared.items():
            step_s, digest_s = _time_steps(run), _time_digests(run)
            if round_index >= 0:
                times[shape]["step"].append(step_s)
                times[shape]["digest"].append(digest_s)
    print(f"devices: {jax.devices()[0].device_kind}; host allocator: {runtime.host_allocator()}")
    print(
        "| shape | state MiB | ms/step | ms/digest | digest / step (quartiles) "
        "| share at checkpoint.every_steps |"
    )
    print("|---|---|---|---|---|---|")
    for shape, run in prepared.items():
        state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(run["state"]))
        ratios = [d / s for d, s in zip(times[shape]["digest"], times[shape]["step"], strict=False)]
        q1, median, q3 = statistics.quantiles(ratios, n=4)
        step_ms = 1e3 * statistics.median(times[shape]["step"])
        digest_ms = 1e3 * statistics.median(times[shape]["digest"])
        every = run["cfg"].checkpoint.every_steps
        print(
            f"| {shape} | {state_bytes / 2**20:.1f} | {step_ms:.1f} | {digest_ms:.2f} "
            f"| {median:.4f} ({q1:.4f}-{q3:.4f}) | {100 * median / every:.4f} % of {every} steps |"
        )


if __name__ == "__main__":
    app.run(main)
