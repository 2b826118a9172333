"""The house: the library apart from the harness, a harness of few modules, its own docs cited."""

import re
import subprocess
import sys

import jax
import pytest
from flax import nnx
from helpers.repository import ROOT, tracked_files
from helpers.tiny_config import tiny_config

from jrope.model.transformer import CausalSelfAttention
from jrope.train import setup
from jrope.train.setup import model_from_params, set_up_run
from jrope.train.trainer import make_train_step


@pytest.mark.slow
def test_the_library_imports_nothing_of_the_harness_or_the_data():
    code = (
        "import sys, jrope, jrope.attention, jrope.model, jrope.pe_math\n"
        "print(sorted(m for m in sys.modules if m.startswith(('jrope.train', 'jrope.data'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def _modules_loaded_by(imports: str) -> list[str]:
    """The jrope.train and jrope.data modules, and the flags defined, after `imports` alone."""
    code = (
        f"import sys\nfrom absl import flags\n{imports}\n"
        "print(sorted(m for m in sys.modules if m.startswith(('jrope.train', 'jrope.data'))))\n"
        "print(sorted(name for name in ('verbose', 'workdir', 'config') if name in flags.FLAGS))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    return result.stdout.splitlines()


def test_the_harness_is_a_few_modules_each_named_for_its_role():
    modules = sorted(path.stem for path in (ROOT / "jrope" / "train").glob("*.py"))
    modules.remove("__init__")
    assert len(modules) <= 10, modules
    assert {"config", "setup", "trainer", "checkpoints", "evaluation"} <= set(modules)


@pytest.mark.slow
def test_the_data_layer_and_the_harness_define_no_entry_point_flags():
    """Importing a data source or the harness neither reaches up into the entry points nor
    registers their command-line flags; only running an entry point does."""
    data_modules, defined = _modules_loaded_by("import jrope.data.audio, jrope.data.synthetic")
    assert "jrope.train" not in data_modules and defined == "[]"
    imports = (
        "import jrope.train.trainer, jrope.train.evaluation, jrope.experiments.text_generation"
    )
    harness_modules, defined = _modules_loaded_by(imports)
    assert "'jrope.train.trainer'" in harness_modules
    assert defined == "[]"


# Markdown tables the programs write into a workdir, named in docstrings and the README.
RESULT_TABLES = ("eval.md", "kernel_probe.md", "comparison.md")


def test_every_document_the_repository_cites_is_in_the_repository():
    tracked = tracked_files()
    written = " ".join((ROOT / path).read_text() for path in tracked if path.startswith("jrope/"))
    for table in RESULT_TABLES:
        assert table in written  # still written by the code, so still allowed below
    missing = []
    for path in tracked:
        if not path.endswith((".py", ".md", ".toml")):
            continue
        for cited in set(re.findall(r"[\w./-]+\.md\b", (ROOT / path).read_text())):
            in_repository = (ROOT / cited).is_file() or ((ROOT / path).parent / cited).is_file()
            a_result_table = cited.split("/")[-1] in RESULT_TABLES and not cited.startswith("docs/")
            if not (in_repository or a_result_table):
                missing.append(f"{path}: {cited}")
    assert missing == []


def test_every_attention_layer_holds_the_runs_one_encoding(tmp_path):
    cfg = tiny_config()
    one_cpu = setup.RunEnvironment(1, 1, "cpu")
    setup.check_run(cfg, str(tmp_path / "run"), one_cpu)
    run = set_up_run(cfg, devices=jax.devices()[:1])
    state = run.init_state()
    make_train_step(run)
    model = model_from_params(run.layout.graphdef, state["params"])
    layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, CausalSelfAttention)]
    assert len(layers) == cfg.model.num_layers
    assert all(layer.encoding is run.encoding for layer in layers)
