"""What an installed jrope needs and holds: the core install (jax and flax) runs the library, a
wheel runs the experiments by name from any folder, and the development install is found from
the folder that holds a clone."""

import json
import re
import shutil
import subprocess
import sys
import venv

import pytest
from helpers.readme_blocks import python_blocks, run_block, stated_output
from helpers.repository import ROOT, tracked_files
from helpers.train_process import subprocess_env

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


@pytest.mark.slow
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


@pytest.mark.published
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
    # The experiments' commands say which extra they need.
    run = ["--config=quickstart", "--workdir=run"]
    for command in (
        [python, "-m", "jrope.train", *run],
        [python, "-m", "jrope.eval", *run],
        [python, "-m", "jrope.check"],
        [python, "-m", "jrope.compare", *run, "--methods=rope"],
        [tmp_path / "core" / "bin" / "jrope-train", *run],
    ):
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        assert done.stderr.endswith("in a clone, or the wheel with [train].\n")
    helped = subprocess.run([tmp_path / "core" / "bin" / "jrope-train", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert helped.returncode == 0 and "--workdir" in helped.stdout, helped.stderr[-2000:]


def test_pyproject_lists_every_package():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "jrope").rglob("__init__.py")
    }
    assert on_disk <= set(setuptools["packages"]), sorted(on_disk - set(setuptools["packages"]))
    # The experiments' configs go into the wheel from the one configs/ of the repository.
    assert setuptools["package-dir"] == {"jrope.installed_configs.configs": "configs"}


def _venv_over_this_environment(path):
    """A venv that sees this environment's packages (jax, flax, orbax, ...); its own jrope wins."""
    venv.create(path, with_pip=True, system_site_packages=True)
    return path / "bin" / "python"


def _env_without_pythonpath(tmp_path):
    env = subprocess_env(1)
    env.pop("PYTHONPATH", None)
    return env


def _skip_without_an_index(result):
    """A build needs setuptools from the package index (build isolation)."""
    if result.returncode != 0 and "setuptools" in result.stderr and "No matching" in result.stderr:
        pytest.skip(
            f"no package index reachable for the build's setuptools:\n{result.stderr[-500:]}"
        )


# The quick start's config at test scale: one tiny layer, 8 steps.
TINY_QUICKSTART = [
    "--config.model.d_model=16", "--config.model.num_heads=2", "--config.model.num_layers=1",
    "--config.pe.train_context=8", "--config.data.second_freq_index=1", "--config.num_steps=8",
    "--config.batch_size=8", "--config.eval.lengths=(8,)", "--config.eval.num_sequences=8",
    "--config.eval.batch_size=8", "--config.checkpoint.every_steps=8",
    "--config.log.tensorboard=False",
]  # fmt: skip


@pytest.mark.published
def test_a_wheel_runs_the_quick_start_by_name_and_its_evaluation_from_another_folder(tmp_path):
    source = _copy_of_the_repository(tmp_path / "source")
    built = _pip(
        sys.executable, "wheel", "--no-deps", "-w", tmp_path / "wheels", source, cwd=tmp_path
    )
    _skip_without_an_index(built)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheels").glob("jrope-*.whl")
    python = _venv_over_this_environment(tmp_path / "venv")
    installed = _pip(python, "install", "--no-deps", wheel, cwd=tmp_path)
    assert installed.returncode == 0, installed.stderr[-3000:]
    for script in ("jrope-train", "jrope-eval", "jrope-sample", "jrope-compare"):
        assert (tmp_path / "venv" / "bin" / script).is_file(), script

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = _env_without_pythonpath(tmp_path)

    def run(*args):
        return subprocess.run(
            [python, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900
        )

    train = run("-m", "jrope.train", "--config=quickstart", *TINY_QUICKSTART, "--workdir=run")
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    assert "site-packages" not in train.stdout  # the config by name, not by the wheel's path
    # The run names the evaluation command of an installed package, not a clone's eval.py.
    train_again = run("-m", "jrope.train", "--config=quickstart", *TINY_QUICKSTART, "--workdir=run")
    assert (
        "Finished earlier: python -m jrope.eval --workdir=run evaluates again."
        in train_again.stdout
    )
    evaluation = run("-m", "jrope.eval", "--workdir=run", "--config.eval.lengths=(8,16)")
    assert evaluation.returncode == 0, evaluation.stdout[-2000:] + evaluation.stderr[-3000:]
    assert "length 16:" in evaluation.stdout
    assert "eval_16/accuracy" in (elsewhere / "run" / "metrics.jsonl").read_text()
    # The wheel's jrope ran, not this environment's.
    started = json.loads((elsewhere / "run" / "starts.jsonl").read_text().splitlines()[0])
    assert "site-packages" in started["command"][1]


@pytest.mark.published
def test_the_folder_holding_a_clone_does_not_shadow_the_development_install(tmp_path):
    clone = _copy_of_the_repository(tmp_path / "parent" / "jrope")  # a clone in a folder `jrope`
    python = _venv_over_this_environment(tmp_path / "venv")
    # README's development install (without the extras, which this environment has).
    installed = _pip(
        python, "install", "--no-deps", "-e", clone, "--config-settings", "editable_mode=compat",
        cwd=tmp_path,
    )  # fmt: skip
    _skip_without_an_index(installed)
    assert installed.returncode == 0, installed.stderr[-3000:]
    code = "import jrope; print(jrope.__file__); jrope.pe_config_from_name('rope', train_context=8)"
    imported = subprocess.run(
        [python, "-c", code], cwd=tmp_path / "parent", env=_env_without_pythonpath(tmp_path),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.strip() == str(clone / "jrope" / "__init__.py")
