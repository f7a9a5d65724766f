"""Local SGD and partial local SGD wrappers (jaxcomm.localsgd) and the layer profiler."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.localsgd import LocalSGDState, layer_comm_s, layer_wires
from jaxcomm._src.network import as_bytes

N = 8
SHAPES = {"emb": (6, 4), "mid": (4, 4), "out": (4, 3)}
LAYERS = ["emb", "mid", "out"]  # layer 0, 1, 2


def _problem(seed=0):
    """Per-worker quadratic losses 0.5 ||A_w p - y_w||^2 over every leaf (gradients depend on
    the parameters, so skipped or wrong averaging changes the trajectory)."""
    rng = np.random.default_rng(seed)
    a = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    y = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in SHAPES.items()}
    p0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    return a, y, p0


def _loss(p, a, y):
    return sum(0.5 * jnp.sum((a[k] * p[k] - y[k]) ** 2) for k in p)


def _run(tx, steps, *, seed=0, dense=False):
    """``steps`` updates per worker; returns params after every step ``[T, N, ...]`` and the
    final state. ``dense``: ``tx`` gets worker-averaged gradients (synchronous SGD)."""
    mesh = jax.make_mesh((N,), ("data",))
    a, y, p0 = _problem(seed)

    def per_worker(a, y, p):
        a, y, p = (jax.tree_util.tree_map(lambda v: v[0], t) for t in (a, y, p))
        state = tx.init(p)
        history = []
        for _ in range(steps):
            g = jax.grad(_loss)(p, a, y)
            if dense:
                g = jax.lax.pmean(g, "data")
            u, state = tx.update(g, state, p)
            p = optax.apply_updates(p, u)
            history.append(p)
        stack = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs)[:, None], *history)
        return stack, jax.tree_util.tree_map(lambda v: v[None], state)

    f = jax.jit(
        jax.shard_map(
            per_worker,
            mesh=mesh,
            in_specs=(P("data"), P("data"), P("data")),
            out_specs=(P(None, "data"), P("data")),
            check_vma=False,
        )
    )
    sharded = NamedSharding(mesh, P("data"))
    stacked = jax.tree_util.tree_map(lambda v: np.broadcast_to(v, (N, *v.shape)), p0)
    put = lambda t: jax.device_put(t, sharded)  # noqa: E731
    hist, state = f(put(a), put(y), put(stacked))
    return jax.tree_util.tree_map(np.asarray, hist), state


def _spread(x):
    """Largest difference between workers, ``x: [N, ...]``."""
    return float(np.max(np.abs(x - x[0:1])))


@pytest.mark.parametrize("inner", ["sgd", "momentum"])
def test_period_one_equals_synchronous_sgd(inner):
    make = {"sgd": lambda: optax.sgd(0.05), "momentum": lambda: optax.sgd(0.05, momentum=0.9)}
    local, _ = _run(jaxcomm.local_sgd(make[inner](), "data", period=1), 6)
    sync, _ = _run(make[inner](), 6, dense=True)
    for k in SHAPES:
        assert _spread(local[k][-1]) < 1e-6  # the workers agree
        np.testing.assert_allclose(local[k], sync[k], rtol=2e-5, atol=2e-6)
    apart, _ = _run(jaxcomm.local_sgd(make[inner](), "data", period=3), 6)
    assert _spread(apart["mid"][0]) > 1e-3  # without averaging they drift apart


def test_local_sgd_averages_every_period_steps():
    hist, state = _run(jaxcomm.local_sgd(optax.sgd(0.05), "data", period=3), 7)
    for t in range(7):  # step t (0-based) ends a period when (t + 1) % 3 == 0
        spread = max(_spread(hist[k][t]) for k in SHAPES)
        assert (spread < 1e-6) == ((t + 1) % 3 == 0), (t, spread)
    assert np.all(np.asarray(state.count) == 7)


def test_partial_schedule_averages_its_groups_and_covers_every_layer():
    # Bubble-filled: layer 2 is averaged at both steps, layers 1 and 0 at step 1.
    sched = jaxcomm.schedules.as_schedule(((2,), (2, 1, 0)))
    tx = jaxcomm.partial_local_sgd(optax.sgd(0.05), "data", schedule=sched, layers=LAYERS)
    hist, _ = _run(tx, 4)
    averaged = {0: set(), 1: set()}
    for t in range(4):
        h = t % 2
        for layer, name in enumerate(LAYERS):
            agree = _spread(hist[name][t]) < 1e-6
            assert agree == (layer in sched.groups[h]), (t, name)
            if agree:
                averaged[h].add(layer)
    assert averaged[0] | averaged[1] == {0, 1, 2}  # a full period covers every layer


def test_inner_state_stays_local_and_traffic_is_the_groups():
    sched = ((2, 1), (0,))
    tx = jaxcomm.partial_local_sgd(
        optax.adam(0.01), "data", schedule=sched, layers=LAYERS, period=2
    )
    _, state = _run(tx, 1)
    assert isinstance(state, LocalSGDState)
    mu = np.asarray(state.inner[0].mu["out"])
    assert _spread(mu) > 1e-4  # Adam's moments are never averaged
    sent = as_bytes(np.asarray(state.log.sent_bytes))
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in SHAPES.items()}
    wires = layer_wires(params, LAYERS, N)
    # Step 0 averaged layers 2 and 1: one ring each, 2 (N - 1) segments of ceil(d / N) floats.
    want = sum(2 * (N - 1) * 4 * -(-int(np.prod(SHAPES[LAYERS[i]])) // N) for i in (2, 1))
    assert np.all(sent == want) and sum(wires[i].sent[0] for i in (2, 1)) == want
    net = jaxcomm.network.Network(1e-3, 1e9)
    times = layer_comm_s(wires, net)
    assert times[0] == pytest.approx(2 * (N - 1) * 1e-3 + wires[0].path_bytes * 8 / 1e9)


def test_bad_arguments():
    sgd = optax.sgd(0.1)
    with pytest.raises(ValueError, match="period must be"):
        jaxcomm.local_sgd(sgd, "data", period=0)
    with pytest.raises(ValueError, match="period=3 does not match"):
        jaxcomm.partial_local_sgd(sgd, "data", schedule=((1,), (0,)), period=3)
    with pytest.raises(ValueError, match="reduce must be one of"):
        jaxcomm.local_sgd(sgd, "data", period=2, reduce="star")
    with pytest.raises(ValueError, match="every layer"):  # layer 1 never averaged
        jaxcomm.partial_local_sgd(sgd, "data", schedule=jaxcomm.schedules.Schedule(((2,), (0,)), 3))
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    grads = params
    mesh = jax.make_mesh((N,), ("data",))

    def update(tx):
        def per_worker(p):
            return tx.update(jaxcomm.varying(grads, "data"), tx.init(p), p)[0]

        return jax.shard_map(per_worker, mesh=mesh, in_specs=P(), out_specs=P("data"))(params)

    # A schedule of 4 layers on a model of 3: layer index 3 is outside the model.
    four = jaxcomm.partial_local_sgd(sgd, "data", schedule=((3, 2), (1, 0)), layers=LAYERS)
    with pytest.raises(ValueError, match="schedule covers 4 layers"):
        update(four)
    missing = jaxcomm.partial_local_sgd(sgd, "data", schedule=((1,), (0,)), layers=LAYERS[:2])
    with pytest.raises(ValueError, match="exactly once.*missing: \\['out'\\]"):
        update(missing)
    with pytest.raises(ValueError, match="need params"):
        jaxcomm.local_sgd(sgd, "data", period=2).update(grads, None)


def test_profile_telescopes_and_sees_equal_blocks():
    from models import build_task

    task = build_task("gpt", num_layers=3, width=64, num_heads=2, seq_len=32)
    batch = {"tokens": jnp.zeros((4, 33), jnp.int32)}
    params = jax.eval_shape(lambda: task.init(jax.random.key(0), batch))
    shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), batch)
    names = ["embed", "block_0", "block_1", "block_2", "head"]
    prof = jaxcomm.compute.profile_layers(
        lambda p, b: task.loss(p, b)[0],
        params,
        shapes,
        names,
        roofline=jaxcomm.compute.roofline("v100"),
    )
    assert prof.method == "roofline:v100"
    assert prof.names == tuple(names) and len(prof.backward_s) == 5
    blocks = prof.backward_s[1:4]
    assert min(blocks) > 0 and max(blocks) / min(blocks) < 1.01  # identical blocks
    assert sum(prof.backward_s) > prof.forward_s > 0  # backward costs more than forward
    assert prof.forward_s == prof.prefix_s[-1]
    # The whole forward and backward, compiled here on its own and put on the same roofline,
    # is what the forward and the per-layer backwards add up to.
    full = jax.jit(jax.grad(lambda p, b: task.loss(p, b)[0])).lower(params, shapes).compile()
    whole = jaxcomm.compute.roofline("v100").seconds(jaxcomm.audit.program_cost(full).per_device())[
        0
    ]
    assert prof.forward_s + sum(prof.backward_s) == pytest.approx(whole, rel=0.02)
    assert list(prof.prefix_s) == sorted(prof.prefix_s, reverse=True)  # shorter, cheaper
    assert prof.param_bytes[1] == 4 * sum(
        int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params["block_0"])
    )
    comm = prof.comm_s(jaxcomm.network.Network(1e-3, 1e9), N)
    assert len(comm) == 5 and comm[1] == comm[2] > 2 * (N - 1) * 1e-3


def test_measured_profile_is_positive():
    from models import build_task

    task = build_task("mlp", features=[256, 256])
    batch = {
        "image": jnp.ones((64, 8, 8, 1), jnp.float32),
        "label": jnp.zeros((64,), jnp.int32),
    }
    params = task.init(jax.random.key(0), batch)
    names = list(params)
    prof = jaxcomm.compute.profile_layers(
        lambda p, b: task.loss(p, b)[0], params, batch, names, repeats=5
    )
    assert prof.method == "measured" and prof.forward_s == prof.prefix_s[-1]
    # Wall times of separate runs are not compared with each other (load on the host can
    # reorder them); which prefix costs more is checked on the roofline above.
    assert len(prof.prefix_s) == len(prof.spread_s) == len(names) + 1
    assert min(prof.prefix_s) > 0 and min(prof.spread_s) >= 0
    # Each layer's backward is the difference of its two prefixes, clipped at 0, so the
    # parts add up to at least the full forward and backward.
    for i, b in enumerate(prof.backward_s):
        assert b == max(prof.prefix_s[i] - prof.prefix_s[i + 1], 0.0)
    assert prof.forward_s + sum(prof.backward_s) >= prof.prefix_s[0] * (1 - 1e-9)
