"""Device compute models: what a step's flops and memory bytes take on a named accelerator.

A :class:`Roofline` turns a :class:`~jaxcomm.audit.ComputeCost` (read from the compiled step
by :func:`jaxcomm.audit.program_cost`) into seconds on a device from :data:`DEVICES`::

    time = max(matmul_flops / (peak[dtype] * mfu) + other_flops / (vector_peak * mfu),
               hbm_bytes / (bandwidth * efficiency))

Matrix products run at the dtype's matrix-unit peak (tensor cores); the other flops
(elementwise, reductions) at the plain vector peak. ``mfu`` is the share of peak that
training kernels reach and ``efficiency`` the share of memory bandwidth; both default to
figures stated below, and ``mfu`` to a device's calibrated value where one is recorded.

Defaults and why:

- ``efficiency = 0.8``: streaming kernels reach about 80-90% of HBM peak on these parts.
- ``mfu = 0.5``: large transformer training reaches 40-55% of the matrix-unit peak in
  well-tuned frameworks; used where no calibration exists.
- ``v100`` ``fp32``: ``mfu = 0.60``, calibrated on the AQ-SGD paper's figure of 44 ms for a
  forward pass over 6 GPT2-XL layers (micro-batch 1, sequence 1024, FP32): 417.7 GFLOP of
  matrix products (per token and layer 2 x 12 x 1600^2 for the weights and 4 x 1024 x 1600
  for attention; x 1024 tokens x 6 layers) in 44 ms is 9.49 TFLOP/s, 0.605 of 15.7.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from jaxcomm._src._checks import did_you_mean
from jaxcomm._src.audit import ComputeCost

__all__ = ["DEVICES", "DeviceSpec", "Roofline", "get_device", "roofline"]


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """An accelerator's peaks.

    Attributes:
      name: short name (``v100``, ...).
      description: the exact part.
      matrix_flops: ``{dtype: FLOP/s}`` dense matrix-unit peak per input dtype (``fp32`` is
        the plain FP32 rate on parts whose tensor cores do not take FP32).
      vector_flops: FP32 FLOP/s of the non-matrix units.
      memory_bandwidth: HBM bytes/s.
      calibrated_mfu: ``{dtype: mfu}`` measured against a published step time.
      source: where the figures come from.
    """

    name: str
    description: str
    matrix_flops: Mapping[str, float]
    vector_flops: float
    memory_bandwidth: float
    calibrated_mfu: Mapping[str, float]
    source: str


T = 1e12
# Dense matrix-unit peaks of the Hopper SXM parts (H100 and H200 share the compute die).
_HOPPER_SXM = {"fp32": 67.0 * T, "tf32": 494.5 * T, "bf16": 989.5 * T, "fp16": 989.5 * T,
               "fp8": 1979.0 * T}  # fmt: skip
DEVICES: dict[str, DeviceSpec] = {
    "v100": DeviceSpec(
        name="v100",
        description="NVIDIA Tesla V100 SXM2 (16/32 GB HBM2)",
        matrix_flops={"fp32": 15.7 * T, "fp16": 125.0 * T},
        vector_flops=15.7 * T,
        memory_bandwidth=900e9,
        calibrated_mfu={"fp32": 0.605},
        source="NVIDIA Tesla V100 GPU datasheet: FP32 15.7 TFLOPS, Tensor 125 TFLOPS, "
        "HBM2 900 GB/s (SXM2)",
    ),
    "a100": DeviceSpec(
        name="a100",
        description="NVIDIA A100 SXM4 80 GB",
        matrix_flops={"fp32": 19.5 * T, "tf32": 156.0 * T, "bf16": 312.0 * T, "fp16": 312.0 * T},
        vector_flops=19.5 * T,
        memory_bandwidth=2039e9,
        calibrated_mfu={},
        source="NVIDIA A100 Tensor Core GPU datasheet: FP32 19.5, TF32 156, BF16/FP16 312 "
        "TFLOPS dense; HBM2e 2,039 GB/s (80 GB SXM)",
    ),
    "h100": DeviceSpec(
        name="h100",
        description="NVIDIA H100 SXM5 80 GB",
        matrix_flops=_HOPPER_SXM,
        vector_flops=67.0 * T,
        memory_bandwidth=3.35e12,
        calibrated_mfu={},
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM): FP32 67, TF32 989, BF16/FP16 "
        "1,979, FP8 3,958 TFLOPS with sparsity, half that dense; HBM3 3.35 TB/s",
    ),
    "h200": DeviceSpec(
        name="h200",
        description="NVIDIA H200 SXM 141 GB",
        matrix_flops=_HOPPER_SXM,
        vector_flops=67.0 * T,
        memory_bandwidth=4.8e12,
        calibrated_mfu={},
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM): FP32 67, TF32 989, BF16/FP16 "
        "1,979, FP8 3,958 TFLOPS with sparsity, half that dense; HBM3e 4.8 TB/s",
    ),
    "rtx2080ti": DeviceSpec(
        name="rtx2080ti",
        description="NVIDIA GeForce RTX 2080 Ti (11 GB GDDR6), reference clocks",
        matrix_flops={"fp32": 13.4 * T},
        vector_flops=13.4 * T,
        memory_bandwidth=616e9,
        calibrated_mfu={},
        source="NVIDIA Turing GPU Architecture whitepaper (2018), GeForce RTX 2080 Ti "
        "reference: 13.4 TFLOPS FP32 peak (4,352 cores at 1,545 MHz boost), 616 GB/s GDDR6",
    ),
    "a6000": DeviceSpec(
        name="a6000",
        description="NVIDIA RTX A6000 (48 GB GDDR6)",
        matrix_flops={"fp32": 38.7 * T},
        vector_flops=38.7 * T,
        memory_bandwidth=768e9,
        calibrated_mfu={},
        source="NVIDIA RTX A6000 datasheet: single-precision 38.7 TFLOPS, GDDR6 768 GB/s",
    ),
    "t4": DeviceSpec(
        name="t4",
        description="NVIDIA T4 (16 GB GDDR6, 70 W)",
        matrix_flops={"fp32": 8.1 * T, "fp16": 65.0 * T},
        vector_flops=8.1 * T,
        memory_bandwidth=320e9,
        calibrated_mfu={},
        source="NVIDIA T4 Tensor Core GPU datasheet: FP32 8.1 TFLOPS, mixed FP16/FP32 65 "
        "TFLOPS; GDDR6 320 GB/s",
    ),
}


def get_device(name: str) -> DeviceSpec:
    """The :class:`DeviceSpec` called ``name`` (case-insensitive)."""
    if not isinstance(name, str) or name.lower() not in DEVICES:
        raise ValueError(
            f"unknown device {name!r}; known devices: {', '.join(DEVICES)}"
            + did_you_mean(name, DEVICES)
        )
    return DEVICES[name.lower()]


def _share(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in (0, 1], got {value!r}")
    if not (math.isfinite(value) and 0.0 < value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class Roofline:
    """Step time of a :class:`ComputeCost` on ``device`` (see the module docstring).

    Attributes:
      device: a :class:`DeviceSpec`.
      dtype: the matrix-unit input dtype, a key of ``device.matrix_flops``.
      mfu: share of the matrix and vector peaks reached, in (0, 1].
      efficiency: share of the memory bandwidth reached, in (0, 1].
    """

    device: DeviceSpec
    dtype: str
    mfu: float
    efficiency: float

    def __post_init__(self) -> None:
        if self.dtype not in self.device.matrix_flops:
            raise ValueError(
                f"dtype {self.dtype!r} has no peak on {self.device.name}; known: "
                f"{', '.join(self.device.matrix_flops)}"
            )
        _share("mfu", self.mfu)
        _share("efficiency", self.efficiency)

    def compute_seconds(self, cost: ComputeCost) -> np.ndarray:
        """``float64[D]``: time of the flops alone."""
        matrix = self.device.matrix_flops[self.dtype] * self.mfu
        vector = self.device.vector_flops * self.mfu
        return cost.matmul_flops / matrix + (cost.flops - cost.matmul_flops) / vector

    def memory_seconds(self, cost: ComputeCost) -> np.ndarray:
        """``float64[D]``: time of the memory traffic alone."""
        return cost.hbm_bytes / (self.device.memory_bandwidth * self.efficiency)

    def seconds(self, cost: ComputeCost) -> np.ndarray:
        """``float64[D]``: the roofline step time per device, in seconds."""
        return np.maximum(self.compute_seconds(cost), self.memory_seconds(cost))


def roofline(
    device: str, *, dtype: str = "fp32", mfu: float | None = None, efficiency: float = 0.8
) -> Roofline:
    """A :class:`Roofline` for the device called ``device``; ``mfu=None`` takes the device's
    calibrated value for ``dtype``, else 0.5."""
    dev = get_device(device)
    if mfu is None:
        mfu = dev.calibrated_mfu.get(dtype, 0.5)
    return Roofline(dev, dtype, mfu, efficiency)
