"""jaxcomm.groups.GroupOuter: DiLoCo's outer step between separate programs, against the
one-program jaxcomm.diloco and against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.codecs import ChunkTopKCodec, QuantizeCodec, StatQuantizeCodec

SHAPES = {"a": (6, 5), "b": (7,)}


def _flat(tree):
    return np.concatenate([np.asarray(tree[k], np.float32).reshape(-1) for k in sorted(tree)])


@pytest.mark.parametrize("outer", ["sgd", "nesterov"])
def test_equals_one_program_diloco(outer):
    """Two groups' host outer step gives the theta_sync that jaxcomm.diloco gives two
    workers of one program (a user's shard_map, per-worker gradients), over three periods."""
    n, inner_lr, period = 2, 0.1, 2
    rng = np.random.default_rng(0)
    p0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    # Per-worker, per-step gradients (the same for both paths).
    grads = {k: rng.normal(size=(3 * period, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    make_outer = {
        "sgd": lambda: optax.sgd(1.0),
        "nesterov": lambda: optax.sgd(0.7, momentum=0.9, nesterov=True),
    }[outer]

    tx = jaxcomm.diloco(optax.sgd(inner_lr), "data", period=period, outer=make_outer())
    mesh = jax.make_mesh((n,), ("data",))

    def per_worker(p, g):
        g = jax.tree_util.tree_map(lambda v: v[:, 0], g)
        state = tx.init(p)
        anchors = []
        for t in range(3 * period):
            u, state = tx.update(jax.tree_util.tree_map(lambda v, t=t: v[t], g), state, p)
            p = optax.apply_updates(p, u)
            anchors.append(state.anchor)
        return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *anchors)

    run = jax.shard_map(per_worker, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=P())
    sharded = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P(None, "data")))
    want = jax.jit(run)(p0, sharded)

    go = jaxcomm.groups.GroupOuter(make_outer())
    state = go.init(_flat(p0))
    local = [dict(p0) for _ in range(n)]
    for t in range(3 * period):
        for w in range(n):
            local[w] = {k: local[w][k] - inner_lr * grads[k][t, w] for k in SHAPES}
        if (t + 1) % period == 0:
            payloads = []
            for w in range(n):
                payload, state_w, _ = go.send(state, _flat(local[w]))
                payloads.append(go.from_wire(go.to_wire(payload), payload.size))
            state = go.step(state, go.mean(payloads, [7, 7]))
            flat = state.anchor
            sizes = [int(np.prod(SHAPES[k])) for k in sorted(SHAPES)]
            parts = np.split(flat, np.cumsum(sizes)[:-1])
            merged = {k: v.reshape(SHAPES[k]) for k, v in zip(sorted(SHAPES), parts, strict=True)}
            local = [dict(merged) for _ in range(n)]
        np.testing.assert_allclose(
            state.anchor, _flat({k: want[k][t] for k in SHAPES}), rtol=0, atol=2e-6
        )


def test_token_weighted_mean_and_member_order():
    go = jaxcomm.groups.GroupOuter()
    d = [np.full(4, 1.0, np.float32), np.full(4, 5.0, np.float32)]
    np.testing.assert_allclose(go.mean(d, [1, 3]), np.full(4, 4.0), rtol=1e-6)
    np.testing.assert_array_equal(go.mean(d, [2, 2]), np.full(4, 3.0, np.float32))


@pytest.mark.parametrize(
    "codec",
    [QuantizeCodec(8, 512, stochastic=False), QuantizeCodec(4, 64), ChunkTopKCodec(64, 4, 2),
     StatQuantizeCodec(2, 6.0)],
    ids=["int8", "int4-stochastic", "chunk_topk", "statistical"],
)  # fmt: skip
def test_wire_round_trip_and_error_feedback(codec):
    """The packed bytes decode to the same payload; nothing is lost to the error feedback:
    what was sent plus the residual is the sum of the pseudo-gradients."""
    d = 1000
    go = jaxcomm.groups.GroupOuter(codec=codec, sizes=(600, 400))
    rng = np.random.default_rng(1)
    state = go.init(np.zeros(d, np.float32), slot=3)
    total_delta = np.zeros(d, np.float64)
    total_sent = np.zeros(d, np.float64)
    for _ in range(4):
        local = rng.normal(size=d).astype(np.float32)
        payload, state, _ = go.send(state, local)
        wire = go.to_wire(payload)
        assert wire.dtype == np.uint8 and wire.size == go.nbytes(d)
        back = go.from_wire(wire, d)
        np.testing.assert_array_equal(go.mean([back], [1]), go.mean([payload], [1]))
        total_delta += state.anchor - local
        total_sent += go.mean([back], [1])
    np.testing.assert_allclose(total_sent + state.residual, total_delta, atol=1e-4)
    assert go.nbytes(d) < 4 * d // 3  # far below float32


def test_keyed_codec_draws_per_group_and_unsent_keeps_the_error():
    go = jaxcomm.groups.GroupOuter(codec=QuantizeCodec(2, 32))
    x = np.linspace(-1, 1, 64).astype(np.float32)
    a, b = go.init(np.zeros(64, np.float32), slot=0), go.init(np.zeros(64, np.float32), slot=1)
    pa, _, _ = go.send(a, x)
    pb, _, unsent = go.send(b, x)
    assert not np.array_equal(go.to_wire(pa), go.to_wire(pb))
    np.testing.assert_array_equal(unsent.residual, -x)  # nothing delivered: all kept


def test_non_finite_reaches_the_mean():
    go = jaxcomm.groups.GroupOuter(codec=QuantizeCodec(8, 16, stochastic=False))
    state = go.init(np.zeros(32, np.float32))
    bad = np.ones(32, np.float32)
    bad[3] = np.nan
    p, _, _ = go.send(state, bad)
    assert not np.all(np.isfinite(go.mean([p], [1])))


def test_merge_is_streaming_diloco_mixing():
    local, anchor = np.full(3, 2.0, np.float32), np.full(3, 4.0, np.float32)
    np.testing.assert_array_equal(jaxcomm.groups.GroupOuter.merge(local, anchor, 0.25), 3.5)
    np.testing.assert_array_equal(jaxcomm.groups.GroupOuter.merge(local, anchor, 0.0), anchor)


def test_bad_input_names_the_argument():
    go = jaxcomm.groups.GroupOuter()
    with pytest.raises(ValueError, match="anchor must be a flat float32"):
        go.init(np.zeros((2, 2), np.float32))
    state = go.init(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="local must be a flat float32"):
        go.send(state, np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="tokens must be positive"):
        go.mean([np.zeros(4, np.float32)], [0])
    with pytest.raises(ValueError, match="one token count per payload"):
        go.mean([np.zeros(4, np.float32)], [1, 2])
    with pytest.raises(ValueError, match="decay"):
        jaxcomm.groups.GroupOuter(decay=1.5)
    with pytest.raises(ValueError, match="a payload of d=4 is 16 bytes"):
        go.from_wire(np.zeros(3, np.uint8), 4)
    with pytest.raises(TypeError, match="codec must be"):
        jaxcomm.groups.GroupOuter(codec="int8")
