"""What the benchmarks build on that the rest of the suite does not reach: random bytes, and
that every benchmark script still loads against the library and lists its flags."""

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers.tiny_config import tiny_text_config_dict

from benchmarks.random_bytes import RandomBytes
from jrope.data.source import TASKS
from jrope.train import setup
from jrope.train.config import TrainConfig
from jrope.train.setup import set_up_run
from jrope.train.trainer import make_train_step


def test_random_bytes_train_a_byte_level_step_like_text(tmp_path):
    cfg = TrainConfig.from_config_dict(tiny_text_config_dict(tmp_path, **{"mesh.data": 1}))
    source = RandomBytes(cfg)
    assert source.task in TASKS

    batch = source.train_batch(3)
    b, t = cfg.batch_size, cfg.data.seq_len
    assert batch["inputs"].shape == batch["targets"].shape == batch["weights"].shape == (b, t)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["inputs"].min() >= cfg.data.token_offset
    assert batch["inputs"].max() < cfg.data.vocab_size
    np.testing.assert_array_equal(source.train_batch(3)["inputs"], batch["inputs"])
    assert not np.array_equal(source.train_batch(4)["inputs"], batch["inputs"])

    # The benchmarks' set-up: the run's own layout and train step on these batches.
    run = set_up_run(cfg, devices=jax.devices()[:1], source=source)
    state, step = run.init_state(), make_train_step(run)
    losses = []
    with jax.set_mesh(run.mesh):
        for _ in range(2):  # the same batch twice: the second loss is lower
            state, metrics = step(state, setup.global_batch(batch, cfg.mesh.rules, run.mesh))
            losses.append(float(jax.device_get(metrics)["loss"]))
    assert np.isfinite(losses).all()
    assert losses[1] < losses[0]


BENCHMARKS = sorted(
    path.name
    for path in (pathlib.Path(__file__).parents[1] / "benchmarks").glob("*.py")
    if path.name != "random_bytes.py"
)


@pytest.mark.slow
@pytest.mark.parametrize("script", BENCHMARKS)
def test_every_benchmark_loads_and_lists_its_flags(script):
    repo = pathlib.Path(__file__).parents[1]
    result = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / script), "--helpfull"],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-2000:]
    assert f"benchmarks/{script}" in output or script in output
