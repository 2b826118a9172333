"""jrope.layers: the encoding as a Flax NNX module in someone else's attention, and the helpers
that run it through jax.nn.dot_product_attention or jrope's kernels."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers.repository import ROOT
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jrope
from jrope.layers import PositionalEncoding, causal_self_attention, dot_product_attention
from jrope.model.axes import LOGICAL_AXES_KEY

README = (ROOT / "README.md").read_text()

B, T, N, H = 2, 16, 2, 16
RAW_SHEAR = "jordan_raw_tau"  # q, k stay float32 and the dots need HIGHEST
ALIBI = "jordan_exact_c150_eta010_alibi"  # a logit bias
NAMES = ("rope", "damped_rope", "jordan_exact_scaled", RAW_SHEAR, ALIBI)


def _layer(name: str) -> PositionalEncoding:
    cfg = jrope.pe_config_from_name(name, train_context=T)
    return PositionalEncoding(jrope.make_encoding(cfg, num_heads=N, head_dim=H))


def _qkv(dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return [jax.random.normal(key, (B, T, N, H)).astype(dtype) for key in keys]


def _reference(pe: PositionalEncoding, q, k, v, positions) -> np.ndarray:
    """Causal softmax over jrope.attention_logits (scale and bias included), float64 [B, T, N, H]."""
    logits = np.asarray(
        jrope.attention_logits(
            pe.encoding,
            pe.param_values(),
            q.astype(jnp.float32),
            k.astype(jnp.float32),
            positions,
            positions,
        ),
        np.float64,
    )
    logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, np.asarray(v, np.float64))


# The helpers under nnx.jit, for the tests that compare numbers: one compiled program per shape,
# where an eager call compiles one per operation (most of such a test's time on CPU).
jitted_dot_product_attention = nnx.jit(dot_product_attention, static_argnames=("is_causal",))
jitted_causal_self_attention = nnx.jit(
    causal_self_attention, static_argnames=("kernel", "block_size")
)


def _dots(lowered_text: str) -> list[str]:
    """The precision of every dot_general of a lowered module (DEFAULT when none is given)."""
    found = []
    for line in lowered_text.splitlines():
        if "stablehlo.dot_general" in line:
            match = re.search(r"precision = \[(\w+), (\w+)\]", line)
            found.append(match.group(1) if match else "DEFAULT")
    return found


def test_the_module_holds_the_encoding_parameters_as_params_with_their_logical_axes():
    pe = _layer(ALIBI)
    params = nnx.state(pe, nnx.Param)
    names = {path[-1] for path, _ in nnx.to_flat_state(params)}
    assert names == set(pe.encoding.init_params()) == {"gamma_raw", "eta_raw"}
    for name, param in pe.params.items():
        assert param.get_metadata()[LOGICAL_AXES_KEY] == pe.encoding.param_logical_axes[name]
        assert param[...].dtype == jnp.float32


def test_flax_partition_specs_and_logical_axis_rules_see_the_parameters_axes():
    pe = _layer(ALIBI)
    specs = nnx.get_partition_spec(nnx.state(pe))
    assert specs["params"]["gamma_raw"].get_value() == P("heads", None)
    assert specs["params"]["eta_raw"].get_value() == P("heads", None)
    with nnx.logical_axis_rules([("heads", "tensor")]):
        specs = nnx.get_partition_spec(nnx.state(pe))
    assert specs["params"]["gamma_raw"].get_value() == P("tensor", None)


def test_on_a_mesh_the_parameters_shard_over_the_heads_axis_by_the_rules():
    mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    rules = [("heads", "tensor")]
    # Created under the mesh: Flax shards each parameter as it is made.
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        pe = _layer(ALIBI)
    for param in pe.params.values():
        assert param[...].sharding.spec == P("tensor", None)
        assert len(param[...].sharding.device_set) == 8
    # Created without one: sharded afterwards from its partition specs, the Flax way.
    pe = _layer(ALIBI)
    with nnx.logical_axis_rules(rules):
        shardings = nnx.get_named_sharding(nnx.state(pe), mesh)
    sharded = jax.device_put(nnx.state(pe), shardings)
    nnx.update(pe, sharded)
    assert pe.params["gamma_raw"][...].sharding.spec == P("tensor", None)
    q, k, _ = _qkv()
    positions = jnp.arange(T)
    q2, k2 = nnx.jit(lambda pe, q, k: pe(q, k, positions, positions))(pe, q, k)
    expected = _layer(ALIBI)(q, k, positions, positions)
    np.testing.assert_allclose(q2, expected[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(k2, expected[1], rtol=1e-6, atol=1e-6)


def test_a_state_saved_from_another_encoding_is_refused_on_restore_naming_the_difference(
    tmp_path,
):
    import orbax.checkpoint as ocp

    saved = _layer("jordan_exact_scaled")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "pe", nnx.state(saved))
    q, k, _ = _qkv()
    positions = jnp.arange(T)

    def restored_into(name):
        pe = _layer(name)
        with ocp.StandardCheckpointer() as checkpointer:
            state = checkpointer.restore(tmp_path / "pe", nnx.state(pe))
        nnx.update(pe, state)
        return pe

    same = restored_into("jordan_exact_scaled")
    np.testing.assert_array_equal(
        same(q, k, positions, positions)[0], saved(q, k, positions, positions)[0]
    )
    other = restored_into("jordan_rope")
    with pytest.raises(
        ValueError,
        match="config.name is 'jordan_exact_scaled' in the state, 'jordan_rope' in this module",
    ):
        other(q, k, positions, positions)
    with pytest.raises(ValueError, match="shear_time is 'raw' in the state, 'bounded'"):
        other.check_record()


@pytest.mark.parametrize("name", NAMES)
def test_its_maps_are_the_encodings(name):
    pe = _layer(name)
    q, k, _ = _qkv()
    positions = jnp.arange(T)
    q2, k2 = pe(q, k, positions, positions)
    q_ref, k_ref = pe.encoding.transform_qk(pe.encoding.init_params(), q, k, positions, positions)
    np.testing.assert_array_equal(q2, q_ref)
    np.testing.assert_array_equal(k2, k_ref)
    logits = pe.logits(q, k, positions, positions)
    assert logits.shape == (B, N, T, T)


@pytest.mark.parametrize("name", NAMES)
def test_dot_product_attention_equals_the_reference_over_attention_logits(name):
    pe = _layer(name)
    q, k, v = _qkv()
    positions = jnp.arange(T) + 100
    out = jitted_dot_product_attention(pe, q, k, v, positions, positions, is_causal=True)
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, _reference(pe, q, k, v, positions), atol=2e-5)


def test_dot_product_attention_takes_positions_per_batch_row_and_a_mask():
    pe = _layer(ALIBI)
    q, k, v = _qkv()
    positions = jnp.stack([jnp.arange(T), jnp.arange(T) + 1000])  # [B, T]
    causal = jnp.tril(jnp.ones((T, T), bool))[None, None]  # [1, 1, T, S]
    out = dot_product_attention(pe, q, k, v, positions, positions, mask=causal)
    np.testing.assert_allclose(out, _reference(pe, q, k, v, positions), atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["auto", "blockwise"])  # auto: einsum on CPU
@pytest.mark.parametrize("name", NAMES)
def test_causal_self_attention_equals_the_reference_over_attention_logits(name, kernel):
    pe = _layer(name)
    q, k, v = _qkv()
    positions = jnp.arange(T)
    out = jitted_causal_self_attention(pe, q, k, v, positions, kernel=kernel, block_size=8)
    np.testing.assert_allclose(out, _reference(pe, q, k, v, positions), atol=2e-5)


@pytest.mark.parametrize("name", [ALIBI, pytest.param(RAW_SHEAR, marks=pytest.mark.slow)])
def test_causal_self_attention_of_packed_rows_equals_each_sequence_alone(name):
    pe = _layer(name)
    q, k, v = _qkv()
    first = T // 2 - 1  # two sequences per row, of first and T - first positions
    positions = jnp.concatenate([jnp.arange(first), jnp.arange(T - first)])
    segment_ids = jnp.broadcast_to((jnp.arange(T) >= first).astype(jnp.int32), (B, T))
    out = jitted_causal_self_attention(pe, q, k, v, positions, segment_ids=segment_ids)
    for part in (slice(0, first), slice(first, T)):
        alone = jitted_causal_self_attention(
            pe, q[:, part], k[:, part], v[:, part], positions[part]
        )
        np.testing.assert_allclose(out[:, part], alone, atol=2e-5)


def test_the_xla_kernel_takes_the_encodings_without_a_bias():
    pe = _layer(RAW_SHEAR)
    q, k, v = _qkv()
    positions = jnp.arange(T)
    out = causal_self_attention(pe, q, k, v, positions, kernel="xla")
    np.testing.assert_allclose(out, _reference(pe, q, k, v, positions), atol=2e-5)


@pytest.mark.parametrize("helper", ["dot_product_attention", "causal_self_attention"])
def test_gradients_reach_every_param_of_the_module(helper):
    pe = _layer(ALIBI)
    q, k, v = _qkv()
    positions = jnp.arange(T)

    def loss(pe):
        if helper == "dot_product_attention":
            out = dot_product_attention(pe, q, k, v, positions, positions, is_causal=True)
        else:
            out = causal_self_attention(pe, q, k, v, positions)
        return jnp.sum(out * v)

    grads = nnx.jit(nnx.grad(loss))(pe)
    for name in ("gamma_raw", "eta_raw"):
        gradient = np.asarray(grads["params"][name][...])
        assert gradient.shape == pe.params[name][...].shape
        assert np.all(np.isfinite(gradient)) and np.any(gradient != 0), name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rope", RAW_SHEAR, ALIBI])
def test_bfloat16_inputs_give_bfloat16_outputs_close_to_the_float32_reference(name):
    pe = _layer(name)
    q, k, v = _qkv(jnp.bfloat16)
    positions = jnp.arange(T)
    reference = _reference(pe, q, k, v, positions)
    for out in (
        jitted_dot_product_attention(pe, q, k, v, positions, positions, is_causal=True),
        jitted_causal_self_attention(pe, q, k, v, positions),
    ):
        assert out.dtype == jnp.bfloat16
        np.testing.assert_allclose(np.asarray(out, np.float32), reference, atol=3e-2)


def test_the_trap_the_helper_avoids_jax_refuses_float32_q_k_with_a_bfloat16_v():
    pe = _layer(RAW_SHEAR)
    q, k, v = _qkv(jnp.bfloat16)
    positions = jnp.arange(T)
    q2, k2 = pe(q, k, positions, positions)
    assert q2.dtype == k2.dtype == jnp.float32 and pe.encoding.keeps_float32
    with pytest.raises(ValueError, match="dtype"):
        jax.nn.dot_product_attention(q2, k2, v, is_causal=True)


# The raw shear runs the shear kernel (its shear as an exact per-pair weight): no HIGHEST.
@pytest.mark.parametrize(("name", "expected"), [(RAW_SHEAR, "DEFAULT"), ("rope", "DEFAULT")])
def test_the_attention_dots_run_at_the_encodings_precision_forward_and_backward(name, expected):
    pe = _layer(name)
    q, k, v = _qkv()
    positions = jnp.arange(T)
    graphdef, params, record = nnx.split(pe, nnx.Param, ...)  # the record is no parameter

    def loss(params, q, k, v):
        layer = nnx.merge(graphdef, params, record)
        return jnp.sum(dot_product_attention(layer, q, k, v, positions, positions, is_causal=True))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(params, q, k, v).as_text()
    # The attention's dots: those over the [.., T, T] logits or probabilities.
    attention = "\n".join(line for line in text.splitlines() if f"{T}x{T}x" in line)
    dots = _dots(attention)
    assert len(dots) >= 3  # q.k and p.v forward, and gradient dots over the logits
    assert set(dots) == {expected}


def test_refusals_name_the_reason():
    q, k, v = _qkv(jnp.bfloat16)
    positions = jnp.arange(T)
    with pytest.raises(ValueError, match="xla kernel does not compute .*logit bias"):
        causal_self_attention(_layer(ALIBI), q, k, v, positions, kernel="xla")
    with pytest.raises(ValueError, match="TPU only"):
        causal_self_attention(_layer("rope"), q, k, v, positions, kernel="splash", backend="cpu")
    with pytest.raises(ValueError, match="splash kernel does not compute .*float32 dots"):
        causal_self_attention(_layer(RAW_SHEAR), q, k, v, positions, kernel="splash", backend="tpu")
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'; choose one of"):
        causal_self_attention(_layer("rope"), q, k, v, positions, kernel="flash")


@pytest.mark.slow
def test_the_module_drops_into_a_flax_attention_layer_under_jit():
    """A [B, T, N, H] attention of one's own: projections, the module between them and the kernel."""

    class Attention(nnx.Module):
        def __init__(self, d_model: int, encoding, *, rngs: nnx.Rngs):
            self.qkv = nnx.Linear(d_model, 3 * N * H, use_bias=False, rngs=rngs)
            self.out = nnx.Linear(N * H, d_model, use_bias=False, rngs=rngs)
            self.pe = PositionalEncoding(encoding)

        def __call__(self, x, positions):
            q, k, v = jnp.split(self.qkv(x).reshape(x.shape[:2] + (3 * N, H)), 3, axis=2)
            y = dot_product_attention(self.pe, q, k, v, positions, positions, is_causal=True)
            return self.out(y.reshape(x.shape[:2] + (N * H,)))

    encoding = _layer(RAW_SHEAR).encoding
    model = Attention(32, encoding, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (B, T, 32))

    @nnx.jit
    def step(model, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x, jnp.arange(T)) ** 2))(model)
        return loss, grads

    loss, grads = step(model, x)
    assert np.isfinite(loss)
    assert np.any(np.asarray(grads["pe"]["params"]["eta_raw"][...]) != 0)


@pytest.mark.slow  # about 10 s on the 2-core development machine
def test_the_readmes_own_model_example_runs_as_written():
    opening = "from flax import nnx\n"
    example = re.search(rf"```python\n({re.escape(opening)}.*?)```", README, re.DOTALL)
    assert example, "README.md has no example opening with 'from flax import nnx'"
    namespace = {}
    exec(example.group(1), namespace)  # noqa: S102  (the README's own example)
    y, x, grads = namespace["y"], namespace["x"], namespace["grads"]
    assert y.shape == x.shape == (2, 128, 64) and y.dtype == jnp.bfloat16  # as its comments say
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    pe = namespace["layer"].pe
    assert pe.encoding.keeps_float32 and pe.encoding.dot_precision == jax.lax.Precision.HIGHEST
    for name in ("gamma_raw", "eta_raw"):
        assert np.any(np.asarray(grads["pe"]["params"][name][...]) != 0), name
