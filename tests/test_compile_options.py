"""XLA options of the train and evaluation steps: CPU steps without library fusions, blockwise kept."""

import jax
import jax.numpy as jnp

from jrope import sharding
from jrope.compile_options import step_compiler_options
from jrope.config_types import MeshConfig
from jrope.evaluation import make_eval_step
from jrope.train_state import build_source, init_state, state_layout
from jrope.trainer import make_train_step
from tiny_train_config import tiny_config

# How XLA:CPU names a YNNPACK library fusion in compiled HLO text.
_LIBRARY_FUSION = "__ynn_fusion"


def test_options_turn_library_fusions_off_on_cpu_only():
    assert step_compiler_options(blockwise=False, platform="cpu") == {
        "xla_cpu_experimental_ynn_fusion_type": ""
    }
    assert step_compiler_options(blockwise=True, platform="cpu") == {}
    assert step_compiler_options(blockwise=False, platform="gpu") == {}


def test_default_cpu_compilation_has_library_fusions():
    """The pinned jaxlib fuses a dot and its reduction into a library call by default.

    If this fails, XLA no longer makes them and jrope.compile_options has nothing left to do.
    """

    def dot_then_max(x, w):
        return jnp.max(jnp.tanh(x @ w), axis=-1)

    x = jnp.ones((64, 64), jnp.float32)
    assert _LIBRARY_FUSION in jax.jit(dot_then_max).lower(x, x).compile().as_text()


def test_cpu_train_step_compiles_without_library_fusions():
    cfg = tiny_config()
    mesh = sharding.make_mesh(MeshConfig(1, 1, 1, ()), devices=jax.devices()[:1])
    source = build_source(cfg)
    layout = state_layout(cfg, source.vocab_size, mesh)
    state = init_state(cfg, source.vocab_size, layout, mesh)
    step = make_train_step(cfg, layout, source.num_classes, mesh)
    with jax.set_mesh(mesh):
        batch = sharding.global_batch(source.train_batch(0), cfg.mesh.rules, mesh)
        text = step.lower(state, batch).compile().as_text()
    assert _LIBRARY_FUSION not in text


def test_eval_step_picks_the_blockwise_compilation_by_length():
    cfg = tiny_config(**{"model.blockwise_min_length": 32, "model.block_size": 16})
    mesh = sharding.make_mesh(MeshConfig(1, 1, 1, ()), devices=jax.devices()[:1])
    source = build_source(cfg)
    layout = state_layout(cfg, source.vocab_size, mesh)
    step = make_eval_step(layout.graphdef, source.num_classes, cfg.model)
    assert step.for_length(16) is step.for_length(31)
    assert step.for_length(32) is step.for_length(64)
    assert step.for_length(16) is not step.for_length(32)
