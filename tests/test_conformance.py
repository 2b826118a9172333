"""Every family of encodings on every attention kernel: the float64 oracle's values and gradients,
or a refusal that names the feature.

The families are jrope.pe_config.FAMILY_EXAMPLES and the kernels jrope.attention.KERNELS, so a
new name or kernel is covered with no edit here. Each case runs the kernel's forward and
backward (jrope.attention.causal_attention) at position offsets 0 and 2^30 against
jrope.oracle, which evaluates the encoding's own hooks: a non-finite result from finite inputs
fails, and the message names the side that is wrong (the encoding's hooks, or the kernel). By default every (family, kernel) pair runs at a short length, in rows of one
sequence; --all-cases adds a longer length (several blocks) and packed rows. The quick loop
runs every family on the kernel the CPU takes for it and every kernel on one family.
"""

import dataclasses
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jrope
from jrope import attention, oracle
from jrope.attention import KERNELS, PACKING_KERNELS
from jrope.attention.selection import KERNEL_FEATURES
from jrope.attention.settings import AttentionSettings
from jrope.encodings import LOGITS
from jrope.pe_config import FAMILY_EXAMPLES, PEConfig
from tests.helpers.matrix import cases
from tests.helpers.repository import ROOT as REPOSITORY

LARGE_OFFSET = 2**30
HEADS, HEAD_DIM = 2, 48  # 48: divisible by 2, 4, 6 and 8, every layout and order up to 4
TRAIN_CONTEXT = 32
# The base settings of every family example: theta away from its default, so that a kernel that
# assumed the default frequencies would show.
BASE_SETTINGS = dict(train_context=TRAIN_CONTEXT, theta=1000.0)
BLOCK = 32  # the blockwise and shear_flash kernels' blocks: the long length spans several
# Lengths per kernel: splash takes multiples of 128.
LENGTHS = {"short": 40, "long": 160}
SPLASH_LENGTHS = {"short": 128, "long": 256}
# Where a kernel runs natively (elsewhere: interpret mode, or not at all).
NATIVE = {"cudnn": ("gpu",), "splash": ("tpu", "cpu")}
# Largest relative errors against float64: float32 dots at full precision, or a fused kernel's
# (cuDNN's bfloat16; splash on TPU at its own precision).
TOLERANCE = {"float32": (1e-4, 1e-3), "fused": (5e-2, 1e-1)}


def _settings(name, kernel):
    return AttentionSettings(
        attention_impl=kernel,
        blockwise_min_length=4096,
        block_size=BLOCK,
        max_damping=0.02,
        compute_dtype="bfloat16" if kernel == "cudnn" else "float32",
        head_dim=HEAD_DIM,
        attention_precision="auto",
    )


def _encoding(name):
    return _with_params(
        jrope.make_encoding(jrope.pe_config_from_name(name, **BASE_SETTINGS), HEADS, HEAD_DIM)
    )


def _with_params(enc):
    # Learned-looking parameters: spread around their initial values, shears near their bound.
    params = {}
    for index, (key, value) in enumerate(enc.init_params().items()):
        noise = 0.3 * jax.random.normal(jax.random.PRNGKey(index), value.shape)
        params[key] = value + noise + (2.0 if key in ("eta_raw", "jet_gates_raw") else 0.0)
    return enc, params


def _problem(length, packed, dtype):
    """q, k, v, the loss weights w [B, S, N, H], positions [B, S] from 0, segment ids or None."""
    batch = 2 if packed else 1
    keys = jax.random.split(jax.random.PRNGKey(length), 4)
    shape = (batch, length, HEADS, HEAD_DIM)
    q, k, v = (jax.random.normal(key, shape).astype(dtype) for key in keys[:3])
    w = jax.random.normal(keys[3], shape)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    if not packed:
        return q, k, v, w, positions, None
    # Row 0: two sequences (the second from a third of the row on); row 1: one.
    cut = length // 3
    segment_ids = jnp.stack([(jnp.arange(length) >= cut).astype(jnp.int32), jnp.zeros(length)])
    segment_ids = segment_ids.astype(jnp.int32)
    positions = positions.at[0, cut:].add(-cut)
    return q, k, v, w, positions, segment_ids


