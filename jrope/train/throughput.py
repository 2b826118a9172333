"""Tokens per second and model-FLOP utilisation (MFU) of the training loop, for its progress line.

MFU = model FLOPs of a step (jrope.train.flops, counted from the config) x
steps per second / the peak FLOP/s of the devices. The peak is the
manufacturer's published dense (no sparsity) matmul throughput per JAX
device, looked up by `device.device_kind`; a device kind not in PEAK_FLOPS
(any CPU among them: its peak depends on the core count, the vector units
and the clock) gets no MFU, only tokens per second.

Which peak applies depends on the compute dtype (model.compute_dtype):
bfloat16 uses the bfloat16 peak. float32 matmuls run, at XLA's default
precision, as bfloat16 passes on TPUs (which publish no float32 peak: the
bfloat16 one is the ceiling) and on TF32 tensor cores on NVIDIA GPUs since
Ampere (the TF32 peak); V100s, without either, run them at their float32
rate.

JAX devices are TensorCores: two per chip on TPU v2 and v3 (half the chip's
peak each), one per chip from v4 on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax

from jrope.train.config import TrainConfig
from jrope.train.flops import model_flops_per_step

_T = 1e12
# device_kind -> (bfloat16 peak, float32 peak at XLA's default precision), FLOP/s per device.
PEAK_FLOPS = {
    "TPU v2": (22.5 * _T, 22.5 * _T),  # 45 TFLOP/s per chip, 2 devices per chip
    "TPU v3": (61.5 * _T, 61.5 * _T),  # 123 per chip, 2 devices per chip
    "TPU v4": (275 * _T, 275 * _T),
    "TPU v5 lite": (197 * _T, 197 * _T),  # v5e
    "TPU v5": (459 * _T, 459 * _T),  # v5p
    "TPU v5p": (459 * _T, 459 * _T),
    "TPU v6 lite": (918 * _T, 918 * _T),  # v6e (Trillium)
    "Tesla V100-SXM2-16GB": (None, 15.7 * _T),  # no bfloat16, no TF32
    "Tesla V100-SXM2-32GB": (None, 15.7 * _T),
    "Tesla V100-PCIE-16GB": (None, 14 * _T),
    "Tesla V100-PCIE-32GB": (None, 14 * _T),
    "NVIDIA A100-SXM4-40GB": (312 * _T, 156 * _T),  # float32: TF32
    "NVIDIA A100-SXM4-80GB": (312 * _T, 156 * _T),
    "NVIDIA A100-PCIE-40GB": (312 * _T, 156 * _T),
    "NVIDIA A100 80GB PCIe": (312 * _T, 156 * _T),
    "NVIDIA L4": (121 * _T, 60 * _T),
    "NVIDIA H100 80GB HBM3": (989.4 * _T, 494.7 * _T),  # SXM
    "NVIDIA H100 PCIe": (756.5 * _T, 378 * _T),
    "NVIDIA H200": (989.4 * _T, 494.7 * _T),  # SXM: the H100 SXM's compute
}


def peak_flops_per_sec(devices: Sequence[jax.Device], compute_dtype: str) -> float | None:
    """The summed peak of `devices` for `compute_dtype` matmuls; None when any is unknown."""
    column = 0 if compute_dtype == "bfloat16" else 1
    peaks = [PEAK_FLOPS.get(device.device_kind, (None, None))[column] for device in devices]
    return None if None in peaks else sum(peaks)


@dataclasses.dataclass(frozen=True)
class Throughput:
    """What turns a step rate into tokens/s and MFU.

    tokens_per_step: global batch x training length.
    model_flops_per_step: jrope.train.flops' count for the config.
    peak_flops_per_sec: all devices together; None when unknown (no MFU).
    """

    tokens_per_step: int
    model_flops_per_step: float
    peak_flops_per_sec: float | None

    @classmethod
    def for_run(
        cls, cfg: TrainConfig, io: dict[str, int | None], devices: Sequence[jax.Device]
    ) -> Throughput:
        """io: the model's input and output sizes (jrope.train.state.model_io)."""
        return cls(
            tokens_per_step=cfg.batch_size * cfg.pe.train_context,
            model_flops_per_step=model_flops_per_step(cfg, **io)["total"],
            peak_flops_per_sec=peak_flops_per_sec(devices, cfg.model.compute_dtype),
        )

    def rates(self, steps_per_sec: float) -> dict[str, float]:
        """{'tokens_per_sec': ..., and 'mfu' (a fraction) when the peak is known}."""
        rates = {"tokens_per_sec": steps_per_sec * self.tokens_per_step}
        if self.peak_flops_per_sec:
            rates["mfu"] = steps_per_sec * self.model_flops_per_step / self.peak_flops_per_sec
        return rates
