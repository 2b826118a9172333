"""`python -m jrope.check` on CPU: the whole command on a tiny config, and the failures it must
name: a kernel that disagrees with float64, a compiler that ignores HIGHEST, an absent
accelerator."""

import json
import re

import jax.numpy as jnp
import pytest
from helpers.repository import ROOT
from helpers.tiny_config import tiny_config
from helpers.train_process import run_command, subprocess_env

from jrope import check, encodings
from jrope.attention import dense

# configs/synthetic.py shrunk as tests/helpers/tiny_config.py shrinks it, every position read.
TINY_OVERRIDES = [
    "--config=configs/synthetic.py",
    "--config.model.d_model=32",
    "--config.model.num_heads=2",
    "--config.model.num_layers=1",
    "--config.model.readout=all",
    "--config.pe.train_context=16",
    "--config.data.second_freq_index=1",
    "--config.eval.lengths=(16,)",
    "--config.batch_size=8",
    "--config.eval.batch_size=4",
    "--config.eval.num_sequences=4",
    "--config.mesh.data=1",
]


def test_asking_for_an_accelerator_that_is_not_installed_says_what_to_install():
    problem = check.backend_problem("tpu")
    assert problem.startswith("--backend=tpu: ")
    assert problem.endswith(
        '; install: pip install ".[train,tpu,gcs]" in a clone, or the wheel with [train,tpu,gcs].'
    )
    assert 'pip install ".[train,cuda12,gcs]"' in check.backend_problem("gpu")
    assert check.backend_problem("cpu") is None


def test_the_verdict_names_the_first_failure_and_the_exit_status_follows_it():
    rows = (
        check.Row("kernels", "xla at 1024 (forced)", "values 1.0e-06", "1.0e-03", check.PASS),
        check.Row("kernels", "cudnn", "n/a: GPU only", result=check.NOT_APPLICABLE),
        check.Row(
            "kernels", "splash at 1024 (auto)", "values 3.0e-01", "5.0e-02", check.FAIL, "Use xla."
        ),
        check.Row("train step", "peak memory", "90 GiB", "80 GiB", check.FAIL, "Lower it."),
    )
    report = check.Report("python -m jrope.check", "today", rows)
    assert report.exit_status == check.CHECK_FAILED_STATUS
    assert report.verdict.startswith("FAIL (2 of 3 checks): first kernels: splash at 1024 (auto)")
    assert report.verdict.endswith("Use xla.")
    passing = check.Report("python -m jrope.check", "today", rows[:2])
    assert (passing.exit_status, passing.verdict) == (0, "PASS: all 1 checks passed.")


def test_the_tolerances_in_the_docs_are_the_codes():
    text = (ROOT / "docs/accelerators.md").read_text()
    for kind, promised in check.TOLERANCES.items():
        row = re.search(rf"^\| {kind} \|.*\| ([0-9.e-]+) \| ([0-9.e-]+) \|$", text, re.M)
        assert row, kind
        assert (float(row[1]), float(row[2])) == promised
    precision = re.search(r"must be within ([0-9.e-]+) \(per head", text)
    assert float(precision[1]) == check.PRECISION_TOLERANCE


@pytest.mark.slow  # about 2 minutes on the 2-core development machine: a dozen compilations
def test_the_command_checks_a_tiny_config_end_to_end_and_writes_its_table(tmp_path):
    result = run_command(
        ["-m", "jrope.check", *TINY_OVERRIDES, f"--output_dir={tmp_path}"],
        subprocess_env(1),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS: all" in result.stdout
    report = json.loads((tmp_path / "synthetic_cpu.json").read_text())
    assert report["exit_status"] == 0
    sections = {row["section"] for row in report["rows"]}
    assert sections == {"environment", "kernels", "precision", "train step"}
    assert "jax:" in report["environment"]  # jax.print_environment_info()
    kernels = {
        row["details"]["kernel"]
        for row in report["rows"]
        if row["result"] == "pass" and row["section"] == "kernels"
    }
    assert kernels == {"xla", "einsum", "blockwise", "shear", "shear_flash"}  # all that run on CPU
    not_here = [row["check"] for row in report["rows"] if row["result"] == "n/a"]
    assert {"cudnn", "splash"} <= set(not_here)
    report = (tmp_path / "synthetic_cpu").with_suffix(".md")  # <config>_<backend>.md
    assert report.read_text().startswith("`python -m jrope.check")


@pytest.mark.slow  # about 10 s: starting JAX in a subprocess
def test_the_command_asked_for_a_tpu_on_a_cpu_host_exits_2_saying_what_to_install(tmp_path):
    result = run_command(
        ["-m", "jrope.check", *TINY_OVERRIDES, "--backend=tpu", f"--output_dir={tmp_path}"],
        subprocess_env(1),
    )
    assert result.returncode == 2
    assert 'pip install ".[train,tpu,gcs]"' in result.stderr
    assert "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.md"))


