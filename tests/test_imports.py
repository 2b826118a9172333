"""The library imports downward and lightly: what a fresh interpreter holds after each import."""

import json
import subprocess
import sys

HEAVY_MODULES = ("tensorflow_datasets", "orbax", "matplotlib", "tensorboardX")


def _modules_loaded_by(statement: str) -> list[str]:
    """The names in sys.modules after `statement` runs in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _loaded(modules: list[str], package: str) -> list[str]:
    return [name for name in modules if name == package or name.startswith(package + ".")]


def test_import_jrope_loads_no_dataset_checkpoint_or_plotting_library():
    modules = _modules_loaded_by("import jrope")
    for package in HEAVY_MODULES:
        assert not _loaded(modules, package), f"import jrope loaded {_loaded(modules, package)}"


def test_import_jrope_attention_loads_neither_the_model_nor_the_harness():
    modules = _modules_loaded_by("import jrope.attention")
    assert "jrope.attention" in modules
    for package in ("jrope.model", "jrope.train", "jrope.data", *HEAVY_MODULES):
        assert not _loaded(modules, package), f"import jrope.attention loaded {package}"


def test_import_jrope_model_loads_no_harness_or_data():
    modules = _modules_loaded_by("import jrope.model")
    for package in ("jrope.train", "jrope.data", *HEAVY_MODULES):
        assert not _loaded(modules, package), f"import jrope.model loaded {package}"
