"""README.md's examples hold: the library example runs as written, its test and lint commands are
the ones CI runs, and every command in README.md and the guides in docs/ names files, modules,
flags and config keys that exist."""

import concurrent.futures
import importlib
import importlib.util
import re
import subprocess
import sys

import pytest
from helpers.readme_blocks import python_blocks, run_block, stated_output
from helpers.repository import ROOT, tracked_files

README = (ROOT / "README.md").read_text()
# The guides README.md sends its reader to for the full commands.
GUIDES = (
    "docs/results.md",
    "docs/runs.md",
    "docs/accelerators.md",
    "docs/performance.md",
    "docs/library.md",
)


def _commands(text: str) -> list[str]:
    """The command lines of a markdown text (indented code, continuation lines joined) that run
    Python."""
    lines, pending = [], ""
    for line in text.splitlines():
        if not line.startswith("    "):
            pending = ""
            continue
        text = line[4:].rstrip()
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        lines.append(pending + text)
        pending = ""
    return [line for line in lines if re.search(r"\bpython (-m \S+|\S+\.py)", line)]


def _defined_flags() -> set[str]:
    """Every absl flag the repository defines, and absl's own."""
    pattern = re.compile(r"DEFINE_\w+\(\s*['\"](\w+)['\"]")
    names = {"help", "helpfull", "verbosity"}
    for path in tracked_files():
        if path.endswith(".py") and (ROOT / path).is_file():  # tracked, not deleted
            names.update(pattern.findall((ROOT / path).read_text()))
    return names


@pytest.mark.slow
def test_the_library_example_runs_and_gives_the_shapes_it_states():
    opening = "import jax, jax.numpy as jnp, jrope\n"
    example = re.search(rf"```python\n({re.escape(opening)}.*?)```", README, re.DOTALL)
    namespace = {}
    exec(example.group(1), namespace)  # noqa: S102  (the README's own example)
    assert {name: value.shape for name, value in namespace["params"].items()} == {
        "gamma_raw": (4, 8),
        "eta_raw": (4, 8),
    }
    for mapped in ("q2", "k2"):
        assert namespace[mapped].shape == (2, 128, 4, 32)  # [B, T, N, H]
    assert namespace["bias"].shape == (4, 128, 128)  # [N, T, S]
    assert namespace["logits"].shape == (2, 4, 128, 128)  # [B, N, T, S]


@pytest.mark.slow
def test_the_library_examples_print_what_their_comments_state(tmp_path):
    blocks = python_blocks("Jordan-RoPE in your own model")
    assert len(blocks) == 2
    for block in blocks:
        stated = stated_output(block)
        assert stated, "every example prints what it shows"
        result = run_block(sys.executable, block, cwd=tmp_path, import_from_root=True)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.splitlines() == stated


def _collected(*args: str) -> set[str]:
    """The test ids `python -m pytest --collect-only <args>` selects."""
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {line for line in listing.splitlines() if "::" in line}


@pytest.mark.slow
def test_the_suite_runs_representative_cases_and_leaves_the_published_checks_to_their_marker():
    files = ("tests/test_packed_attention.py", "tests/test_documented_results.py")
    with concurrent.futures.ThreadPoolExecutor() as pool:  # three collections side by side
        suite, every_case, published = pool.map(
            lambda extra: _collected(*files, *extra), [(), ("--all-cases",), ("-m", "published")]
        )
    matrix = "test_packed_rows_equal_each_segment_alone_with_gradients"
    in_suite = {test for test in suite if matrix in test}
    assert {test.split("[")[1] for test in in_suite} == {
        "einsum-alibi]",
        "xla-jordan_rope]",
        "blockwise-damped_rope]",
    }
    assert len([test for test in every_case if matrix in test]) == 12
    assert published and not published & suite
    assert all("test_documented_results" in test for test in published)
    assert any("quick_start" in test for test in published)


def test_the_readme_test_and_lint_commands_are_the_ones_ci_runs():
    ci_lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    readme_commands = [line.split("#")[0].strip() for line in README.splitlines()]
    for command in (
        "python -m pytest -q -n 2 --dist loadfile",
        "python -m pytest -q -n 2 --dist loadfile -m published",
        "ruff check .",
        "ruff format --check .",
    ):
        assert command in ci_lines
    assert "python -m pytest -q -n 2 --dist loadfile" in readme_commands
    assert 'python -m pytest -q -n 2 --dist loadfile -m "not slow"' in readme_commands
    assert "python -m pytest -q -n 2 --dist loadfile -m published" in readme_commands
    assert "ruff check . && ruff format --check ." in readme_commands
    # The development install: the compat editable mode (tests/test_install.py says why).
    install = 'pip install -e ".[dev]" --config-settings editable_mode=compat'
    assert f"python -m {install}" in ci_lines
    assert install in readme_commands
    # The wheel the README builds has the name pip gives it (`pip wheel` names it by the version).
    import jrope

    assert f'pip install "dist/jrope-{jrope.__version__}-py3-none-any.whl[train]"' in README


def test_every_command_names_files_modules_flags_and_config_keys_that_exist():
    readme_commands = _commands(README)
    assert len(readme_commands) > 10  # the parser still finds the README's commands
    commands = readme_commands + [
        command for guide in GUIDES for command in _commands((ROOT / guide).read_text())
    ]
    assert len(commands) > 30
    flags = _defined_flags()
    problems = []
    for command in commands:
        if "python -m pytest" in command:
            continue  # pytest's own flags
        for module in re.findall(r"python -m ([\w.]+)", command):
            if importlib.util.find_spec(module) is None:
                problems.append(f"no module {module}: {command}")
        for script in re.findall(r"python ([\w/.-]+\.py)", command):
            if not (ROOT / script).is_file():
                problems.append(f"no file {script}: {command}")
        for flag in re.findall(r"(?<!\S)'?--(\w+)", command):
            if flag not in flags and not command.startswith(("gcloud", "curl", "uv ")):
                problems.append(f"no flag --{flag}: {command}")
        config_file = re.search(r"--config=(configs/\w+)\.py", command)
        if config_file:
            config = importlib.import_module(config_file.group(1).replace("/", ".")).get_config()
            for key in re.findall(r"--config\.([\w.]+)=", command):
                node = config
                try:
                    for part in key.split("."):
                        node = node[part]
                except KeyError:
                    problems.append(f"{config_file.group(1)} has no key {key}: {command}")
    assert problems == []