def _kernel_loss(enc, kernel):
    def loss(q, k, v, params, w, positions, segment_ids):
        out = attention.causal_attention(
            q,
            k,
            v,
            enc=enc,
            params=params,
            positions=positions,
            kernel=kernel,
            block_size=BLOCK,
            precision=None if kernel in ("cudnn", "splash") else jax.lax.Precision.HIGHEST,
            segment_ids=segment_ids,
        )
        return jnp.sum(out.astype(jnp.float32) * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def _relative_error(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def _refusal(name, kernel, packed):
    """Why `kernel` does not run `name` (None: it does), as choose_kernel and causal_attention say."""
    enc, _ = _encoding(name)
    refusal = attention.feature_refusal(kernel, enc)
    if refusal is None and packed and kernel not in PACKING_KERNELS:
        refusal = "does not take segment ids"
    return refusal


def _compare(what, got, want, tolerance, kernel, name, offset):
    """Fails naming the wrong side: the oracle (the encoding's own hooks) or the kernel."""
    where = f"{name}'s {what} at position offset {offset}"
    assert np.isfinite(want).all(), (
        f"the float64 oracle's {where} is not finite from finite inputs: the encoding's hooks "
        "overflow there (a position-dependent factor must be measured from the map origin, "
        "docs/extending.md)"
    )
    assert np.isfinite(got).all(), f"the {kernel} kernel's {where} is not finite; the oracle's is"
    error = _relative_error(got, want)
    assert error < tolerance, (
        f"the {kernel} kernel's {where} is {error:.3g} from the float64 oracle's (tolerance "
        f"{tolerance:g}). The oracle evaluates the encoding's own hooks, so the kernel computes "
        "another function: it declares a feature in KERNEL_FEATURES that it does not compute, "
        "or loses precision."
    )


def check_conformance(name, kernel, size="short", packed=False, encoding=None):
    enc, params = encoding or _encoding(name)
    backend = jax.default_backend()
    if backend not in NATIVE.get(kernel, (backend,)):
        pytest.skip(f"the {kernel} kernel runs on {' and '.join(NATIVE[kernel])} only")
    length = (SPLASH_LENGTHS if kernel == "splash" else LENGTHS)[size]
    dtype = jnp.bfloat16 if kernel == "cudnn" else jnp.float32
    q, k, v, w, positions, segment_ids = _problem(length, packed, dtype)
    value_tolerance, gradient_tolerance = TOLERANCE[
        "fused" if kernel == "cudnn" or (kernel == "splash" and backend == "tpu") else "float32"
    ]
    attend = _kernel_loss(enc, kernel)
    for offset in (0, LARGE_OFFSET):
        shifted = positions + jnp.int32(offset)
        want_out, want_grads = oracle.attention_and_gradients(
            enc, params, q, k, v, w, shifted, segment_ids
        )
        if offset == 0:
            origin_out = want_out
        elif enc.cfg.is_translation_invariant:
            assert np.isfinite(want_out).all() and _relative_error(want_out, origin_out) < 1e-9, (
                f"the float64 oracle's {name} differs between position offsets 0 and {offset}, "
                "though its config is translation invariant: the encoding's hooks read the "
                "absolute position (a position-dependent factor must be measured from the map "
                "origin, docs/extending.md)"
            )
        (_, out), grads = attend(q, k, v, params, w, shifted, segment_ids)
        got_grads = oracle.named_gradients(grads)
        case = (kernel, name, offset)
        _compare("output", oracle.as_float64(out), want_out, value_tolerance, *case)
        if offset and not enc.cfg.is_translation_invariant:
            # Far out the bounded time is flat: its parameters' true gradient is about zero and
            # float32 returns the rounding of cancelling terms. Training positions start at 0.
            want_grads = {n: want_grads[n] for n in ("dq", "dk", "dv")}
        for tensor, want in want_grads.items():
            _compare(tensor, got_grads[tensor], want, gradient_tolerance, *case)


def _cpu_kernel(name):
    enc, _ = _encoding(name)
    return attention.choose_kernel(_settings(name, "auto"), enc, length=40, backend="cpu")


PAIRS = [(name, kernel) for name in FAMILY_EXAMPLES for kernel in KERNELS]
# The quick loop: every family on the kernel the CPU picks for it, every kernel on one family.
QUICK = {(name, _cpu_kernel(name)) for name in FAMILY_EXAMPLES} | {
    ("jordan_rope", kernel) for kernel in ("xla", "blockwise", "shear", "shear_flash", "splash")
}
QUICK |= {("rope_alibi", "cudnn")}


@pytest.mark.parametrize("name, kernel", cases(PAIRS, representative=PAIRS, quick=QUICK))
def test_a_family_on_a_kernel_equals_the_oracle_or_is_refused(name, kernel):
    refusal = _refusal(name, kernel, packed=False)
    if refusal is None:
        check_conformance(name, kernel)
        return
    enc, params = _encoding(name)
    q, k, v, _, positions, _ = _problem(LENGTHS["short"], False, jnp.float32)
    feature = refusal.split("'s ")[1].split(";")[0]
    with pytest.raises(ValueError, match=f"does not compute {name}'s {feature}"):
        attention.causal_attention(
            q, k, v, enc=enc, params=params, positions=positions[0], kernel=kernel
        )
    with pytest.raises(ValueError, match=f"attention_impl='{kernel}' does not apply: .*{feature}"):
        attention.choose_kernel(_settings(name, kernel), enc, length=LENGTHS["short"])


@pytest.mark.parametrize(
    "name, kernel, size, packed",
    cases(
        [(n, k, size, packed) for n, k in PAIRS for size in LENGTHS for packed in (False, True)],
        representative=[],
    ),
)
def test_a_family_on_a_kernel_at_every_length_packed_and_not(name, kernel, size, packed):
    refusal = _refusal(name, kernel, packed)
    if refusal is not None:
        pytest.skip(refusal)  # test_a_family_on_a_kernel_equals_the_oracle_or_is_refused checks it
    check_conformance(name, kernel, size, packed)


def test_every_setting_is_set_by_a_family_example():
    configs = [jrope.pe_config_from_name(name, **BASE_SETTINGS) for name in FAMILY_EXAMPLES]
    untested = [
        field.name
        for field in dataclasses.fields(PEConfig)
        if field.default is not dataclasses.MISSING
        and all(getattr(cfg, field.name) == field.default for cfg in configs)
    ]
    assert not untested, (
        f"no name of FAMILY_EXAMPLES sets the PEConfig field(s) {untested} away from the "
        "default, so no kernel is tested on them: add a name that does (jrope/pe_config.py)"
    )


def test_a_new_setting_is_refused_by_every_kernel_by_its_name():
    # A researcher's new field, read by some hook but in no kernel's features.
    new_field = [("xpos_scale_base", float, dataclasses.field(default=0.0))]
    Extended = dataclasses.make_dataclass("Extended", new_field, bases=(PEConfig,), frozen=True)
    base = dataclasses.asdict(jrope.pe_config_from_name("rope", **BASE_SETTINGS))
    unchanged = jrope.make_encoding(Extended(**base), HEADS, HEAD_DIM)
    assert unchanged.features == _encoding("rope")[0].features
    enc = jrope.make_encoding(Extended(**base, xpos_scale_base=512.0), HEADS, HEAD_DIM)
    q = jnp.ones((1, 8, HEADS, HEAD_DIM))
    for kernel in KERNELS:
        with pytest.raises(ValueError, match="does not compute rope's xpos_scale_base"):
            attention.causal_attention(
                q, q, q, enc=enc, params={}, positions=jnp.arange(8), kernel=kernel
            )
    with pytest.raises(ValueError, match="'auto' found no kernel.*xpos_scale_base"):
        attention.choose_kernel(_settings("rope", "auto"), enc, length=8)


def test_a_logits_hook_that_is_not_the_identity_runs_where_declared_and_is_refused_elsewhere():
    # A transform of the logits written into the hook with no field and no declaration.
    enc, params = _encoding("rope")
    assert LOGITS not in enc.features
    halved = type("Halved", (type(enc),), {"transform_logits": lambda self, p, x: x / 2})
    halved = halved(enc.cfg, enc.num_heads, enc.head_dim, enc.segments, enc.max_length)
    assert LOGITS in halved.features
    for kernel in KERNELS:
        if LOGITS in KERNEL_FEATURES[kernel]:
            check_conformance("rope", kernel, encoding=(halved, params))
        else:
            with pytest.raises(ValueError, match="does not compute rope's logits transform"):
                attention.causal_attention(
                    *(jnp.ones((1, 8, HEADS, HEAD_DIM)),) * 3,
                    enc=halved,
                    params=params,
                    positions=jnp.arange(8),
                    kernel=kernel,
                )


def _documented(marker: str) -> list[str]:
    text = (REPOSITORY / "docs/extending.md").read_text()
    return text.split(f"<!-- {marker} -->", 1)[1].strip().split("\n\n", 1)[0].splitlines()


def test_the_documented_kernel_features_are_the_declared_ones():
    rows = [row.strip("|").split("|") for row in _documented("kernel features")]
    header = [cell.strip() for cell in rows[0]]
    assert header == ["feature", *KERNELS]
    documented = {
        kernel: {row[0].strip() for row in rows[2:] if row[index + 1].strip() == "yes"}
        for index, kernel in enumerate(KERNELS)
    }
    assert documented == {kernel: set(features) for kernel, features in KERNEL_FEATURES.items()}


def _worked_examples() -> list[str]:
    return (REPOSITORY / "docs/extending.md").read_text().split("```diff\n")[1:]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_worked_examples())))
def test_a_worked_example_applied_to_the_library_passes_this_test(index, tmp_path):
    """docs/extending.md's patches, each applied to a copy of the library as written: the new family
    runs on every kernel against the oracle or is refused by name, and sets its new field."""
    patch = _worked_examples()[index].split("```", 1)[0]
    for part in ("jrope", "tests", "docs"):
        shutil.copytree(
            REPOSITORY / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(REPOSITORY / "pyproject.toml", tmp_path)
    subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=tmp_path, check=True)
    name = re.search(r'^\+    "(\w+)",$', patch, re.MULTILINE).group(1)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["tests/test_conformance.py", "-k", f"{name} or every_setting"]
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    # Every kernel on the new family (run, or refused by name; skipped where not native) and
    # the test of every field.
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped)", run.stdout)}
    assert run.returncode == 0 and sum(counts.values()) == len(KERNELS) + 1, run.stdout
