"""The library imports downward and lightly: what a fresh interpreter holds after each import."""

import ast
import json
import pathlib
import subprocess
import sys

import pytest

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


def test_import_jrope_and_the_training_command_load_no_jax_until_used():
    # A command's --help and its command-line mistakes answer without loading JAX.
    modules = _modules_loaded_by("import jrope, jrope.train.__main__")
    for package in ("jax", "flax", *HEAVY_MODULES):
        assert not _loaded(modules, package), f"import jrope loaded {_loaded(modules, package)}"
    # The public names load on first use.
    modules = _modules_loaded_by("import jrope; jrope.make_encoding; from jrope import pe_math")
    assert "jax" in modules and "jrope.encodings" in modules and "jrope.pe_math" in modules
    assert not _loaded(modules, "jrope.model")


def test_import_jrope_attention_loads_neither_the_model_nor_the_harness():
    modules = _modules_loaded_by("import jrope.attention")
    assert "jrope.attention" in modules
    for package in ("jrope.model", "jrope.train", "jrope.data", *HEAVY_MODULES):
        assert not _loaded(modules, package), f"import jrope.attention loaded {package}"


@pytest.mark.slow
def test_import_jrope_model_loads_no_harness_or_data():
    modules = _modules_loaded_by("import jrope.model")
    for package in ("jrope.train", "jrope.data", *HEAVY_MODULES):
        assert not _loaded(modules, package), f"import jrope.model loaded {package}"


_ROOT = pathlib.Path(__file__).resolve().parents[1]
# The modules of the research loop: the harness, the experiments and what both share.
_LOOP = ("jrope.train", "jrope.experiments", "jrope.results", "jrope.saved_run_config")


def _module_names() -> list[str]:
    paths = (_ROOT / "jrope").rglob("*.py")
    names = [".".join(path.relative_to(_ROOT).with_suffix("").parts) for path in paths]
    return [name.removesuffix(".__init__") for name in names]


def _imports(module: str) -> set[str]:
    """The jrope modules that `module`'s source imports anywhere (type-only imports included)."""
    path = _ROOT / module.replace(".", "/")
    source = (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()
    known, found = set(_module_names()), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in known and name != module}


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == package or module.startswith(package + ".") for package in packages)


def test_the_research_loop_has_no_import_circles():
    graph = {name: _imports(name) for name in _module_names() if _in(name, _LOOP)}

    def circle_from(start: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        for following in graph.get(path[-1], ()):
            if following == start:
                return path
            if following not in path and following in graph:
                found = circle_from(start, (*path, following))
                if found:
                    return found
        return None

    for name in graph:
        assert circle_from(name, (name,)) is None, circle_from(name, (name,))


def test_the_experiments_write_results_through_the_shared_module():
    # The kernel probe trains nothing: it needs no harness module at all.
    assert not [name for name in _imports("jrope.experiments.kernel_probe") if "train" in name]
    assert "jrope.results" in _imports("jrope.experiments.kernel_probe")
    assert not _in("jrope.train", tuple(_imports("jrope.results")))


def test_the_flop_count_module_loads_no_data_source():
    assert "jrope.data.source" not in _imports("jrope.train.outputs")


def test_only_the_harness_modules_that_open_workdir_paths_import_the_path_helpers():
    importing = {
        name
        for name in _module_names()
        if _in(name, ("jrope.train",)) and "jrope.data.files" in _imports(name)
    }
    assert importing <= {
        "jrope.train.checkpoints",  # the checkpoint folder and the lock
        "jrope.train.outputs",  # the metrics log on a bucket
        "jrope.train.runtime",  # the compilation cache and the profile folder
        "jrope.train.setup",  # the checks: a workdir or data path is writable, a bucket answers
    }, importing


def _imports_of_package(package: str) -> dict[str, set[str]]:
    """module -> the jrope modules it imports, type-only (TYPE_CHECKING) imports included.

    Read from the source (ast), so an import that never runs counts too.
    """
    import ast
    import pathlib

    import jrope

    root = pathlib.Path(jrope.__file__).parent.parent
    graph = {}
    for path in sorted((root / package.replace(".", "/")).glob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        graph[module] = {name for name in imported if name.startswith("jrope")}
    return graph


def test_no_module_of_jrope_attention_imports_jrope_model_even_for_types():
    for module, imported in _imports_of_package("jrope.attention").items():
        model = sorted(name for name in imported if name.startswith("jrope.model"))
        assert not model, f"{module} imports {model}"


def test_no_import_circle_within_jrope_attention_and_jrope_model():
    graph = {**_imports_of_package("jrope.attention"), **_imports_of_package("jrope.model")}
    # Edges between the modules of the two packages ('from pkg import mod' names mod).
    edges = {
        module: {name for name in imported if name in graph and name != module}
        for module, imported in graph.items()
    }
    for package in ("jrope.attention", "jrope.model"):
        for module in edges:  # a package's __init__ re-exports its modules: not a circle
            if module != package:
                edges[module].discard(package)
    visiting, done = [], set()

    def visit(module):
        if module in done:
            return
        assert module not in visiting, "import circle: " + " -> ".join([*visiting, module])
        visiting.append(module)
        for name in sorted(edges[module]):
            visit(name)
        visiting.pop()
        done.add(module)

    for module in sorted(edges):
        visit(module)
