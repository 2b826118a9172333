"""The Cloud TPU and GPU commands checked without the hardware: the whole train step of
configs/wikitext_scaled_exact.py exported with jax.export for 'tpu' and 'cuda'.

The model asks JAX's default backend which attention kernel 'auto' takes, so while the step is
traced the test names the target backend (jax.default_backend returns it); everything else is
the run's own set-up. Exporting lowers the step for the target: the splash kernel's Mosaic
custom call is built here, in Python, so a block shape it cannot tile fails now; only the
target's compiler itself runs on the hardware alone. The data: the config's shape with the
'text' source over a small file (no download).
"""

import re

import jax
import pytest
from jax import export

from configs import wikitext_scaled_exact
from jrope.attention import choose_kernel
from jrope.train.config import convert_config
from jrope.train.setup import set_up_run
from jrope.train.trainer import make_train_step

pytestmark = pytest.mark.slow  # about 3 s per export on the 2-core development machine

# JAX's platform name for jax.export, and its backend name for the kernel choice.
BACKENDS = {"tpu": "tpu", "cuda": "gpu"}
RAW_SHEAR = "jordan_rope"  # its maps keep q, k float32 for HIGHEST dots; the shear kernel does not


def _run(tmp_path, **overrides):
    """The run of configs/wikitext_scaled_exact.py with `overrides` ('model.compute_dtype': ...)."""
    text = tmp_path / "train.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 300)
    config = wikitext_scaled_exact.get_config()
    config.data.source = "text"
    config.data.path = config.data.eval_path = str(text)
    config.data.cache_dir = str(tmp_path / "cache")
    for key, value in overrides.items():
        section, name = key.split(".")
        config[section][name] = value
    cfg, problems = convert_config(config)
    assert problems == []
    return set_up_run(cfg)


def _export_train_step(run, platform: str, monkeypatch) -> str:
    """The exported train step's StableHLO text for `platform` ('tpu' or 'cuda')."""
    step = make_train_step(run, compiler_options={})
    batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), run.source.train_batch(0)
    )
    # Under the run's mesh, as the training loop calls the step (splash runs in shard_map there).
    with monkeypatch.context() as patch, jax.set_mesh(run.mesh):
        patch.setattr(jax, "default_backend", lambda: BACKENDS[platform])
        exported = export.export(step, platforms=(platform,))(run.layout.abstract, batch)
    assert exported.platforms == (platform,)
    return exported.mlir_module()


def _attention_dot_precisions(text: str, length: int) -> list[str]:
    """Precision of every dot with a [.., T, S] logits or probabilities operand or result.

    No other dot of the model has two axes of the window's length.
    """
    precisions = []
    for line in text.splitlines():
        if "stablehlo.dot_general" in line and f"{length}x{length}" in line:
            match = re.search(r"precision = \[(\w+), (\w+)\]", line)
            precisions.append(match.group(1) if match else "DEFAULT")
    return precisions


@pytest.mark.parametrize(
    ("platform", "name", "kernel", "precision"),
    [
        ("tpu", "jordan_exact_scaled", "splash", None),
        ("tpu", RAW_SHEAR, "shear", "DEFAULT"),
        ("cuda", "jordan_exact_scaled", "xla", "DEFAULT"),
        ("cuda", RAW_SHEAR, "shear", "DEFAULT"),
    ],
)
def test_the_train_step_exports_with_the_kernel_and_precision_auto_takes_there(
    tmp_path, monkeypatch, platform, name, kernel, precision
):
    run = _run(tmp_path, **{"pe.name": name})
    length = run.train_length
    backend = BACKENDS[platform]
    assert (
        choose_kernel(run.plan.model.attention, run.encoding, length=length, backend=backend)
        == kernel
    )
    text = _export_train_step(run, platform, monkeypatch)
    dots = _attention_dot_precisions(text, length)
    if kernel == "splash":
        # The Mosaic kernel: forward, and the dq and dk/dv kernels of the backward pass.
        assert text.count("tpu_custom_call") >= 3
        assert dots == []  # the attention's dots are all inside the kernel
    else:
        assert "tpu_custom_call" not in text
        assert len(dots) >= 6  # q.k and p.v forward, the dots of their gradients
        assert set(dots) == {precision}


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_the_bfloat16_jordan_rope_step_carries_no_highest_attention_dot(
    tmp_path, monkeypatch, platform
):
    """--config.pe.name=jordan_rope --config.model.compute_dtype=bfloat16: the shear kernel's
    bfloat16 dots at the default precision, forward and backward."""
    run = _run(tmp_path, **{"pe.name": RAW_SHEAR, "model.compute_dtype": "bfloat16"})
    length = run.train_length
    backend = BACKENDS[platform]
    attention = run.plan.model.attention
    assert choose_kernel(attention, run.encoding, length=length, backend=backend) == "shear"
    text = _export_train_step(run, platform, monkeypatch)
    dots = _attention_dot_precisions(text, length)
    assert len(dots) >= 6 and set(dots) == {"DEFAULT"}
    logit_dots = [
        line for line in text.splitlines() if "stablehlo.dot_general" in line and "bf16" in line
    ]
    assert any(f"{length}x{length}xf32" in line for line in logit_dots)  # bf16 in, f32 out


def test_the_gpu_commands_bfloat16_step_exports_with_cudnn_where_cudnn_is_installed(
    tmp_path, monkeypatch
):
    """README's GPU command adds model.compute_dtype=bfloat16: 'auto' takes cuDNN attention."""
    run = _run(tmp_path, **{"model.compute_dtype": "bfloat16"})
    length = run.train_length
    assert (
        choose_kernel(run.plan.model.attention, run.encoding, length=length, backend="gpu")
        == "cudnn"
    )
    try:
        text = _export_train_step(run, "cuda", monkeypatch)
    except RuntimeError as error:
        # jax.nn.dot_product_attention(implementation='cudnn') reads the installed cuDNN's
        # version while tracing, so without cuDNN the step cannot be lowered for it.
        if "cuDNN" not in str(error):
            raise
        pytest.skip(f"the cuDNN step cannot be lowered on a host without cuDNN: {error}")
    assert "cudnn" in text.lower()
    assert _attention_dot_precisions(text, length) == []  # inside cuDNN's fused kernel


def test_the_bfloat16_flash_step_exports_for_tpu_on_a_mesh_of_eight_devices(tmp_path, monkeypatch):
    """attention_impl='shear_flash' on a (data 2, fsdp 2, tensor 2) mesh: the Pallas kernels,
    which XLA cannot partition, run in shard_map over the batch; every layer's forward and
    two backward kernels are there, and no attention dot is left outside them."""
    run = _run(
        tmp_path,
        **{
            "pe.name": RAW_SHEAR,
            "model.compute_dtype": "bfloat16",
            "model.attention_impl": "shear_flash",
            "mesh.data": 2,
            "mesh.fsdp": 2,
            "mesh.tensor": 2,
        },
    )
    assert run.mesh.size == 8
    text = _export_train_step(run, "tpu", monkeypatch)
    assert text.count("@tpu_custom_call") == 3 * run.plan.model.num_layers
    assert "sdy.manual_computation" in text
    assert _attention_dot_precisions(text, run.train_length) == []
