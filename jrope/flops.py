"""What a step costs the devices: a Transformer's model FLOPs per train step, the devices'
published dense matmul peaks, and the tokens/s and MFU of a step rate (Throughput), which the
trainer's progress line and the accelerator check divide the one by the other; and a compiled
program's peak memory against what one device holds."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import statistics
import time
from collections.abc import Sequence

import jax

from jrope.errors import UsageError
from jrope.model.config import ModelConfig

# device_kind -> (bfloat16 peak, float32 peak at XLA's default precision), published dense matmul
# FLOP/s per device: float32 runs as bfloat16 passes on TPUs, as TF32 on NVIDIA since Ampere.
_T = 1e12
PEAK_FLOPS = {
    "TPU v2": (22.5 * _T, 22.5 * _T),  # 45 TFLOP/s per chip, 2 devices per chip
    "TPU v3": (61.5 * _T, 61.5 * _T),  # 123 per chip, 2 devices per chip
    "TPU v4": (275 * _T, 275 * _T),
    "TPU v5 lite": (197 * _T, 197 * _T),  # v5e
    **dict.fromkeys(["TPU v5", "TPU v5p"], (459 * _T, 459 * _T)),
    "TPU v6 lite": (918 * _T, 918 * _T),  # v6e (Trillium)
    # V100s: no bfloat16, no TF32.
    **dict.fromkeys(["Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"], (None, 15.7 * _T)),
    **dict.fromkeys(["Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"], (None, 14 * _T)),
    **dict.fromkeys(
        ["NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100-PCIE-40GB"],
        (312 * _T, 156 * _T),
    ),
    "NVIDIA A100 80GB PCIe": (312 * _T, 156 * _T),
    "NVIDIA L4": (121 * _T, 60 * _T),
    # The H100 SXM, and the H200 with its compute.
    **dict.fromkeys(["NVIDIA H100 80GB HBM3", "NVIDIA H200"], (989.4 * _T, 494.7 * _T)),
    "NVIDIA H100 PCIe": (756.5 * _T, 378 * _T),
    "NVIDIA B200": (2250 * _T, 1100 * _T),  # HGX B200, dense: half the sparse figures published
}


def peak_flops_per_sec(devices: Sequence[jax.Device], compute_dtype: str) -> float | None:
    """The summed peak of `devices` for `compute_dtype` matmuls; None when any is unknown."""
    column = 0 if compute_dtype == "bfloat16" else 1
    peaks = [PEAK_FLOPS.get(device.device_kind, (None, None))[column] for device in devices]
    return None if None in peaks else sum(peaks)


def model_flops_per_step(
    model: ModelConfig,
    rows: int,
    length: int,
    vocab_size: int | None = None,
    *,
    input_channels: int | None = None,
    output_channels: int | None = None,
) -> dict[str, float]:
    """Model FLOPs of one train step of `rows` sequences of `length` through `model`'s
    Transformer: {'dense', 'attention', 'total'}.

    Matmuls only (standard MFU accounting), a multiply-add as 2 FLOPs, backward = 2 x forward.
    With B = rows, T = length, D = d_model, F = mlp_ratio D, a block whose Q queries are the last
    Q of T key positions does, forward:

      dense      2 B D^2 (Q + 2 T) + 2 B Q D^2 + 4 B Q D F  (q, k, v, out projections, MLP)
      attention  4 B D P  (scores, weighted values on P = Q T - Q (Q - 1) / 2 visible pairs)

    Q = T except in the last block under readout 'last' (Q = 1). The tied readout adds 2 B Q D V
    (the embedding is a gather); a signal model (input_channels, output_channels) has instead an
    input projection, 2 B T C_in D, and a regression head, 2 B Q D C_out. The sizes come from
    the data source (jrope.train.setup.model_io), which this count does not build.
    """
    signal = input_channels is not None
    b, t, d, v = rows, length, model.d_model, vocab_size
    f = model.mlp_ratio * d
    last_queries = 1 if model.readout == "last" else t
    dense = attention = 0
    for index in range(model.num_layers):
        q = last_queries if index == model.num_layers - 1 else t
        pairs = q * t - q * (q - 1) // 2
        dense += 2 * b * d * d * (q + 2 * t) + 2 * b * q * d * d + 4 * b * q * d * f
        attention += 4 * b * d * pairs
    if signal:
        dense += 2 * b * t * input_channels * d + 2 * b * last_queries * d * output_channels
    else:
        dense += 2 * b * last_queries * d * v  # tied readout on the last block's rows
    return {"dense": 3.0 * dense, "attention": 3.0 * attention, "total": 3.0 * (dense + attention)}


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a step rate into tokens/s and MFU (model FLOPs x steps/s / the peak)."""

    tokens_per_step: int  # global batch x training length
    model_flops_per_step: float  # model_flops_per_step(...)["total"]
    peak_flops_per_sec: float | None  # all devices together; None when unknown (no MFU)

    @classmethod
    def for_model(
        cls,
        model: ModelConfig,
        rows: int,
        length: int,
        devices: Sequence[jax.Device],
        **io: int | None,
    ) -> Throughput:
        """Train steps of `rows` x `length` tokens on `devices`; io: the model's vocab_size, or
        input_channels and output_channels (as model_flops_per_step takes them)."""
        total = model_flops_per_step(model, rows, length, **io)["total"]
        return cls(rows * length, total, peak_flops_per_sec(devices, model.compute_dtype))

    def rates(self, steps_per_sec: float) -> dict[str, float]:
        """{'tokens_per_sec': ..., and 'mfu' (a fraction) when the peak is known}."""
        rates = {"tokens_per_sec": steps_per_sec * self.tokens_per_step}
        if self.peak_flops_per_sec:
            rates["mfu"] = steps_per_sec * self.model_flops_per_step / self.peak_flops_per_sec
        return rates


def device_memory() -> tuple[int, str]:
    """(bytes one device may use, what they are): the accelerator's limit, or on CPU the host's
    memory, shared by all of its devices."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "device memory"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    devices = jax.local_device_count()
    return host // devices, "host memory" if devices == 1 else f"host memory's 1/{devices} share"


def peak_memory(compiled) -> int:
    """The compiler's peak memory of a compiled program on one device, in bytes: at least its
    buffers' sum (the CPU's peak counts only the arguments)."""
    stats = compiled.memory_analysis()
    buffers = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    buffers += stats.temp_size_in_bytes
    return int(max(getattr(stats, "peak_memory_in_bytes", 0), buffers))


def memory_shortfall(compiled, count: str = "XLA's count") -> str | None:
    """'needs X GiB of <memory> (<count>), which holds Y GiB' where the compiled program's peak
    on one device (or `compiled` bytes, so counted) exceeds what that device may use; else None."""
    limit, where = device_memory()
    needs = compiled if isinstance(compiled, int) else peak_memory(compiled)
    if needs > limit:
        return f"needs {needs / 2**30:.2f} GiB of {where} ({count}), which holds {limit / 2**30:.2f} GiB"
    return None


def require_memory(*compiled, what: str, fix: str) -> None:
    """UsageError '<what> needs X GiB ...; <fix>.' where a compiled program does not fit a device."""
    if shortfall := next(filter(None, map(memory_shortfall, compiled)), None):
        raise UsageError(f"{what} {shortfall}; {fix}.")


def median_seconds(call, repeats: int) -> float:
    """Median wall seconds of `repeats` calls after one warm-up (each call blocks on its result)."""
    jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