@pytest.mark.slow  # about a minute: the four kernels at one length, splash in interpret mode
def test_a_kernel_that_disagrees_with_float64_fails_the_check_by_name(monkeypatch):
    cfg = tiny_config(
        **{
            "pe.name": "rope",
            "pe.train_context": 128,
            "eval.lengths": (128,),
            "model.readout": "all",
        }
    )
    real = dense.einsum_attention

    def off_by_a_percent(*args, **kwargs):
        return real(*args, **kwargs) * 1.01

    monkeypatch.setattr("jrope.attention.einsum_attention", off_by_a_percent)
    rows = check.kernel_rows(cfg, "cpu", say=lambda line: None)
    results = {row.details.get("kernel", row.check): row.result for row in rows}
    assert results == {
        "einsum": check.FAIL,
        "xla": check.PASS,
        "blockwise": check.PASS,
        "splash": check.PASS,  # in Pallas interpret mode: rope at 128 is what it takes on TPU
        "cudnn": check.NOT_APPLICABLE,
        "shear": check.PASS,  # its own dots, not the einsum
        "shear_flash": check.PASS,
    }
    report = check.Report("python -m jrope.check", "today", tuple(rows))
    assert report.exit_status == check.CHECK_FAILED_STATUS
    assert "first kernels: einsum at 128 (auto)" in report.verdict
    assert "Use a model.attention_impl that passed at 128." in report.verdict


@pytest.mark.slow  # about 20 s: the raw shear's logits at three precisions and in float64
def test_a_compiler_that_ignores_highest_fails_the_precision_check(monkeypatch):
    """Every dot of the logits run as one bfloat16 pass, as a TPU runs float32 at DEFAULT."""
    cfg = tiny_config(**{"pe.train_context": 128, "eval.lengths": (128, 256)})

    def bfloat16_passes(enc, params, q, k, q_positions, k_positions, *, precision=None):
        q2, k2 = enc.transform_qk(params, q, k, q_positions, k_positions)
        rounded = [x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q2, k2)]
        return jnp.einsum("btnh,bsnh->bnts", *rounded) / enc.head_dim**0.5

    honest = check.precision_rows(cfg, "tpu")
    assert [row.result for row in honest] == [check.PASS, check.PASS]  # jordan_rope, raw_tau
    monkeypatch.setattr(encodings, "attention_logits", bfloat16_passes)
    rows = check.precision_rows(cfg, "tpu")
    assert [row.result for row in rows] == [check.FAIL, check.FAIL]
    assert "ignores HIGHEST" in rows[0].advice
    assert rows[0].details["highest"] > 100 * honest[0].details["highest"]


@pytest.mark.slow  # about 30 s: three subprocesses that stop before any check runs
def test_a_config_or_folder_that_cannot_run_here_exits_2_before_any_check(tmp_path):
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    cases = [
        (["--config.pe.name=rope_alibi", "--config.model.attention_impl=xla"], "logit bias"),
        (["--config.pe.name=rope", "--config.model.attention_impl=splash"], "runs on TPU only"),
        ([f"--output_dir={blocked}/report"], f"--output_dir={blocked}/report: Not a directory"),
    ]
    for overrides, message in cases:
        result = run_command(["-m", "jrope.check", *TINY_OVERRIDES, *overrides], subprocess_env(1))
        assert result.returncode == 2, result.stderr[-2000:]
        assert message in result.stderr
        assert "Traceback" not in result.stderr and "Kernels" not in result.stdout
    probe = run_command(["-m", "jrope.check", "--config=kernel_probe"], subprocess_env(1))
    assert probe.returncode == 2
    assert "is a probe: give a run config" in probe.stderr
