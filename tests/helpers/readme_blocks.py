"""README.md's Python examples as scripts, with the output their `print(...)  # text` lines state."""

import os
import re
import subprocess

from helpers.repository import ROOT


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of README.md's section titled `section` (its `## ` heading)."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index(f"\n## {section}\n")
    end = readme.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", readme[start:end], re.DOTALL)


def stated_output(block: str) -> list[str]:
    """The lines a block says it prints: the comment after each line that starts with print(."""
    return [
        line.split("  # ", 1)[1].strip() for line in block.splitlines() if line.startswith("print(")
    ]


def run_block(
    python: str, block: str, cwd, *, import_from_root: bool
) -> subprocess.CompletedProcess:
    """Runs `block` as a script with the interpreter `python` in `cwd`, capturing its output.

    import_from_root: import jrope from this repository (else: the interpreter's install)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    if import_from_root:
        env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [python, "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
