"""Host memory on transparent huge pages for the command-line entry points.

XLA:CPU allocates each execution's scratch buffer afresh (172 MiB for the
synthetic CPU train step) and glibc hands such large blocks back to the
kernel when they are freed, so every step maps its scratch again in 4 KiB
pages: 44 thousand page faults per step. glibc (2.35 and later) can back
large allocations with transparent huge pages instead
(`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`): about 500 faults per step, and
the synthetic RoPE train step took 0.7 to 0.8x the time
(benchmarks/train_step.py; README, Performance). glibc reads the setting
only when a process starts, so the entry points (train.py, eval.py,
jrope.compare, the benchmarks) call `restart_with_huge_pages()` first: the
process replaces itself once, same arguments and process id, with the
setting added.

It was measured on CPU only, where XLA's scratch lives in host memory; on
TPU and GPU hosts the steps' memory is the device's. So the restart happens
only for runs on the CPU backend: JAX_PLATFORMS names cpu first, or no
accelerator backend (libtpu, a CUDA or ROCm plugin) is installed.
JROPE_HUGE_PAGES=1 asks for it anyway, JROPE_HUGE_PAGES=0 never.

Nothing happens off Linux, with another C library or glibc older than 2.35,
when transparent huge pages are off ('never'), when GLIBC_TUNABLES already
sets the option, or while a debugger is attached (a restart would leave it
behind).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
# '0': never restart; '1': restart on any backend; unset: on the CPU backend only.
OPT_OUT = "JROPE_HUGE_PAGES"
_THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_MIN_GLIBC = (2, 35)


def environment_with_huge_pages(
    environ: Mapping[str, str],
    glibc_version: tuple[int, int] | None,
    thp_mode: str | None,
    *,
    cpu_run: bool,
) -> dict[str, str] | None:
    """The environment to restart with, or None when no restart is wanted.

    glibc_version: (major, minor), None for another C library; thp_mode: the
    selected transparent huge page mode ('always', 'madvise', 'never'), None
    when the kernel has none; cpu_run: JAX will run on its CPU backend.
    """
    choice = environ.get(OPT_OUT, "")
    if choice == "0" or (choice != "1" and not cpu_run):
        return None
    if glibc_version is None or glibc_version < _MIN_GLIBC or thp_mode in (None, "never"):
        return None
    tunables = environ.get("GLIBC_TUNABLES", "")
    if TUNABLE in tunables:
        return None
    updated = dict(environ)
    updated["GLIBC_TUNABLES"] = f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"
    return updated


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def _thp_mode() -> str | None:
    """The bracketed choice of the kernel's mode file, e.g. 'always [madvise] never' -> 'madvise'."""
    try:
        with open(_THP_MODE_FILE) as mode_file:
            text = mode_file.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def runs_on_cpu(environ: Mapping[str, str]) -> bool:
    """Whether JAX will pick its CPU backend, found out without starting JAX.

    JAX_PLATFORMS decides when set (its first entry); otherwise JAX takes an
    accelerator whenever one of its backends is installed.
    """
    platforms = environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not _accelerator_backend_installed()


def _accelerator_backend_installed() -> bool:
    """libtpu (jax[tpu]) or a PJRT plugin (jax[cuda12], ROCm) is importable."""
    if importlib.util.find_spec("libtpu") is not None:
        return True
    if importlib.metadata.entry_points(group="jax_plugins"):
        return True
    plugins = importlib.util.find_spec("jax_plugins")
    return plugins is not None and any(pkgutil.iter_modules(plugins.submodule_search_locations))


def _debugger_attached() -> bool:
    """A tracing debugger (pdb, an IDE's) is attached; an exec would drop it."""
    if sys.gettrace() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+ debuggers
    return monitoring is not None and monitoring.get_tool(monitoring.DEBUGGER_ID) is not None


def restart_with_huge_pages() -> None:
    """Replaces this process by itself with glibc's huge-page option set, when it helps.

    Call it first in a command-line entry point: the command line (sys.orig_argv,
    so `python -m` keeps working) is run again; never returns when it restarts.
    """
    if not sys.platform.startswith("linux") or _debugger_attached():
        return
    environ = environment_with_huge_pages(
        os.environ, _glibc_version(), _thp_mode(), cpu_run=runs_on_cpu(os.environ)
    )
    if environ is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def requested() -> bool:
    """Whether this process started with glibc's huge-page option (benchmarks report it)."""
    return f"{TUNABLE}=1" in os.environ.get("GLIBC_TUNABLES", "")
