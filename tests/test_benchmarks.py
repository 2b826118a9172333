"""What the benchmarks build on that the rest of the suite does not reach: random bytes, and
the project names every benchmark script imports."""

import ast
import importlib
import importlib.util
import pathlib

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


@pytest.mark.slow
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


BENCHMARK_FILES = sorted((pathlib.Path(__file__).parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARK_FILES, ids=lambda path: path.name)
def test_every_name_a_benchmark_imports_from_the_project_exists(path):
    """A benchmark runs outside the suite: an import the project no longer has would go unseen."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jrope":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(
                    f"{node.module}.{alias.name}"
                ), f"{path.name}: from {node.module} import {alias.name}"
