"""The entry points' restart with glibc's huge-page option: when it happens and what it keeps."""

import os
import subprocess
import sys

from jrope.train import huge_pages
from jrope.train.huge_pages import OPT_OUT, TUNABLE, environment_with_huge_pages

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GLIBC = (2, 36)


def test_adds_the_option_to_the_environment():
    environ = environment_with_huge_pages({"HOME": "/x"}, _GLIBC, "madvise")
    assert environ == {"HOME": "/x", "GLIBC_TUNABLES": f"{TUNABLE}=1"}


def test_keeps_other_tunables():
    environ = environment_with_huge_pages(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, _GLIBC, "always"
    )
    assert environ["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=1"


def test_no_restart_when_set_unsupported_or_declined():
    assert (
        environment_with_huge_pages({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, _GLIBC, "madvise") is None
    )
    assert environment_with_huge_pages({OPT_OUT: "0"}, _GLIBC, "madvise") is None
    assert environment_with_huge_pages({}, (2, 34), "madvise") is None
    assert environment_with_huge_pages({}, None, "madvise") is None
    assert environment_with_huge_pages({}, _GLIBC, "never") is None
    assert environment_with_huge_pages({}, _GLIBC, None) is None


def test_restart_keeps_the_process_and_command_line():
    """`python -c` restarts once, as the same process, with the option set (where supported)."""
    script = (
        "import os, sys\n"
        "print('pid', os.getpid(), flush=True)\n"
        "from jrope.train import huge_pages\n"
        "huge_pages.restart_with_huge_pages()\n"
        "print('tunables', os.environ.get('GLIBC_TUNABLES'))\n"
    )
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT)}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=_REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    lines = result.stdout.splitlines()
    supported = huge_pages.environment_with_huge_pages(
        {}, huge_pages._glibc_version(), huge_pages._thp_mode()
    )
    if sys.platform.startswith("linux") and supported is not None:
        pids = [line for line in lines if line.startswith("pid")]
        assert len(pids) == 2 and pids[0] == pids[1], lines
        assert lines[-1] == f"tunables {TUNABLE}=1"
    else:
        assert lines[-1] == "tunables None"
