"""GPipe pipeline over a stage axis: equal to the unpipelined model, bytes, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.pipeline import Boundary, BoundaryState
from models import GPTConfig, build_task
from train.pipeline import gpt_pipeline_loss, stage_params

L, M, MB, T, W = 8, 3, 2, 16, 32
CFG = GPTConfig(num_layers=L, width=W, num_heads=2, seq_len=T)


def _setup():
    task = build_task("gpt", num_layers=L, width=W, num_heads=2, seq_len=T)
    tokens = jax.random.randint(jax.random.key(0), (M * MB, T + 1), 0, 256)
    params = task.init(jax.random.key(1, impl="rbg"), {"tokens": tokens})
    return task, tokens, params


def _run(num_stages, params, tokens, boundary=None):
    mesh = jax.make_mesh((num_stages,), ("stage",), devices=jax.devices()[:num_stages])
    loss_fn = gpt_pipeline_loss(CFG, boundary=boundary)
    act = (M, MB, T, W)

    def per_device(p, inputs):
        p = jax.tree_util.tree_map(lambda a: a[0], p)
        zeros, unseen = jnp.zeros(act), jnp.zeros((M, MB), bool)
        state = BoundaryState(zeros, zeros, unseen, unseen)
        (loss, (state, nbytes)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            p, inputs, state, jax.random.key(2)
        )
        per_dev = jax.tree_util.tree_map(lambda a: a[None], (grads, state))
        return loss, per_dev, jnp.int32(nbytes)

    f = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P("stage"), P()),
        out_specs=(P(), P("stage"), P()),
        check_vma=False,
    )
    sp = jax.device_put(stage_params(params, CFG, num_stages), NamedSharding(mesh, P("stage")))
    loss, (grads, state), nbytes = jax.jit(f)(sp, {"tokens": tokens.reshape(M, MB, T + 1)})
    return float(loss), jax.device_get(grads), jax.device_get(state), int(nbytes)


@pytest.mark.parametrize("num_stages", [2, 4, 8])
def test_fp32_pipeline_equals_unpipelined_model(num_stages):
    task, tokens, params = _setup()
    ref_loss, ref_grads = jax.value_and_grad(lambda p: task.loss(p, {"tokens": tokens})[0])(params)
    loss, grads, state, nbytes = _run(num_stages, params, tokens)
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    k = L // num_stages
    for s in range(num_stages):
        for j in range(k):
            got = jax.tree_util.tree_map(lambda a, s=s, j=j: a[s][j], grads["blocks"])
            for a, b in zip(
                jax.tree_util.tree_leaves(got),
                jax.tree_util.tree_leaves(ref_grads[f"block_{s * k + j}"]),
                strict=True,
            ):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for name, stage in (("embed", 0), ("head", num_stages - 1)):
        for a, b in zip(
            jax.tree_util.tree_leaves(grads[name]),
            jax.tree_util.tree_leaves(ref_grads[name]),
            strict=True,
        ):
            np.testing.assert_allclose(a[stage], b, rtol=1e-4, atol=1e-6)
    # Every microbatch's activation crosses each boundary once, in float32.
    assert nbytes == M * MB * T * W * 4
    # Both sides of each boundary hold the same messages, and every sample is now seen.
    for s in range(num_stages - 1):
        np.testing.assert_array_equal(state.prev_out[s], state.prev_in[s + 1])
        assert state.seen_out[s].all() and state.seen_in[s + 1].all()


def test_quantized_backward_changes_gradients_but_not_loss():
    _, tokens, params = _setup()
    fp32 = jaxcomm.pipeline.fp32_boundary()
    q = Boundary(encode=fp32.encode, decode=fp32.decode, bw_bits=4)
    loss_a, grads_a, _, _ = _run(4, params, tokens)
    loss_b, grads_b, _, _ = _run(4, params, tokens, boundary=q)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(grads_a["blocks"])])
    b = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(grads_b["blocks"])])
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert 0 < rel < 0.5  # quantized, yet close: the 4-bit gradient is unbiased noise


def test_stage_count_must_divide_layers():
    _, _, params = _setup()
    with pytest.raises(ValueError, match="num_stages must divide num_layers=8, got num_stages=3"):
        stage_params(params, CFG, 3)
