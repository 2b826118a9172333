"""XLA options of the train and evaluation steps: CPU steps without library fusions, blockwise kept."""

import jax
import jax.numpy as jnp
import pytest
from helpers.tiny_config import tiny_config

from jrope.train import sharding
from jrope.train.compile_options import step_compiler_options
from jrope.train.evaluation import EvalStep
from jrope.train.setup import set_up_run
from jrope.train.trainer import make_train_step

# How XLA:CPU names a YNNPACK library fusion in compiled HLO text.
_LIBRARY_FUSION = "__ynn_fusion"


def test_options_turn_library_fusions_off_on_cpu_only():
    assert step_compiler_options(blockwise=False, platform="cpu") == {
        "xla_cpu_experimental_ynn_fusion_type": ""
    }
    assert step_compiler_options(blockwise=True, platform="cpu") == {}
    assert step_compiler_options(blockwise=False, platform="gpu") == {}
    assert step_compiler_options(blockwise=False, platform="tpu") == {}


def test_default_cpu_compilation_has_library_fusions():
    """The pinned jaxlib fuses a dot and its reduction into a library call by default.

    If this fails, XLA no longer makes them and jrope.train.compile_options has nothing left to do.
    """

    def dot_then_max(x, w):
        return jnp.max(jnp.tanh(x @ w), axis=-1)

    x = jnp.ones((64, 64), jnp.float32)
    assert _LIBRARY_FUSION in jax.jit(dot_then_max).lower(x, x).compile().as_text()


@pytest.mark.slow
def test_cpu_train_step_compiles_without_library_fusions():
    cfg = tiny_config()
    run = set_up_run(cfg, devices=jax.devices()[:1])
    state = run.init_state()
    step = make_train_step(run)
    with jax.set_mesh(run.mesh):
        batch = sharding.global_batch(run.source.train_batch(0), cfg.mesh.rules, run.mesh)
        text = step.lower(state, batch).compile().as_text()
    assert _LIBRARY_FUSION not in text


def test_eval_step_picks_the_blockwise_compilation_by_length():
    cfg = tiny_config(**{"model.blockwise_min_length": 32, "model.block_size": 16})
    step = EvalStep(set_up_run(cfg, devices=jax.devices()[:1]))
    assert step.for_length(16) is step.for_length(31)
    assert step.for_length(32) is step.for_length(64)
    assert step.for_length(16) is not step.for_length(32)
