"""The house: the library apart from the harness, each object built once, its own docs cited."""

import re
import subprocess
import sys

import jax
from flax import nnx
from helpers.repository import ROOT, tracked_files
from helpers.tiny_config import tiny_config

import jrope
from jrope.model.transformer import CausalSelfAttention
from jrope.train import checks
from jrope.train import config as run_config
from jrope.train.setup import model_from_params, set_up_run
from jrope.train.trainer import make_train_step


def test_the_library_imports_nothing_of_the_harness_or_the_data():
    code = (
        "import sys, jrope, jrope.attention, jrope.model, jrope.pe_math\n"
        "print(sorted(m for m in sys.modules if m.startswith(('jrope.train', 'jrope.data'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


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


def test_a_run_parses_its_encoding_name_and_builds_its_encoding_once(monkeypatch, tmp_path):
    calls = {"parse": 0, "build": 0}

    def counting(name, wrapped):
        def call(*args, **kwargs):
            calls[name] += 1
            return wrapped(*args, **kwargs)

        return call

    monkeypatch.setattr(
        run_config,
        "pe_config_from_name",
        counting("parse", run_config.pe_config_from_name),
    )
    monkeypatch.setattr(run_config, "make_encoding", counting("build", run_config.make_encoding))
    monkeypatch.setattr(jrope, "make_encoding", counting("build", jrope.make_encoding))
    cfg = tiny_config()
    one_cpu = checks.RunEnvironment(1, 1, "cpu", None)
    checks.check_training_run(cfg, str(tmp_path / "run"), one_cpu)
    run = set_up_run(cfg, devices=jax.devices()[:1])
    state = run.init_state()
    make_train_step(run)
    assert calls == {"parse": 1, "build": 1}
    # Every attention layer of the model holds the run's one Encoding object.
    model = model_from_params(run.layout.graphdef, state["params"])
    layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, CausalSelfAttention)]
    assert len(layers) == cfg.model.num_layers
    assert all(layer.encoding is cfg.encoding for layer in layers)
