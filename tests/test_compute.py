"""Device rooflines: peaks, validation, the V100 calibration."""

import numpy as np
import pytest

import jaxcomm
from jaxcomm._src.audit import ComputeCost
from jaxcomm._src.compute import DEVICES, get_device, roofline


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


def test_every_device_has_the_figures_and_a_source():
    assert {"v100", "a100", "h100"} <= set(DEVICES)
    for dev in DEVICES.values():
        assert dev.matrix_flops["fp32"] > 5e12 and dev.memory_bandwidth > 3e11 and dev.source
        assert dev.vector_flops <= max(dev.matrix_flops.values())


def test_bad_input_is_named():
    with pytest.raises(
        ValueError,
        match="unknown device 'tpu'; known devices: v100, a100, h100, h200, rtx2080ti, a6000, t4",
    ):
        get_device("tpu")
    with pytest.raises(ValueError, match=r"mfu must be in \(0, 1\], got 1.5"):
        roofline("h100", mfu=1.5)
    with pytest.raises(ValueError, match=r"efficiency must be in \(0, 1\], got 0"):
        roofline("h100", efficiency=0)
    with pytest.raises(ValueError, match="dtype 'bf16' has no peak on v100"):
        roofline("v100", dtype="bf16")
    assert jaxcomm.compute.roofline("v100").mfu == pytest.approx(0.605)


def test_v100_calibration_reproduces_the_papers_forward_from_the_compiled_program():
    # The AQ-SGD paper: 44 ms for a forward over 6 GPT2-XL layers, micro-batch 1, sequence
    # 1024, on a V100 in FP32. The calibration used a hand count of the matrix flops; here
    # the compiled forward's own flops and memory bytes go through the roofline.
    import jax
    import jax.numpy as jnp

    from models import Block, GPTConfig

    cfg = GPTConfig(vocab_size=50257, seq_len=1024, num_layers=6, width=1600, num_heads=25)
    h = jax.ShapeDtypeStruct((1, 1024, 1600), jnp.float32)
    one = jax.eval_shape(
        lambda k: Block(cfg).init(k, jnp.zeros(h.shape))["params"], jax.random.key(0)
    )
    stacked = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((6, *a.shape), a.dtype), one)

    def forward(params, x):
        step = lambda x, p: (Block(cfg).apply({"params": p}, x), None)  # noqa: E731
        return jax.lax.scan(step, x, params)[0]

    compiled = jax.jit(forward).lower(stacked, h).compile()
    seconds = roofline("v100").seconds(jaxcomm.audit.program_cost(compiled).per_device())[0]
    assert seconds == pytest.approx(0.044, rel=0.03)
