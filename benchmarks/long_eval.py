"""Peak memory and time of evaluating one long sequence: blockwise vs dense attention.

The synthetic model (configs/synthetic_cpu.py: d_model 128, 4 heads, 3
layers, mlp 2, float32) evaluates one synthetic sequence at each length
through the trainer's jitted eval step (forward pass, cross-entropy and
accuracy). Each (kernel, length) runs in a fresh subprocess, so that its peak
resident memory is its own: the parent reads the child's ru_maxrss with
os.wait4. The child reports the resident memory with the model ready (before
compiling), the compile time and the time of one evaluation.

    python benchmarks/long_eval.py
    python benchmarks/long_eval.py --method=rope --lengths=2048,8192 --block_size=256

'dense' is the kernel attention_impl='auto' picks below its thresholds
(jrope.attention.choose_kernel; einsum on CPU, xla elsewhere), asked for by
name: it forms the T x T logits of every head. Dense runs whose logit
matrices alone would exceed --max_dense_gb are skipped (at 32768 they would
need 16 GiB per layer).
docs/performance.md's yardstick: 8192 tokens in 8.0 s and 2.5 GB peak (PyTorch).
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from jrope.train import runtime  # noqa: E402  (after the path insert)

_METHOD = flags.DEFINE_string(
    "method", "jordan_exact_scaled", "Position encoding (any paper name)."
)
_LENGTHS = flags.DEFINE_list("lengths", ["2048", "8192", "32768"], "Sequence lengths to evaluate.")
_KERNELS = flags.DEFINE_list("kernels", ["blockwise", "dense"], "Attention kernels to compare.")
_BLOCK = flags.DEFINE_integer("block_size", 512, "Block length of blockwise attention.")
_MAX_DENSE_GB = flags.DEFINE_float(
    "max_dense_gb", 6.0, "Skip dense runs whose [N, T, T] float32 logits exceed this many GiB."
)
_TIMEOUT = flags.DEFINE_integer("timeout", 1800, "Seconds allowed per measurement.")
_CHILD = flags.DEFINE_string("child", None, "Internal: 'kernel:length' to measure in this process.")


def _measure(kernel: str, length: int) -> dict:
    """Runs in the child: compile and time one evaluation; returns its numbers."""
    import jax

    from configs import synthetic_cpu
    from jrope.train import setup
    from jrope.train.config import TrainConfig
    from jrope.train.evaluation import EvalStep
    from jrope.train.setup import set_up_run

    config = synthetic_cpu.get_config()
    config.pe.name = _METHOD.value
    # 'dense' names the single-origin kernel 'auto' takes below its thresholds, asked for by
    # name: 'auto' itself goes blockwise from model.blockwise_min_length on and wherever
    # model.max_damping could overflow one origin (8192 tokens at the default bound).
    dense = "einsum" if jax.default_backend() == "cpu" else "xla"
    config.model.attention_impl = "blockwise" if kernel == "blockwise" else dense
    config.model.block_size = _BLOCK.value
    config.mesh.data = 1
    cfg = TrainConfig.from_config_dict(config)
    run = set_up_run(cfg, devices=jax.devices()[:1])
    source, mesh = run.source, run.mesh
    # A fresh state's parameters (its optimizer moments are a few MB at this size).
    params = run.init_state()["params"]
    with jax.set_mesh(mesh):
        batch = next(source.eval_batches(length, 1, 1))
        batch = setup.global_batch(batch, cfg.mesh.rules, mesh)
        ready_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        eval_step = EvalStep(run)
        start = time.perf_counter()
        # Fresh parameters are within model.max_damping: the planned graphdef is the one to run.
        graphdef = run.layout.graphdef
        compiled = eval_step.for_length(length).lower(graphdef, params, batch).compile()
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, batch))  # graphdef is static
        eval_s = time.perf_counter() - start
    return {
        "ready_rss_kb": ready_rss,
        "compile_s": compile_s,
        "eval_s": eval_s,
    }


def _run_child(kernel: str, length: int) -> dict:
    """Measures in a fresh process; adds its peak RSS (os.wait4 rusage of that child alone)."""
    command = [
        sys.executable, os.path.abspath(__file__), f"--child={kernel}:{length}",
        f"--method={_METHOD.value}", f"--block_size={_BLOCK.value}",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, cwd=_REPO)
        timer = threading.Timer(_TIMEOUT.value, child.kill)
        timer.start()
        _, status, usage = os.wait4(child.pid, 0)
        timer.cancel()
        child.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if child.returncode:
        lines = stderr.strip().splitlines()
        reason = f"exit {child.returncode}: {lines[-1] if lines else 'no message (killed?)'}"
        return {"error": reason, "peak_rss_kb": usage.ru_maxrss}
    result = json.loads(stdout.strip().splitlines()[-1])
    result["peak_rss_kb"] = usage.ru_maxrss
    return result


def _dense_logits_gib(length: int) -> float:
    """float32 [N=4, T, T] logits of one layer, in GiB."""
    return 4 * length * length * 4 / 2**30


def _gib(kb: int) -> str:
    return f"{kb / 2**20:.2f}"


def main(argv):
    del argv
    if _CHILD.value:
        kernel, length = _CHILD.value.split(":")
        print(json.dumps(_measure(kernel, int(length))))
        return
    lengths = [int(x) for x in _LENGTHS.value]
    print(
        f"evaluate one sequence, synthetic model (d_model 128, 4 heads, 3 layers, float32), "
        f"{_METHOD.value}, blockwise block {_BLOCK.value}; one fresh process per row; "
        f"1-min load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        f"host allocator {runtime.host_allocator()}"
    )
    print("| kernel | length | peak RSS GiB | RSS model ready GiB | compile s | eval s |")
    print("|---|---|---|---|---|---|")
    for length in lengths:
        for kernel in _KERNELS.value:
            if kernel == "dense" and _dense_logits_gib(length) > _MAX_DENSE_GB.value:
                print(
                    f"| {kernel} | {length} | skipped: one layer's logits need "
                    f"{_dense_logits_gib(length):.0f} GiB | | | |"
                )
                continue
            r = _run_child(kernel, length)
            if "error" in r:
                print(
                    f"| {kernel} | {length} | {_gib(r['peak_rss_kb'])} | failed: {r['error']} | | |"
                )
                continue
            print(
                f"| {kernel} | {length} | {_gib(r['peak_rss_kb'])} | {_gib(r['ready_rss_kb'])} | "
                f"{r['compile_s']:.1f} | {r['eval_s']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
