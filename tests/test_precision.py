"""Dot precision in the lowered programs: full float32 where an encoding's logits cancel.

On CPU every float32 dot is exact whatever its precision attribute, so the
tests read the attribute itself in the lowered StableHLO: that is what TPU
and GPU compilers act on.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers.tiny_config import tiny_config

import jrope
from jrope.attention import blockwise_attention
from jrope.attention.dense import einsum_attention, xla_attention
from jrope.model import Transformer
from jrope.train.setup import run_encoding

_PRECISION = re.compile(r"stablehlo\.dot_general.*precision = \[(\w+), (\w+)\]")


def _dot_precisions(lowered_text: str) -> list[str]:
    """The precision of every dot_general in a lowered module (DEFAULT when none is given)."""
    precisions = []
    for line in lowered_text.splitlines():
        if "stablehlo.dot_general" in line:
            match = _PRECISION.search(line)
            precisions.append(match.group(1) if match else "DEFAULT")
    return precisions


def _encoding(name):
    cfg = jrope.pe_config_from_name(name, train_context=64)
    return jrope.make_encoding(cfg, num_heads=2, head_dim=8)


@pytest.mark.parametrize("name, expected", [("jordan_raw_tau", "HIGHEST"), ("rope", "DEFAULT")])
def test_attention_logits_asks_for_float32_where_the_logits_cancel(name, expected):
    enc = _encoding(name)
    q, positions = jnp.ones((1, 16, 2, 8)), jnp.arange(16)
    lowered = jax.jit(
        lambda p, q, k: jrope.attention_logits(enc, p, q, k, positions, positions)
    ).lower(enc.init_params(), q, q)
    assert _dot_precisions(lowered.as_text()) == [expected]


def test_attention_logits_takes_an_explicit_precision():
    enc = _encoding("rope")
    q, positions = jnp.ones((1, 16, 2, 8)), jnp.arange(16)
    lowered = jax.jit(
        lambda p, q, k: jrope.attention_logits(
            enc, p, q, k, positions, positions, precision=jax.lax.Precision.HIGH
        )
    ).lower(enc.init_params(), q, q)
    assert _dot_precisions(lowered.as_text()) == ["HIGH"]


def _gradient_dots(attend) -> list[str]:
    """Dot precisions of value and gradients of sum(attend(q, k, v)) for [1, 16, 2, 8] inputs."""
    x = jnp.ones((1, 16, 2, 8))
    grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), argnums=(0, 1, 2))
    return _dot_precisions(jax.jit(grad).lower(x, x, x).as_text())


@pytest.mark.parametrize("kernel", ["xla", "einsum", "blockwise"])
def test_every_dot_of_a_kernel_forward_and_backward_runs_at_its_precision(kernel):
    highest = jax.lax.Precision.HIGHEST
    enc = _encoding("jordan_raw_tau")
    positions = jnp.arange(16)
    attend = {
        "xla": lambda q, k, v: xla_attention(q, k, v, highest),
        "einsum": lambda q, k, v: einsum_attention(q, k, v, None, highest),
        "blockwise": lambda q, k, v: blockwise_attention(
            q,
            k,
            v,
            enc=enc,
            params=enc.init_params(),
            q_positions=positions,
            k_positions=positions,
            block_size=8,
            precision=highest,
        ),
    }[kernel]
    dots = _gradient_dots(attend)
    assert len(dots) >= 4  # q.k and p.v forward, and their transposes
    assert set(dots) == {"HIGHEST"}


def _model_dots(**overrides) -> list[str]:
    """Dot precisions of the tiny model's loss gradient (float32, the einsum kernel by default)."""
    cfg = tiny_config(**{"model.readout": "all", "model.attention_impl": "einsum", **overrides})
    model = Transformer(cfg.model, run_encoding(cfg), 3, rngs=nnx.Rngs(params=0))
    graphdef, params = nnx.split(model)
    tokens, positions = jnp.zeros((2, 16), jnp.int32), jnp.arange(16)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(tokens, positions))

    return _dot_precisions(jax.jit(jax.grad(loss)).lower(params).as_text())


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["einsum", "xla", "blockwise"])
def test_the_model_runs_attention_in_float32_for_a_raw_shear_and_the_rest_at_default(impl):
    raw_shear = {"pe.name": "jordan_raw_tau", "model.attention_impl": impl}
    auto = _model_dots(**raw_shear)
    default = _model_dots(**raw_shear, **{"model.attention_precision": "default"})
    # The same program but for the attention's dots: those are HIGHEST under 'auto';
    # the projections, the MLP and the output logits stay at the default.
    assert len(auto) == len(default)
    assert auto.count("HIGHEST") >= default.count("HIGHEST") + 4
    assert "DEFAULT" in auto
    rope = {"pe.name": "rope", "model.attention_impl": impl}
    assert _model_dots(**rope) == _model_dots(**rope, **{"model.attention_precision": "default"})


@pytest.mark.slow
def test_the_model_precisions_follow_the_config():
    everything = _model_dots(
        **{"model.matmul_precision": "highest", "model.attention_precision": "highest"}
    )
    assert set(everything) == {"HIGHEST"}
    attention_only = _model_dots(**{"pe.name": "rope", "model.attention_precision": "high"})
    assert 0 < attention_only.count("HIGH") < len(attention_only)
    assert set(attention_only) == {"HIGH", "DEFAULT"}
