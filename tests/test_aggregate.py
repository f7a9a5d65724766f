"""Dense aggregators: equal to pmean, and their CommLog holds the real payload bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.network import as_bytes

N = 8


def _apply(mesh, tx, grads):
    """Run ``tx.update`` per worker on stacked grads ``[N, ...]``; return updates and state."""

    def per_worker(g):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        state = tx.init(g)
        upd, state = tx.update(g, state, g)
        return jax.tree_util.tree_map(lambda a: a[None], (upd, state))

    f = jax.shard_map(per_worker, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    grads = jax.device_put(grads, NamedSharding(mesh, P("data")))
    return jax.jit(f)(grads)


@pytest.mark.parametrize("reduce", ["psum", "ring", "tree"])
def test_dense_allreduce_is_the_mean(mesh8, reduce):
    grads = {
        "w": jax.random.normal(jax.random.key(0), (N, 13, 7)),
        "b": jax.random.normal(jax.random.key(1), (N, 5)),
    }
    upd, state = _apply(mesh8, jaxcomm.dense_all_reduce("data", reduce=reduce), grads)
    for k in grads:
        expect = np.asarray(grads[k]).mean(0)
        for w in range(N):
            np.testing.assert_allclose(np.asarray(upd[k])[w], expect, rtol=1e-5, atol=1e-6)
    d = 13 * 7 + 5
    log = state.log
    kind = {"psum": "allreduce", "ring": "ring_allreduce", "tree": "tree_allreduce"}[reduce]
    i = jaxcomm.network.KINDS.index(kind)
    assert np.all(np.asarray(log.calls)[:, i] == 1)
    assert np.all(as_bytes(log.message_bytes)[:, i] == 4 * d)
    seg = -(-d // N)
    if reduce == "tree":
        # Reduce: every device but 0 sends once; broadcast: the root 3 times, device 1
        # twice (rounds 2 and 4), devices 2 and 3 once; 6 rounds of the whole message.
        sent = 4 * d * np.array([3, 1 + 2, 1 + 1, 1 + 1, 1, 1, 1, 1])
        rounds = 6
    else:
        sent = np.full(N, 2 * (N - 1) * seg * 4)
        rounds = 2 * (N - 1)
    np.testing.assert_array_equal(as_bytes(log.sent_bytes), sent)
    assert np.all(np.asarray(log.rounds)[:, i] == rounds)


def test_dense_allreduce_chains_with_optax(mesh8):
    tx = optax.chain(jaxcomm.dense_all_reduce("data", reduce="ring"), optax.sgd(0.5))
    grads = {"w": jnp.arange(N * 4, dtype=jnp.float32).reshape(N, 4)}
    upd, _ = _apply(mesh8, tx, grads)
    expect = -0.5 * np.asarray(grads["w"]).mean(0)
    np.testing.assert_allclose(np.asarray(upd["w"])[3], expect, rtol=1e-6)


def test_dense_allreduce_rejects_bad_reduce():
    with pytest.raises(ValueError, match=r"reduce must be one of \('psum', 'ring', 'tree'\)"):
        jaxcomm.dense_all_reduce("data", reduce="star")


def _steps(mesh, tx, grads_seq):
    """Run ``tx`` for T steps per worker on grads ``[T, N, d]``; return updates ``[N, T, d]``."""

    def per_worker(g_seq):
        def one_step(state, g):  # one program for every step: compiled once
            upd, state = tx.update(g[0], state)
            return state, upd

        state, outs = jax.lax.scan(one_step, tx.init(g_seq[0, 0]), g_seq)
        return outs[None], jax.tree_util.tree_map(lambda a: a[None], state)

    f = jax.shard_map(per_worker, mesh=mesh, in_specs=P(None, "data"), out_specs=P("data"))
    g = jax.device_put(grads_seq, NamedSharding(mesh, P(None, "data")))
    return jax.jit(f)(g)


def test_ec_quantized_allreduce_error_feedback(mesh8):
    """With a constant gradient the time-average of the outputs converges to the mean.

    Error feedback keeps the running sum of outputs within the (bounded) errors of the exact
    running sum, so the average over T steps is off by at most O(1/T) of a quantization step.
    """
    d, steps = 300, 12
    g = jax.random.normal(jax.random.key(0), (N, d))
    grads = jnp.broadcast_to(g, (steps, N, d))
    upd, state = _steps(
        mesh8, jaxcomm.ec_quantized_all_reduce("data", bits=2, bucket_size=64), grads
    )
    upd = np.asarray(upd)
    mean = np.asarray(g).mean(0)
    assert np.all(upd == upd[:1])  # every worker applies the same update
    one = np.abs(upd[0, 0] - mean).max()
    avg = np.abs(upd[0].mean(0) - mean).max()
    assert one > 0.05  # a single 2-bit step is coarse...
    assert avg < one / 4  # ...but the error feedback averages it out
    # Both phases send 2-bit codes plus one float per 64-element bucket per segment.
    seg = -(-d // N)
    seg_bytes = -(-seg * 2 // 8) + 4 * (-(-seg // 64))
    assert np.all(as_bytes(state.log.sent_bytes) == 2 * (N - 1) * seg_bytes)
    kinds = [jaxcomm.network.KINDS[i] for i in np.flatnonzero(np.asarray(state.log.calls)[0])]
    assert kinds == ["alltoall", "ring_allgather"]


def test_ec_quantized_allreduce_8bit_close_to_mean(mesh8):
    g = jax.random.normal(jax.random.key(1), (1, N, 257))
    upd, _ = _steps(mesh8, jaxcomm.ec_quantized_all_reduce("data", bits=8), g)
    np.testing.assert_allclose(np.asarray(upd)[0, 0], np.asarray(g[0]).mean(0), atol=0.03)
    with pytest.raises(ValueError, match=r"bits must be an integer in \[1, 8\], got 0"):
        jaxcomm.ec_quantized_all_reduce("data", bits=0)


# (d, bucket, positions) on 8 workers. d = 100: segments of 13, buckets [0, 8) and [8, 13)
# + 3 edge-padded; d = 5000: segments of 625, buckets [0, 512) and [512, 625) + 399 padded
# (the size where XLA's CPU max reduction dropped a NaN). Positions: bucket starts, middles,
# ends, a second segment's start and the last real element before the padding.
NAN_CASES = [(100, 8, p) for p in (0, 4, 7, 8, 12, 13, 99)] + [
    (5000, 512, p) for p in (0, 300, 511, 512, 624, 625, 4999)
]


@pytest.mark.parametrize("d,bucket,pos", NAN_CASES)
@pytest.mark.parametrize("bad", [np.nan, -np.inf])
def test_ec_quantized_nonfinite_at_every_position_reaches_every_update(mesh8, d, bucket, pos, bad):
    """A NaN or Inf anywhere in one worker's gradient (bucket start, middle, end, padding
    boundary) makes every worker's update non-finite; none gets a finite wrong value."""
    g = np.array(jax.random.normal(jax.random.key(2), (N, d)), np.float32)
    g[3, pos] = bad
    tx = jaxcomm.ec_quantized_all_reduce("data", bits=3, bucket_size=bucket)
    upd, state = _apply(mesh8, tx, {"g": jnp.asarray(g)})
    upd = np.asarray(upd["g"])
    assert np.all(~np.isfinite(upd).all(axis=1)), np.isfinite(upd).all(axis=1)
