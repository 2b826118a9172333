"""The entry points' restart with glibc's huge-page option: when it happens and what it keeps."""

import os
import subprocess
import sys

from jrope.train import huge_pages
from jrope.train.huge_pages import OPT_OUT, TUNABLE, environment_with_huge_pages

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GLIBC = (2, 36)


def test_adds_the_option_to_the_environment():
    environ = environment_with_huge_pages({"HOME": "/x"}, _GLIBC, "madvise", cpu_run=True)
    assert environ == {"HOME": "/x", "GLIBC_TUNABLES": f"{TUNABLE}=1"}


def test_keeps_other_tunables():
    environ = environment_with_huge_pages(
        {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, _GLIBC, "always", cpu_run=True
    )
    assert environ["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=1"


def test_no_restart_when_set_unsupported_or_declined():
    def restart(environ, glibc=_GLIBC, thp="madvise", cpu_run=True):
        return environment_with_huge_pages(environ, glibc, thp, cpu_run=cpu_run)

    assert restart({"GLIBC_TUNABLES": f"{TUNABLE}=0"}) is None
    assert restart({OPT_OUT: "0"}) is None
    assert restart({}, glibc=(2, 34)) is None
    assert restart({}, glibc=None) is None
    assert restart({}, thp="never") is None
    assert restart({}, thp=None) is None


def test_only_cpu_runs_restart_unless_asked():
    assert environment_with_huge_pages({}, _GLIBC, "madvise", cpu_run=False) is None
    asked = environment_with_huge_pages({OPT_OUT: "1"}, _GLIBC, "madvise", cpu_run=False)
    assert asked == {OPT_OUT: "1", "GLIBC_TUNABLES": f"{TUNABLE}=1"}


def test_the_backend_is_read_from_jax_platforms_or_the_installed_backends(monkeypatch):
    assert huge_pages.runs_on_cpu({"JAX_PLATFORMS": "cpu"})
    assert not huge_pages.runs_on_cpu({"JAX_PLATFORMS": "tpu"})
    assert not huge_pages.runs_on_cpu({"JAX_PLATFORMS": "cuda,cpu"})
    monkeypatch.setattr(huge_pages, "_accelerator_backend_installed", lambda: True)
    assert not huge_pages.runs_on_cpu({})
    monkeypatch.setattr(huge_pages, "_accelerator_backend_installed", lambda: False)
    assert huge_pages.runs_on_cpu({})


def test_this_cpu_only_machine_has_no_accelerator_backend():
    assert not huge_pages._accelerator_backend_installed()


def _run_entry_point(prelude: str = "") -> list[str]:
    """Output lines of a `python -c` entry point that restarts itself, run after `prelude`."""
    script = (
        "import os, sys\n"
        f"{prelude}"
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
    return result.stdout.splitlines()


def test_restart_keeps_the_process_and_command_line():
    """`python -c` restarts once, as the same process, with the option set (where supported)."""
    lines = _run_entry_point()
    supported = huge_pages.environment_with_huge_pages(
        {}, huge_pages._glibc_version(), huge_pages._thp_mode(), cpu_run=True
    )
    if sys.platform.startswith("linux") and supported is not None:
        pids = [line for line in lines if line.startswith("pid")]
        assert len(pids) == 2 and pids[0] == pids[1], lines
        assert lines[-1] == f"tunables {TUNABLE}=1"
    else:
        assert lines[-1] == "tunables None"


def test_no_restart_under_a_debugger():
    lines = _run_entry_point(prelude="sys.settrace(lambda *args: None)\n")
    assert len([line for line in lines if line.startswith("pid")]) == 1
    assert lines[-1] == "tunables None"
