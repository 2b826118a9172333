"""The CPU train step under three host allocators, timed side by side.

XLA:CPU allocates each step's scratch afresh. glibc's default malloc returns
large blocks to the kernel on free, so every step faults them in again in
4 KiB pages; glibc's huge-page tunable or TCMalloc (which keeps freed memory)
avoid that. An allocator is chosen when a process starts, so each round runs
`benchmarks/train_step.py` once per allocator, in turn, as its own process
(compiled afresh each time; only the timed steps count), and reports the
median over rounds of each allocator's step time over the default's in the
same round:

    python benchmarks/host_allocator.py
    python benchmarks/host_allocator.py --rounds=5 --methods=rope,jordan_rope

  default   glibc malloc as the process starts
  hugetlb   GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (glibc 2.35 or later)
  tcmalloc  LD_PRELOAD=libtcmalloc_minimal.so.4 (Debian/Ubuntu:
            apt install libtcmalloc-minimal4); skipped if not installed
"""

import ctypes.util
import os
import re
import statistics
import subprocess
import sys

from absl import app, flags

_METHODS = flags.DEFINE_list("methods", ["rope", "jordan_rope"], "Encodings to time.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds of one process per allocator.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per method in each process.")

TRAIN_STEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_step.py")
# A row of train_step.py's table: "| rope | 186.3 | 5.37 | ... | 473 |"
ROW = re.compile(r"^\| (\w+) \| ([\d.]+) \|.*\| ([\d,]+) \|$", re.MULTILINE)


def allocators() -> dict[str, dict[str, str]]:
    """Each allocator's additions to the environment; TCMalloc only where it is installed."""
    found = {"default": {}, "hugetlb": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}}
    if tcmalloc := ctypes.util.find_library("tcmalloc_minimal"):
        found["tcmalloc"] = {"LD_PRELOAD": tcmalloc}
    return found


def time_steps(extra_env: dict[str, str]) -> dict[str, tuple[float, float]]:
    """{method: (ms per step, page faults per step)} from one train_step.py process."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    methods = ",".join(_METHODS.value)
    args = [sys.executable, TRAIN_STEP, f"--methods={methods}", "--rounds=1"]
    done = subprocess.run(
        [*args, f"--steps={_STEPS.value}"],
        env=env | extra_env,
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {m: (float(ms), float(f.replace(",", ""))) for m, ms, f in ROW.findall(done.stdout)}
    return {method: rows[method] for method in _METHODS.value}


def main(argv):
    del argv
    kinds = allocators()
    samples = {kind: [] for kind in kinds}
    for _ in range(_ROUNDS.value):
        for kind, extra_env in kinds.items():
            samples[kind].append(time_steps(extra_env))
    print(
        f"train step of configs/synthetic_cpu.py on {os.cpu_count()} CPUs; median of "
        f"{_ROUNDS.value} rounds, one process per allocator and round, {_STEPS.value} steps each"
    )
    print("| allocator | method | ms/step | vs default in the same round | page faults/step |")
    print("|---|---|---|---|---|")
    for kind, rounds in samples.items():
        for method in _METHODS.value:
            ms = [r[method][0] for r in rounds]
            ratios = [a / b[method][0] for a, b in zip(ms, samples["default"], strict=True)]
            faults = statistics.median(r[method][1] for r in rounds)
            print(
                f"| {kind} | {method} | {statistics.median(ms):.1f} | "
                f"{statistics.median(ratios):.2f} | {faults:,.0f} |"
            )


if __name__ == "__main__":
    app.run(main)
