"""Ring, tree and broadcast collectives against the built-in ``psum`` on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

N = 8


def run(mesh, fn, x, out_spec=None):
    """Apply ``fn`` per device to the rows of ``x`` (leading axis N) and stack the results."""
    out_spec = P("data") if out_spec is None else out_spec
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    f = jax.shard_map(
        lambda v: jax.tree_util.tree_map(lambda a: a[None], fn(v[0])),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=out_spec,
    )
    return jax.jit(f)(x)


@pytest.mark.parametrize("hops", [False, True])
@pytest.mark.parametrize("shape", [(1000,), (3, 5), (7,), (1,)])
def test_ring_all_reduce_equals_psum(mesh8, shape, hops):
    x = jax.random.normal(jax.random.key(0), (N, *shape))
    ring = run(mesh8, lambda v: jaxcomm.collectives.ring_all_reduce(v, "data", hops=hops), x)
    ref = run(mesh8, lambda v: jax.lax.psum(v, "data"), x)
    np.testing.assert_allclose(np.asarray(ring), np.asarray(ref), rtol=1e-5, atol=1e-5)
    mean = run(
        mesh8, lambda v: jaxcomm.collectives.ring_all_reduce(v, "data", mean=True, hops=hops), x
    )
    np.testing.assert_allclose(np.asarray(mean), np.asarray(ref) / N, rtol=1e-5, atol=1e-6)


def test_tree_all_reduce_equals_psum(mesh8):
    x = jax.random.normal(jax.random.key(1), (N, 257))
    tree = run(mesh8, lambda v: jaxcomm.collectives.tree_all_reduce(v, "data"), x)
    ref = run(mesh8, lambda v: jax.lax.psum(v, "data"), x)
    np.testing.assert_allclose(np.asarray(tree), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduce", ["ring", "ring_hops", "tree"])
def test_uint8_all_reduce_exact(mesh8, reduce):
    x = jax.random.randint(jax.random.key(2), (N, 99), 0, 256).astype(jnp.uint8)
    fns = {
        "ring": jaxcomm.collectives.ring_all_reduce,
        "ring_hops": lambda v, a: jaxcomm.collectives.ring_all_reduce(v, a, hops=True),
        "tree": jaxcomm.collectives.tree_all_reduce,
    }
    out = np.asarray(run(mesh8, lambda v: fns[reduce](v, "data"), x))
    expect = (np.asarray(x).astype(np.int64).sum(0) % 256).astype(np.uint8)
    for row in out:
        np.testing.assert_array_equal(row, expect)
    assert out.dtype == np.uint8


def test_ring_reduce_scatter_matches_psum_scatter(mesh8):
    x = jax.random.normal(jax.random.key(3), (N, N, 6))
    ring = run(mesh8, lambda v: jaxcomm.collectives.ring_reduce_scatter(v, "data"), x)
    ref = run(mesh8, lambda v: jax.lax.psum_scatter(v, "data", tiled=False), x)
    np.testing.assert_allclose(np.asarray(ring), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_ring_reduce_scatter_custom_combine_sees_hop_counts(mesh8):
    """A bitwise-OR ring over packed words, and a counter of merged devices per hop."""
    words = jax.random.randint(jax.random.key(4), (N, N, 5), 0, 256).astype(jnp.uint8)

    def fn(v):
        init = lambda seg: (seg, jnp.int32(1))
        combine = lambda msg, seg, step: (msg[0] | seg, jnp.maximum(msg[1] + 1, step + 2))
        return jaxcomm.collectives.ring_reduce_scatter(v, "data", combine=combine, init=init)

    bits, count = run(mesh8, fn, words, out_spec=(P("data"), P("data")))
    expect = np.bitwise_or.reduce(np.asarray(words), axis=0)  # [N segments, 5]
    np.testing.assert_array_equal(np.asarray(bits), expect)
    np.testing.assert_array_equal(np.asarray(count), np.full(N, N))


def test_ring_all_gather_pytree(mesh8):
    x = jnp.arange(N * 3, dtype=jnp.uint8).reshape(N, 3)
    f = lambda v: jaxcomm.collectives.ring_all_gather(
        {"a": v, "b": v.astype(jnp.float32) * 2}, "data"
    )
    out = run(mesh8, f, x, out_spec={"a": P("data"), "b": P("data")})
    a, b = np.asarray(out["a"]), np.asarray(out["b"])
    for d in range(N):
        np.testing.assert_array_equal(a[d], np.asarray(x))
        np.testing.assert_array_equal(b[d], np.asarray(x) * 2.0)


@pytest.mark.parametrize("n", [1, 2, 3, 6, 8])
def test_all_gather_by_doubling_matches_lax_and_its_wire(n):
    """Recursive doubling (power-of-two N: log2 N rounds) or the ring (other N) gathers a
    pytree like ``lax.all_gather``, and its wire is what the compiled program moves."""
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    x = jax.random.normal(jax.random.key(n), (n, 5))
    idx = jnp.arange(n * 3, dtype=jnp.int32).reshape(n, 3)

    def f(v, i):
        out = jaxcomm.collectives.all_gather({"v": v[0], "i": i[0]}, "data")
        ref = jax.lax.all_gather({"v": v[0], "i": i[0]}, "data")
        return jax.tree.map(lambda a: a[None], (out, ref))

    sh = NamedSharding(mesh, P("data"))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    (out, ref) = g(jax.device_put(x, sh), jax.device_put(idx, sh))
    jax.tree.map(np.testing.assert_array_equal, out, ref)
    mine = jax.jit(
        jax.shard_map(
            lambda v, i: jax.tree.map(
                lambda a: a[None], jaxcomm.collectives.all_gather({"v": v[0], "i": i[0]}, "data")
            ),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
    )
    audit = jaxcomm.wire_audit(mine.lower(jax.device_put(x, sh), jax.device_put(idx, sh)))
    wire = jaxcomm.collectives.all_gather_wire(
        {"v": jax.ShapeDtypeStruct((5,), jnp.float32), "i": jax.ShapeDtypeStruct((3,), jnp.int32)},
        n,
    )
    traffic = audit.traffic()
    np.testing.assert_array_equal(traffic.sent, wire.sent)
    np.testing.assert_array_equal(traffic.rounds, wire.rounds if n > 1 else 0)
    np.testing.assert_array_equal(traffic.path_bytes, wire.path_bytes)
    if n == 8:
        assert wire.rounds == 3 and wire.sent[0] == 7 * 32


@pytest.mark.parametrize("root", [0, 3, 7])
def test_broadcast_traced_root(mesh8, root):
    x = jax.random.normal(jax.random.key(5), (N, 11))
    roots = jnp.full((N,), root, jnp.int32)

    def fn(pair):
        v, r = pair
        return jaxcomm.collectives.broadcast(v, r, "data")

    xs = jax.device_put(x, NamedSharding(mesh8, P("data")))
    rs = jax.device_put(roots, NamedSharding(mesh8, P("data")))
    f = jax.shard_map(
        lambda v, r: fn((v[0], r[0]))[None],
        mesh=mesh8,
        in_specs=(P("data"), P("data")),
        out_specs=P("data"),
    )
    out = np.asarray(jax.jit(f)(xs, rs))
    for d in range(N):
        np.testing.assert_array_equal(out[d], np.asarray(x[root]))


def test_broadcast_root_chosen_inside_step(mesh8):
    """The root is the device with the largest norm, known only inside the step."""
    x = jax.random.normal(jax.random.key(6), (N, 4)) * jnp.arange(1, N + 1)[:, None] ** 0.5
    x = x.at[5].mul(100.0)

    def fn(v):
        norms = jax.lax.all_gather(jnp.sum(v * v), "data")
        return jaxcomm.collectives.broadcast(v, jnp.argmax(norms), "data")

    out = np.asarray(run(mesh8, fn, x))
    for d in range(N):
        np.testing.assert_array_equal(out[d], np.asarray(x[5]))


def test_errors_name_the_problem(mesh8):
    x = jnp.zeros((N, 4))
    with pytest.raises(ValueError, match="axis_name='model' is not bound"):
        run(mesh8, lambda v: jaxcomm.collectives.ring_all_reduce(v, "model"), x)
    with pytest.raises(ValueError, match="leading axis of size 8"):
        run(mesh8, lambda v: jaxcomm.collectives.ring_reduce_scatter(v, "data"), x)
    with pytest.raises(ValueError, match=r"root must be an integer in \[0, 7\], got 9"):
        run(mesh8, lambda v: jaxcomm.collectives.broadcast(v, 9, "data"), x)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_rings_on_other_sizes(n):
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    x = jax.random.normal(jax.random.key(n), (n, 13))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    hops = lambda v, a: jaxcomm.collectives.ring_all_reduce(v, a, hops=True)
    for fn in (jaxcomm.collectives.ring_all_reduce, hops, jaxcomm.collectives.tree_all_reduce):
        f = jax.shard_map(
            lambda v, fn=fn: fn(v[0], "data")[None],
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
        )
        out = np.asarray(jax.jit(f)(xs))
        for row in out:
            np.testing.assert_allclose(row, np.asarray(x).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["ring", "ring_hops", "tree", "gather", "broadcast"])
def test_gradients_through_replicated_results_match_lax(mesh8, op):
    """Replicated outputs (``out_specs=P()``, ``check_vma=True``) differentiate like the
    XLA collective they replace: a ring/tree all-reduce like ``psum``, the ring all-gather
    like a gather built from ``psum``, a broadcast like its root's value. A transpose that
    forgot the 1/N share of each bit-identical copy would scale them by 8."""
    x = jax.random.normal(jax.random.key(0), (8, 5))
    w = jax.random.normal(jax.random.key(1), (40,))

    def ours(v):
        if op in ("ring", "ring_hops"):
            return jnp.tile(
                jaxcomm.collectives.ring_all_reduce(v, "data", hops=op == "ring_hops"), 8
            )
        if op == "tree":
            return jnp.tile(jaxcomm.collectives.tree_all_reduce(v, "data"), 8)
        if op == "gather":
            return jaxcomm.collectives.ring_all_gather(v, "data").reshape(-1)
        return jnp.tile(jaxcomm.collectives.broadcast(v, 3, "data"), 8)

    def reference(v):
        i = jax.lax.axis_index("data")
        if op in ("ring", "ring_hops", "tree"):
            return jnp.tile(jax.lax.psum(v, "data"), 8)
        if op == "gather":
            placed = jnp.zeros((8, *v.shape), v.dtype).at[i].set(v)
            return jax.lax.psum(placed, "data").reshape(-1)
        return jnp.tile(jax.lax.psum(jnp.where(i == 3, v, 0.0), "data"), 8)

    def grad_of(collective):
        def loss(x):
            return jnp.sum(jnp.sin(collective(x[0] * x[0])) * w)

        f = jax.shard_map(loss, mesh=mesh8, in_specs=P("data"), out_specs=P(), check_vma=True)
        with jax.set_mesh(mesh8):
            return np.asarray(jax.jit(jax.grad(f))(jax.device_put(x, P("data"))))

    want = grad_of(reference)
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(grad_of(ours), want, rtol=1e-5, atol=1e-6)


def test_a_tuple_of_axes_in_either_order():
    """``ppermute`` numbers the devices of a tuple of axes in the mesh's order and
    ``axis_index`` in the tuple's: the ring all-reduce sums right either way, and the other
    ppermute collectives refuse a tuple out of the mesh's order rather than pair the wrong
    devices."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6)
    xs = jax.device_put(x, NamedSharding(mesh, P(("a", "b"))))

    def run2(fn):
        spec = P(("a", "b"))
        g = jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=spec, out_specs=spec)
        return np.asarray(jax.jit(g)(xs))

    for axes in (("a", "b"), ("b", "a")):
        for hops in (False, True):
            out = run2(lambda v, a=axes, h=hops: jaxcomm.collectives.ring_all_reduce(v, a, hops=h))
            np.testing.assert_array_equal(out, np.broadcast_to(np.asarray(x).sum(0), (8, 6)))
    np.testing.assert_array_equal(
        run2(lambda v: jaxcomm.collectives.tree_all_reduce(v, ("a", "b"))),
        np.broadcast_to(np.asarray(x).sum(0), (8, 6)),
    )
    for fn in (
        jaxcomm.collectives.tree_all_reduce,
        jaxcomm.collectives.ring_all_gather,
        jaxcomm.collectives.all_gather,
    ):
        with pytest.raises(ValueError, match=r"out of the mesh's order.*pass \('a', 'b'\)"):
            run2(lambda v, fn=fn: fn(v, ("b", "a")))
