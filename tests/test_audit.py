"""Wire audit: bytes, rounds and conditionals read from compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.collectives import broadcast_wire, pack_message, unpack_message

N = 8
RING = [(j, (j + 1) % N) for j in range(N)]


def _compile(f, *args, mesh=None, in_specs=None, out_specs=None):
    mesh = mesh or jax.make_mesh((N,), ("data",))
    in_specs = in_specs or P("data")
    out_specs = out_specs or P("data")
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    args = [
        jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, [in_specs], strict=True)
    ]
    return g.lower(*args).compile()


def test_native_collectives_and_loops():
    def f(x):  # x: f32[3] per device
        def body(i, v):
            return lax.ppermute(v, "data", RING) * 2.0

        v = lax.fori_loop(0, 5, body, x)  # 5 hops of 12 bytes
        s = lax.psum(x, "data")  # ceil(3 / 8) = 1 element a segment: 2 * 7 * 4
        w = lax.all_gather(x, "data")  # 7 * 12
        a = lax.all_to_all(jnp.tile(x, N).reshape(N, 3), "data", 0, 0)  # 7 * 12
        r = lax.psum_scatter(jnp.tile(x, N), "data", tiled=True)  # 7 * 12
        return v + s + w.sum(0) + a.sum(0) + r

    x = jnp.arange(N * 3, dtype=jnp.float32)
    audit = jaxcomm.wire_audit(_compile(f, x))
    kinds = sorted(op.kind for op in audit.ops)
    assert kinds == sorted(
        ["collective-permute", "all-reduce", "all-gather", "all-to-all", "reduce-scatter"]
    )
    (perm,) = [op for op in audit.ops if op.kind == "collective-permute"]
    assert perm.count == 5 and perm.rounds == 1
    t = audit.traffic()
    np.testing.assert_array_equal(t.sent, [5 * 12 + 56 + 3 * 84] * N)
    np.testing.assert_array_equal(t.rounds, [5 + 14 + 3 * 7] * N)
    np.testing.assert_array_equal(t.path_bytes, t.sent)


def test_partial_pairs_conditionals_and_two_axis_groups():
    mesh = jax.make_mesh((2, 4), ("data", "stage"))

    def f(x):  # x: f32[1, 2] per device
        y = lax.ppermute(x, "stage", [(0, 1), (1, 2)])  # stages 0 and 1 of both rows send
        z = lax.cond(
            lax.axis_index("stage") == 0,
            lambda: lax.pcast(lax.psum(x, "data"), "data", to="varying"),
            lambda: x,
        )
        return x + y + z

    x = jnp.ones((2, 8), jnp.float32)
    spec = P("data", "stage")
    audit = jaxcomm.wire_audit(_compile(f, x, mesh=mesh, in_specs=spec, out_specs=spec))
    assert len(audit.conditionals) == 1
    with pytest.raises(ValueError, match="inside conditionals"):
        audit.traffic()
    with pytest.raises(ValueError, match="exactly one conditional"):
        audit.traffic({"nothing-like-this": 1})
    stage = np.arange(8) % 4  # device d = data * 4 + stage
    t = audit.traffic({"cond": (stage == 0).astype(int)})  # branch 1 = the true branch
    # ppermute: 8 bytes from stages 0 and 1; psum over the 2-device data group: 2 * 1 * 4.
    np.testing.assert_array_equal(t.sent, np.where(stage < 2, 8, 0) + np.where(stage == 0, 8, 0))
    np.testing.assert_array_equal(t.rounds, 1 + np.where(stage == 0, 2, 0))


def test_unknown_trip_count_is_named():
    def f(x):
        def cond(c):
            return c[1][0] < 100.0

        def body(c):
            return c[0] + 1, lax.ppermute(c[1], "data", RING) + 1.0

        return lax.while_loop(cond, body, (0, x))[1]

    with pytest.raises(ValueError, match="trip count XLA could not determine"):
        jaxcomm.wire_audit(_compile(f, jnp.zeros(N)))
    with pytest.raises(TypeError, match="program must be"):
        jaxcomm.wire_audit(42)


def test_broadcast_sends_only_from_holders_and_traced_root_matches():
    """Round d of the binomial broadcast has d senders: from root r the busiest device (the
    root) sends ceil(log2 N) messages, and a traced root picks the same pattern."""
    x = jnp.arange(N * 4, dtype=jnp.float32).reshape(N, 4)

    def static(v):
        return jaxcomm.broadcast(v, 5, "data")

    def traced(v, root):
        return jaxcomm.broadcast(v, root[0], "data")

    audit = jaxcomm.wire_audit(_compile(static, x))
    want = broadcast_wire(jax.ShapeDtypeStruct((1, 4), jnp.float32), N, 5)
    np.testing.assert_array_equal(audit.sent_bytes(), want.sent)
    assert want.sent[5] == 3 * 16 and sum(want.sent) == (N - 1) * 16
    mesh = jax.make_mesh((N,), ("data",))
    g = jax.jit(jax.shard_map(traced, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    out = np.asarray(g(xs, jnp.array([5], jnp.int32)))
    np.testing.assert_array_equal(out, np.broadcast_to(np.asarray(x)[5], (N, 4)))
    taudit = jaxcomm.wire_audit(g.lower(xs, jnp.array([5], jnp.int32)).compile())
    np.testing.assert_array_equal(taudit.sent_bytes({"cond": 5}), want.sent)


def test_results_are_typed_replicated():
    """All-reduce, all-gather and broadcast results leave shard_map through out_specs P()
    with check_vma on; a reduce-scatter's does not (it differs between devices)."""
    mesh = jax.make_mesh((N,), ("data",))
    x = jax.device_put(jnp.arange(N * 5, dtype=jnp.float32), NamedSharding(mesh, P("data")))
    for fn in (
        lambda v: jaxcomm.ring_all_reduce(v, "data"),
        lambda v: jaxcomm.tree_all_reduce(v, "data"),
        lambda v: jaxcomm.ring_all_gather(v, "data"),
        lambda v: jaxcomm.broadcast(v, 2, "data"),
    ):
        out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P()))(x)
        assert np.all(np.isfinite(np.asarray(out)))
    with pytest.raises(Exception, match="replicat|vary|out_specs"):
        jax.jit(
            jax.shard_map(
                lambda v: jaxcomm.ring_reduce_scatter(jnp.tile(v, N).reshape(N, -1), "data"),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P(),
            )
        )(x)


def test_pack_message_round_trip_and_one_collective_per_hop():
    tree = {
        "codes": jnp.arange(10, dtype=jnp.uint8),
        "scale": jnp.array([1.5, -2.0], jnp.float32),
        "idx": jnp.array([3, 7, 9], jnp.int32),
        "flag": jnp.array([True]),
    }
    buf = pack_message(tree)
    assert buf.dtype == jnp.uint8 and buf.shape == (10 + 8 + 12 + 1,)
    back = unpack_message(buf, tree)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, tree)

    def f(v):
        msg = {"a": v, "b": (v * 2).astype(jnp.int32), "c": jnp.ones((3,), jnp.uint8)}
        return jaxcomm.collectives.send(msg, "data", RING)["b"].astype(jnp.float32)

    audit = jaxcomm.wire_audit(_compile(f, jnp.arange(N * 2, dtype=jnp.float32)))
    (op,) = audit.ops
    assert op.rounds == 1 and list(op.sent) == [2 * 4 + 2 * 4 + 3] * N
