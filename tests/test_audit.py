"""Wire audit: bytes, rounds and conditionals read from compiled programs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.collectives import broadcast_wire, pack_message, unpack_message

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
    with pytest.raises(ValueError, match="exactly one of the program.s conditionals"):
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
        return jaxcomm.collectives.broadcast(v, 5, "data")

    def traced(v, root):
        return jaxcomm.collectives.broadcast(v, root[0], "data")

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


@pytest.mark.parametrize("hops", [False, True])
def test_ring_all_reduce_sends_what_its_wire_says(hops):
    """Both paths of the ring all-reduce (XLA's reduce-scatter and all-gather, or 2 (N - 1)
    ppermute hops) send 2 (N - 1) segments of ceil(d / N) elements in 2 (N - 1) rounds,
    and nothing outside jaxcomm's wire scope."""
    d = 1001
    x = jnp.arange(N * d, dtype=jnp.float32)
    program = _compile(lambda v: jaxcomm.collectives.ring_all_reduce(v, "data", hops=hops), x)
    audit = jaxcomm.wire_audit(program)
    t = audit.traffic()
    seg = -(-d // N)
    np.testing.assert_array_equal(t.sent, [2 * (N - 1) * 4 * seg] * N)
    np.testing.assert_array_equal(t.rounds, [2 * (N - 1)] * N)
    want = jaxcomm.collectives.ring_all_reduce_wire(jax.ShapeDtypeStruct((seg,), jnp.float32), N)
    np.testing.assert_array_equal(t.sent, want.sent)
    kinds = {op.kind for op in audit.ops}
    assert kinds == ({"collective-permute"} if hops else {"reduce-scatter", "all-gather"})
    assert not jaxcomm.unlogged_traffic(program)


def test_results_are_typed_replicated():
    """All-reduce, all-gather and broadcast results leave shard_map through out_specs P()
    with check_vma on; a reduce-scatter's does not (it differs between devices)."""
    mesh = jax.make_mesh((N,), ("data",))
    x = jax.device_put(jnp.arange(N * 5, dtype=jnp.float32), NamedSharding(mesh, P("data")))
    for fn in (
        lambda v: jaxcomm.collectives.ring_all_reduce(v, "data"),
        lambda v: jaxcomm.collectives.tree_all_reduce(v, "data"),
        lambda v: jaxcomm.collectives.ring_all_gather(v, "data"),
        lambda v: jaxcomm.collectives.broadcast(v, 2, "data"),
    ):
        out = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data"), out_specs=P()))(x)
        assert np.all(np.isfinite(np.asarray(out)))
    with pytest.raises(Exception, match="replicat|vary|out_specs"):
        jax.jit(
            jax.shard_map(
                lambda v: jaxcomm.collectives.ring_reduce_scatter(
                    jnp.tile(v, N).reshape(N, -1), "data"
                ),
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


_ASYNC_HLO = """HloModule async_collectives, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(f32[] %a, f32[] %b)
}

%wrapped_rs (p: f32[8]) -> f32[2] {
  %p = f32[8]{0} parameter(0)
  ROOT %rs = f32[2]{0} reduce-scatter(f32[8]{0} %p), replica_groups={{0,1,2,3}}, \
dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[8], y: s32[6]) -> f32[2] {
  %x = f32[8]{0} parameter(0)
  %y = s32[6]{0} parameter(1)
  %start = ((f32[8]{0}), f32[2]{0}, s32[]) async-start(f32[8]{0} %x), calls=%wrapped_rs
  %update = ((f32[8]{0}), f32[2]{0}, s32[]) async-update(%start), calls=%wrapped_rs
  %done = f32[2]{0} async-done(%update), calls=%wrapped_rs
  %cps = (f32[8]{0}, s32[6]{0}, f32[8]{0}, s32[6]{0}) collective-permute-start(f32[8]{0} %x, \
s32[6]{0} %y), source_target_pairs={{0,1},{1,2}}
  %cpd = (f32[8]{0}, s32[6]{0}) collective-permute-done(%cps)
  %a2a = f32[8]{0} all-to-all-start(f32[8]{0} %x), replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %r = f32[2]{0} copy(%done)
}
"""


def test_async_forms_count_once_and_combined_permutes_count_every_operand():
    """An ``async-start`` wrapping a reduce-scatter counts once (its update and done move
    nothing); a combined permute sends all its operands; ``-start`` forms of reduce-scatter
    and all-to-all are known collectives."""
    audit = jaxcomm.wire_audit(_ASYNC_HLO)
    kinds = sorted(op.kind for op in audit.ops)
    assert kinds == ["all-to-all", "collective-permute", "reduce-scatter"]
    sent = audit.sent_bytes()
    rs = 3 * 8  # (N - 1) * result bytes (f32[2])
    a2a = 3 * 32 // 4  # (N - 1) / N * operand bytes
    permute = 32 + 24  # f32[8] and s32[6] to the next device, from devices 0 and 1 only
    np.testing.assert_array_equal(
        sent, [rs + a2a + permute, rs + a2a + permute, rs + a2a, rs + a2a]
    )
    # The in-place slice form of collective-permute is refused rather than miscounted.
    sliced = _ASYNC_HLO.replace(
        "source_target_pairs={{0,1},{1,2}}",
        "source_target_pairs={{0,1},{1,2}}, slice_sizes={{4}}",
    )
    with pytest.raises(ValueError, match="slice form"):
        jaxcomm.wire_audit(sliced)


def test_conditional_inside_a_loop_takes_branch_counts():
    """A ``lax.cond`` with a collective inside a 10-step scan: the program alone cannot tell
    how many steps took it, so the caller says (here 3 of 10), and bad counts are errors."""

    def f(x):
        def body(c, t):
            c = lax.cond(
                t % 4 == 0,
                lambda v: lax.ppermute(v, "data", RING),
                lambda v: v * 2.0,
                c,
            )
            return c, None

        return lax.scan(body, x, jnp.arange(10))[0]

    audit = jaxcomm.wire_audit(_compile(f, jnp.ones(N * 3, jnp.float32)))
    (cond,) = audit.conditionals
    assert audit.conditional_counts[cond] == 10
    (op,) = audit.ops
    taken = op.branches[0][1]
    assert taken == 1  # lax.cond lowers to branches (false, true): the permute is branch 1
    assert audit.conditional_branches[cond] == 2
    sent = audit.sent_bytes({cond: {taken: 3, 1 - taken: 7}})
    np.testing.assert_array_equal(sent, np.full(N, 3 * 12))
    np.testing.assert_array_equal(audit.sent_bytes({cond: taken}), np.full(N, 10 * 12))
    with pytest.raises(ValueError, match="runs 10 times"):
        audit.sent_bytes({cond: {taken: 3, 1 - taken: 6}})
    with pytest.raises(ValueError, match="branch 2 does not exist; the conditional has 2"):
        audit.sent_bytes({cond: 2})
    with pytest.raises(ValueError, match="executions must be an int"):
        audit.sent_bytes({cond: {taken: -1, 1 - taken: 11}})


def test_a_device_permuting_to_itself_sends_nothing():
    """Pairs ``(i, i)`` are local copies: no bytes, and a permute of only those no round."""

    def mixed(x):
        return jax.lax.ppermute(x, "data", [(0, 0), (1, 2), (2, 1), (3, 3)])

    audit = jaxcomm.wire_audit(_compile(mixed, jnp.arange(N * 4, dtype=jnp.float32)))
    t = audit.traffic()
    assert list(t.sent) == [0, 16, 16, 0, 0, 0, 0, 0] and t.rounds.max() == 1
    hlo = """HloModule self_permute, num_partitions=2

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  ROOT %p = f32[4]{0} collective-permute(f32[4]{0} %x), source_target_pairs={{0,0},{1,1}}
}
"""
    t = jaxcomm.wire_audit(hlo).traffic()
    assert list(t.sent) == [0, 0] and list(t.rounds) == [0, 0]
