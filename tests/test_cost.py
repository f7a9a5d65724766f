"""Compute cost read from compiled programs: loops by trip count, the GPT step against the
analytic transformer count, conditionals, memory bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxcomm
from train.config import Config
from train.trainer import Trainer


def _matmul_scan(n):
    def f(x, w):
        def body(c, _):
            return jnp.tanh(c @ w), None

        return lax.scan(body, x, None, length=n)[0].sum()

    x, w = jnp.ones((64, 128)), jnp.ones((128, 128))
    return jax.jit(f).lower(x, w).compile()


def test_k_loop_steps_cost_k_times_one():
    one = jaxcomm.audit.program_cost(_matmul_scan(1)).per_device()
    ten = jaxcomm.audit.program_cost(_matmul_scan(10)).per_device()
    assert one.matmul_flops[0] == 2 * 64 * 128 * 128
    assert ten.matmul_flops[0] == 10 * one.matmul_flops[0]
    assert ten.transcendentals[0] == 10 * one.transcendentals[0] == 10 * 64 * 128
    np.testing.assert_allclose(ten.flops, 10 * one.flops, rtol=0.01)


def test_gpt_step_matches_the_analytic_count(tmp_path):
    """Per device: 6 flops per matmul parameter per token, plus attention's two T x T
    products (4 T W per token and layer forward, three times that with the backward)."""
    layers, width, seq, batch = 2, 128, 64, 16
    cfg = Config(
        name="cost",
        task="gpt",
        model={"num_layers": layers, "width": width, "num_heads": 4, "seq_len": seq},
        workers=8,
        global_batch=batch,
        steps=1,
        progress=False,
        checkpoint_every=0,
        out_dir=str(tmp_path),
    )
    trainer = Trainer(cfg)
    cost = jaxcomm.audit.program_cost(trainer.layout.compiled_step(trainer.ctx)).per_device()
    leaves = jax.tree_util.tree_flatten_with_path(trainer.worker_params(0))[0]
    matmul_params = sum(v.size for k, v in leaves if "kernel" in jax.tree_util.keystr(k))
    tokens = batch // 8 * seq
    analytic = 6 * matmul_params * tokens + 12 * layers * seq * width * tokens
    np.testing.assert_allclose(cost.matmul_flops, analytic, rtol=0.10)
    assert (cost.flops >= cost.matmul_flops).all()
    # Parameters, gradients and optimizer state are read and written at least once.
    assert (cost.hbm_bytes > 4 * 3 * matmul_params).all()


def test_conditionals_take_the_costliest_branch_unless_told():
    def f(x, w, p):
        return lax.cond(p > 0, lambda: (x @ w).sum(), lambda: x.sum())

    x, w = jnp.ones((32, 64)), jnp.ones((64, 64))
    cost = jaxcomm.audit.program_cost(jax.jit(f).lower(x, w, 1.0).compile())
    (cond,) = cost.conditionals
    dot = 2 * 32 * 64 * 64
    assert cost.per_device().matmul_flops[0] == dot
    assert cost.per_device({cond: 1}).matmul_flops[0] == dot
    assert cost.per_device({cond: 0}).matmul_flops[0] == 0


def test_unknown_trip_count_is_an_error_naming_the_loop():
    def f(x, w):
        return lax.while_loop(lambda c: c.sum() < 1e6, lambda c: jnp.tanh(c @ w) + 1.0, x)

    x, w = jnp.ones((8, 8)), jnp.ones((8, 8))
    cost = jaxcomm.audit.program_cost(jax.jit(f).lower(x, w).compile())
    with pytest.raises(ValueError, match=r"runs in the loop .*while.*trip count"):
        cost.per_device()


@pytest.mark.parametrize("n", [10, 100])
def test_memory_bytes_are_linear_in_scan_length(n):
    """A scan writing one row of a stacked output per step is charged the row, not the
    whole stack (an in-place update), so its bytes grow linearly with its length."""

    def f(x):
        def body(c, _):
            c = jnp.sin(c) * 2.0
            return c, c

        return lax.scan(body, x, None, length=n)[1]

    x = jnp.ones((1000,))
    mem = jaxcomm.audit.program_cost(jax.jit(f).lower(x).compile()).per_device().hbm_bytes[0]
    row = 4 * 1000
    assert 2 * n * row <= mem <= 12 * n * row  # a whole-stack copy per step: ~n / 2 rows


def test_elementwise_bytes_are_read_plus_write():
    x = jnp.ones((1 << 20,))
    cost = jaxcomm.audit.program_cost(jax.jit(lambda x: x * 2.0 + 1.0).lower(x).compile())
    got = cost.per_device()
    assert got.hbm_bytes[0] == 2 * 4 * (1 << 20)
    assert got.flops[0] == 2 * (1 << 20)


def test_a_fused_slice_reads_only_its_slice_even_after_elementwise_ops():
    # One flat buffer scaled and cut into 64 parameter-shaped pieces (an optimizer update
    # after an all-reduce of the fused gradient): each fusion reads its own slice of the
    # buffer, not the whole buffer.
    n = 4096
    params = [jnp.ones((64, 64)) for _ in range(64)]

    def update(flat, ps):
        g = flat * 0.125
        return [p - 0.1 * g[i * n : (i + 1) * n].reshape(p.shape) for i, p in enumerate(ps)]

    compiled = jax.jit(update).lower(jnp.ones(64 * n), params).compile()
    got = jaxcomm.audit.program_cost(compiled).per_device().hbm_bytes[0]
    assert got == pytest.approx(3 * 64 * n * 4, rel=0.02)  # read flat, read params, write

    # The same through a padded buffer cut back to size first (a ring's segments joined).
    def padded(buf, ps):
        return update(buf[: 64 * n] * 2.0, ps)

    compiled = jax.jit(padded).lower(jnp.ones(64 * n + 1000), params).compile()
    got = jaxcomm.audit.program_cost(compiled).per_device().hbm_bytes[0]
    assert got == pytest.approx(3 * 64 * n * 4, rel=0.02)


def test_a_strided_convolutions_input_gradient_costs_what_its_forward_does():
    x, w = jnp.ones((8, 32, 32, 16)), jnp.ones((3, 3, 16, 32))

    def fwd(x, w):
        return lax.conv_general_dilated(
            x, w, (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def dx(x, w):
        return jax.vjp(lambda x: fwd(x, w), x)[1](jnp.ones((8, 16, 16, 32)))[0]

    flops = [
        jaxcomm.audit.program_cost(jax.jit(f).lower(x, w).compile()).per_device().matmul_flops[0]
        for f in (fwd, dx)
    ]
    assert flops[0] == 2 * 8 * 16 * 16 * 32 * 3 * 3 * 16  # every output: a 3x3x16 window
    assert flops[1] == flops[0]  # the same products, not those with the inserted zeros


# A GPU program as XLA writes it (by hand: cuBLAS gemm, a cuBLASLt matmul, cuDNN forward and
# backward-input convolutions, each with its workspace in a tuple result), and a custom
# call nothing can cost.
_GPU_HLO = """HloModule gpu_step, num_partitions=1

