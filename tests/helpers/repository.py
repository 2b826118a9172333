"""The repository the tests run in: its root and the files git tracks there."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def tracked_files() -> list[str]:
    """Paths relative to ROOT of every file git tracks (no virtual environments, no runs)."""
    listing = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return listing.stdout.split()
