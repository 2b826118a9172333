"""What an installed jrope needs and holds: the core install (jax and flax) runs the library."""

import json
import re
import shutil
import subprocess
import sys
import venv

import pytest
from helpers.readme_blocks import python_blocks, run_block, stated_output
from helpers.repository import ROOT, tracked_files

# The packages the experiments need (the `train` extra); the library must load none of them.
TRAIN_ONLY_MODULES = (
    "tensorflow_datasets",
    "array_record",
    "orbax",
    "ml_collections",
    "matplotlib",
    "tensorboardX",
)


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))\n"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


def test_the_library_api_loads_nothing_beyond_jax_flax_and_itself():
    flax_alone = _modules_after("import jax\nfrom flax import nnx")
    library = _modules_after(
        "import jrope, jrope.attention, jrope.model\n"
        "jrope.PositionalEncoding, jrope.dot_product_attention, jrope.causal_self_attention"
    )
    added = {name.split(".")[0] for name in library - flax_alone}
    # jax loads its Pallas submodules for the splash kernel; everything else is jrope's own.
    assert added <= {"jrope", "jax", "jaxlib"}, sorted(added)
    for package in TRAIN_ONLY_MODULES:
        assert not any(name.split(".")[0] == package for name in library), package
    for harness in ("jrope.train", "jrope.data", "jrope.experiments"):
        assert harness not in library


def _copy_of_the_repository(destination):
    """The tracked files only: a build here leaves nothing in the working tree."""
    for path in tracked_files():
        source = ROOT / path
        if source.is_file():
            (destination / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / path)
    return destination


def _pip(python, *args, cwd):
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=1200,
    )


def _this_environments_versions(path):
    """A pip constraints file: every package at the version installed here (the tested ones)."""
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    path.write_text("\n".join(line for line in frozen if "==" in line) + "\n")
    return path


@pytest.mark.slow
def test_the_core_install_alone_runs_the_readme_library_examples(tmp_path):
    constraints = _this_environments_versions(tmp_path / "constraints.txt")
    probe = _pip(
        sys.executable, "download", "--no-deps", "-c", constraints, "-d", tmp_path / "probe",
        "flax", cwd=tmp_path,
    )  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"no package index reachable: pip download flax failed:\n{probe.stderr[-500:]}")
    venv.create(tmp_path / "core", with_pip=True)  # no --system-site-packages
    python = tmp_path / "core" / "bin" / "python"
    source = _copy_of_the_repository(tmp_path / "source")
    installed = _pip(python, "install", "-c", constraints, source, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]

    packages = {
        re.split(r"==| @ ", line)[0].lower().replace("_", "-")
        for line in _pip(python, "freeze", cwd=tmp_path).stdout.splitlines()
    }
    assert {"jrope", "jax", "jaxlib", "flax"} <= packages
    for extra_only in ("tensorflow-datasets", "array-record", "ml-collections", "matplotlib"):
        assert extra_only not in packages, f"the core install pulled in {extra_only}"
    assert "tensorboardx" not in packages

    blocks = python_blocks("Jordan-RoPE in your own model")
    assert len(blocks) == 2
    for block in blocks:
        result = run_block(str(python), block, cwd=tmp_path, import_from_root=False)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.splitlines() == stated_output(block)
