"""Device rooflines: peaks, validation, the V100 calibration."""

import numpy as np
import pytest

import jaxcomm
from jaxcomm.audit import ComputeCost
from jaxcomm.compute import DEVICES, get_device, roofline


def _cost(flops, matmul, hbm):
    return ComputeCost(
        flops=np.array([flops], float),
        matmul_flops=np.array([matmul], float),
        transcendentals=np.zeros(1),
        hbm_bytes=np.array([hbm], float),
    )


def test_roofline_takes_the_slower_of_compute_and_memory():
    r = roofline("a100", dtype="bf16", mfu=0.5, efficiency=1.0)
    # 312 TFLOP/s at half: 156e12 matmul flops take one second; memory 2,039 GB/s.
    compute_bound = _cost(156e12, 156e12, 1e9)
    np.testing.assert_allclose(r.seconds(compute_bound), 1.0)
    memory_bound = _cost(1e9, 1e9, 2039e9 * 3)
    np.testing.assert_allclose(r.seconds(memory_bound), 3.0)
    # Non-matrix flops run at the 19.5 TFLOP/s vector rate.
    np.testing.assert_allclose(r.seconds(_cost(9.75e12, 0.0, 0.0)), 1.0)


def test_v100_calibration_reproduces_the_papers_forward_time():
    """6 GPT2-XL layers, one 1024-token sequence, FP32: 44 ms in the AQ-SGD paper."""
    w, t, layers = 1600, 1024, 6
    flops = layers * t * (2 * 12 * w * w + 4 * t * w)
    seconds = roofline("v100").seconds(_cost(flops, flops, 0.0))
    np.testing.assert_allclose(seconds, 0.044, rtol=0.01)


def test_every_device_has_the_figures_and_a_source():
    assert {"v100", "a100", "h100"} <= set(DEVICES)
    for dev in DEVICES.values():
        assert dev.matrix_flops["fp32"] > 5e12 and dev.memory_bandwidth > 3e11 and dev.source
        assert dev.vector_flops <= max(dev.matrix_flops.values())


def test_bad_input_is_named():
    with pytest.raises(
        ValueError, match="unknown device 'tpu'; known devices: v100, a100, h100, t4"
    ):
        get_device("tpu")
    with pytest.raises(ValueError, match=r"mfu must be in \(0, 1\], got 1.5"):
        roofline("h100", mfu=1.5)
    with pytest.raises(ValueError, match=r"efficiency must be in \(0, 1\], got 0"):
        roofline("h100", efficiency=0)
    with pytest.raises(ValueError, match="dtype 'bf16' has no peak on v100"):
        roofline("v100", dtype="bf16")
    assert jaxcomm.compute.roofline("v100").mfu == pytest.approx(0.605)