ENTRY %main (x: f32[128,512], w: f32[512,256], img: f32[8,32,32,3], k: f32[3,3,3,64], \
dy: f32[8,16,16,64], b: f32[4,64,32], c: f32[4,32,16]) -> f32[128,256] {
  %x = f32[128,512]{1,0} parameter(0)
  %w = f32[512,256]{1,0} parameter(1)
  %img = f32[8,32,32,3]{3,2,1,0} parameter(2)
  %k = f32[3,3,3,64]{3,2,1,0} parameter(3)
  %dy = f32[8,16,16,64]{3,2,1,0} parameter(4)
  %b = f32[4,64,32]{2,1,0} parameter(5)
  %c = f32[4,32,16]{2,1,0} parameter(6)
  %gemm = (f32[128,256]{1,0}, s8[4194304]{0}) custom-call(f32[128,512]{1,0} %x, \
f32[512,256]{1,0} %w), custom_call_target="__cublas$gemm", \
backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{\
"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],\
"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %lt = (f32[4,64,16]{2,1,0}, s8[1024]{0}) custom-call(f32[4,64,32]{2,1,0} %b, \
f32[4,32,16]{2,1,0} %c), custom_call_target="__cublas$lt$matmul", backend_config={\
"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],\
"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]}}}
  %conv = (f32[8,32,32,64]{3,2,1,0}, u8[0]{0}) custom-call(f32[8,32,32,3]{3,2,1,0} %img, \
f32[3,3,3,64]{3,2,1,0} %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, \
custom_call_target="__cudnn$convForward", backend_config={"conv_result_scale":1}
  %dx = (f32[8,32,32,3]{3,2,1,0}, u8[0]{0}) custom-call(f32[8,16,16,64]{3,2,1,0} %dy, \
f32[3,3,3,64]{3,2,1,0} %k), window={size=3x3 stride=2x2 pad=0_1x0_1}, \
dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convBackwardInput"
  %dw = (f32[3,3,3,64]{3,2,1,0}, u8[0]{0}) custom-call(f32[8,32,32,3]{3,2,1,0} %img, \
f32[8,16,16,64]{3,2,1,0} %dy), window={size=3x3 stride=2x2 pad=0_1x0_1}, \
dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convBackwardFilter"
  %mystery = f32[128]{0} custom-call(f32[128,512]{1,0} %x), custom_call_target="my$kernel"
  ROOT %out = f32[128,256]{1,0} get-tuple-element(%gemm), index=0
}
"""


def test_gpu_library_calls_are_costed_from_their_shapes():
    """cuBLAS/cuBLASLt gemms count 2 M N K (batched: per batch); each cuDNN convolution call
    counts its forward convolution's products (a stride-2 3x3 convolution of 3 into 64
    features: its input and filter gradients cost what its forward does); a custom call
    nothing can cost is listed in ``uncounted``."""
    cost = jaxcomm.audit.program_cost(_GPU_HLO)
    gemm = 2 * 128 * 256 * 512
    batched = 2 * (4 * 64 * 16) * 32
    conv = 2 * (8 * 32 * 32 * 64) * (3 * 3 * 3)
    strided = 2 * (8 * 16 * 16 * 64) * (3 * 3 * 3)  # forward of the stride-2 convolution
    per = cost.per_device()
    assert per.matmul_flops[0] == gemm + batched + conv + strided + strided
    assert cost.uncounted == ("mystery (my$kernel)",)


def test_the_trainer_warns_of_uncounted_custom_calls():
    from train.programs import costed

    with pytest.warns(UserWarning, match=r"1 custom call.*my\$kernel.*flops are missing"):
        costed(_GPU_HLO)


def test_cpu_top_k_is_costed_as_a_partial_sort():
    """``lax.top_k`` compiles to the CPU's ``TopK`` custom call: ``n log2 k`` comparisons,
    nothing left uncounted."""
    x = jnp.zeros(4096)
    compiled = jax.jit(lambda v: lax.top_k(v, 64)[1]).lower(x).compile()
    cost = jaxcomm.audit.program_cost(compiled)
    if "TopK" not in compiled.as_text():
        pytest.skip("this backend does not compile top_k to a TopK custom call")
    assert cost.uncounted == ()
    assert cost.per_device().flops[0] >= 4096 * 6
