"""AR-Topk (STAR / VAR), LWTopk and MSTopk: the properties of the paper's Algorithm 1."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.network import Network, as_bytes

N = 8
SHAPES = {"w": (40, 9), "b": (24,)}  # d = 384, a multiple of N
D = 384


def _grads(steps, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {
        k: jax.random.normal(key, (N, steps, *shape))
        for key, (k, shape) in zip(keys, SHAPES.items(), strict=True)
    }


def _flat(tree):
    """``[N, ...]`` leaves -> ``[N, d]`` in ``ravel_pytree`` order (sorted keys)."""
    return np.concatenate([np.asarray(tree[k]).reshape(N, -1) for k in sorted(tree)], axis=1)


def _run(tx, grads, steps):
    """Every step's updates and state, from inside ``shard_map`` ([N, ...] leaves)."""
    mesh = jax.make_mesh((N,), ("data",))
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}

    def per_worker(g):
        g = jax.tree.map(lambda a: a[0], g)
        state = tx.init(params)
        outs = []
        for t in range(steps):
            u, state = tx.update(jax.tree.map(lambda a, t=t: a[t], g), state, params)
            outs.append((u, state))
        return jax.tree.map(lambda a: a[None], outs)

    f = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    return f(jax.device_put(grads, NamedSharding(mesh, P("data"))))


def _error_fed(grads, states, t):
    """``G_w`` at step ``t``: the gradient plus the residual left by step ``t - 1``."""
    g = _flat(jax.tree.map(lambda a: a[:, t], grads))
    return g + (np.asarray(states[t - 1][1].residual) if t else 0.0)


AR_CASES = {
    "star_ring": dict(select="star", reduce="ring"),
    "star_tree": dict(select="star", reduce="tree"),
    "var_ring": dict(select="var", reduce="ring"),
    "var_tree": dict(select="var", reduce="tree"),
}


@pytest.mark.parametrize("name", AR_CASES)
def test_ar_topk_sends_the_roots_indices_and_keeps_the_rest(name):
    """For every worker ``sent + residual == G`` exactly; the sent entries are ``G`` at the
    root's own top-k indices, on every worker; the update is their average, identical on
    every worker and zero elsewhere."""
    ratio, steps = 0.05, 4
    k = math.ceil(ratio * D)
    grads = _grads(steps)
    outs = _run(jaxcomm.ar_topk("data", ratio=ratio, **AR_CASES[name]), grads, steps)
    for t in range(steps):
        g = _error_fed(grads, outs, t)
        updates, state = outs[t]
        residual = np.asarray(state.residual)
        root = int(np.asarray(state.root)[0])
        assert np.all(np.asarray(state.root) == root) and 0 <= root < N
        idx = np.sort(np.argsort(-np.abs(g[root]), kind="stable")[:k])
        sent = np.zeros_like(g)
        sent[:, idx] = g[:, idx]
        np.testing.assert_array_equal(sent + residual, g)
        np.testing.assert_array_equal(residual[:, idx], 0.0)
        u = _flat(updates)
        assert np.all(u == u[0])
        np.testing.assert_allclose(u[0], sent.mean(0), rtol=1e-5, atol=1e-6)
        assert np.count_nonzero(u[0]) == k
        gain = (sent**2).sum(1) / (g**2).sum(1)
        np.testing.assert_allclose(np.asarray(state.gain), gain, rtol=1e-5)


def test_star_roots_cycle_through_every_rank():
    steps = 2 * N
    outs = _run(jaxcomm.ar_topk("data", ratio=0.05), _grads(steps), steps)
    roots = [int(np.asarray(s.root)[0]) for _, s in outs]
    assert roots == [t % N for t in range(steps)]


def test_var_root_is_the_worker_with_the_largest_topk_norm():
    """With gradients of very different scales per worker the VAR root follows the largest
    ``||G_w[idx_w]||^2``, recomputed here from ``G``."""
    steps, ratio = 6, 0.05
    k = math.ceil(ratio * D)
    grads = _grads(steps, seed=3)
    scale = jax.random.uniform(jax.random.key(7), (N, steps), minval=0.1, maxval=3.0)
    grads = jax.tree.map(lambda a: a * scale.reshape(N, steps, *([1] * (a.ndim - 2))), grads)
    outs = _run(jaxcomm.ar_topk("data", ratio=ratio, select="var"), grads, steps)
    roots = []
    for t in range(steps):
        g = _error_fed(grads, outs, t)
        top = -np.sort(-np.abs(g), axis=1)[:, :k]
        want = int(np.argmax((top**2).sum(1)))
        roots.append(int(np.asarray(outs[t][1].root)[0]))
        assert roots[-1] == want, (t, roots[-1], want)
    assert len(set(roots)) > 1  # not a constant that happens to match


def test_ring_and_tree_give_the_same_updates():
    grads, steps = _grads(3), 3
    ring = _run(jaxcomm.ar_topk("data", ratio=0.1, reduce="ring"), grads, steps)
    tree = _run(jaxcomm.ar_topk("data", ratio=0.1, reduce="tree"), grads, steps)
    for (ur, sr), (ut, st_) in zip(ring, tree, strict=True):
        np.testing.assert_allclose(_flat(ur), _flat(ut), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(sr.residual), np.asarray(st_.residual), atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomm.ar_topk("data", ratio=1.0),
        lambda: jaxcomm.ar_topk("data", ratio=1.0, select="var", reduce="tree"),
        lambda: jaxcomm.ar_topk("data", ratio=1.0, reduce="allgather"),
        lambda: jaxcomm.lw_topk("data", ratio=1.0),
        lambda: jaxcomm.ms_topk("data", ratio=1.0),
    ],
)
def test_ratio_one_is_the_dense_average(make):
    grads = _grads(2)
    outs = _run(make(), grads, 2)
    for t, (u, state) in enumerate(outs):
        want = _flat(jax.tree.map(lambda a, t=t: a[:, t], grads)).mean(0)
        np.testing.assert_allclose(_flat(u)[0], want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(state.residual), 0.0)


@pytest.mark.parametrize(
    "make,layerwise",
    [
        (lambda r: jaxcomm.ar_topk("data", ratio=r, reduce="allgather"), False),
        (lambda r: jaxcomm.ms_topk("data", ratio=r), False),
        (lambda r: jaxcomm.lw_topk("data", ratio=r), True),
    ],
)
def test_allgather_topk_sends_each_workers_own_entries(make, layerwise):
    """AG top-k: each worker sends its own top entries (per layer for LWTopk), keeps the
    rest, and the update is the average of every worker's sparse vector."""
    ratio, steps = 0.05, 3
    grads = _grads(steps, seed=1)
    outs = _run(make(ratio), grads, steps)
    sizes = [math.prod(SHAPES[k]) for k in sorted(SHAPES)]
    for t in range(steps):
        g = _error_fed(grads, outs, t)
        sent = np.zeros_like(g)
        for w in range(N):
            start = 0
            for size in sizes if layerwise else [D]:
                k = math.ceil(ratio * size)
                part = g[w, start : start + size]
                idx = start + np.argsort(-np.abs(part), kind="stable")[:k]
                sent[w, idx] = g[w, idx]
                start += size
        u, state = outs[t]
        np.testing.assert_array_equal(sent + np.asarray(state.residual), g)
        np.testing.assert_array_equal(np.asarray(state.residual)[sent != 0], 0.0)
        np.testing.assert_allclose(_flat(u)[0], sent.mean(0), rtol=1e-5, atol=1e-6)
        assert np.all(_flat(u) == _flat(u)[0])
        assert int(np.asarray(state.root)[0]) == -1


@settings(max_examples=30, deadline=None)
@given(
    d=st.integers(1, 3000),
    ratio=st.floats(0.0005, 1.0),
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e20]),
)
def test_threshold_selection_is_the_exact_topk(d, ratio, seed, scale):
    """The bisection threshold picks the same set as ``lax.top_k`` (distinct magnitudes)."""
    k = max(1, min(d, math.ceil(ratio * d)))
    x = np.random.default_rng(seed).permutation(d).astype(np.float32) + 1.0
    x *= np.where(np.random.default_rng(seed + 1).random(d) < 0.5, -scale, scale)
    got = np.asarray(jaxcomm.codecs.topk_indices(jnp.asarray(x), k, method="threshold"))
    want = np.asarray(jaxcomm.codecs.topk_indices(jnp.asarray(x), k, method="exact"))
    assert len(set(got.tolist())) == k
    assert set(got.tolist()) == set(want.tolist())


_select = jax.jit(jaxcomm.codecs.topk_indices, static_argnames=("k", "method"))


@given(
    d=st.sampled_from([1, 7, 100, 2999]),  # few shapes: the programs are cached
    ratio=st.sampled_from([0.0005, 0.03, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
    outlier=st.sampled_from([1.0, 1e6, 1e30]),
    levels=st.sampled_from([3, 50, 0]),
)
@settings(max_examples=40, deadline=None)
def test_auto_and_threshold_equal_lax_top_k_with_outliers_and_ties(d, ratio, seed, outlier, levels):
    """The default selection is exact: one huge outlier (which left a search on the values
    a bracket of max / 2**25) and many ties (broken to the lower index, as ``lax.top_k``
    does) give ``lax.top_k``'s very set."""
    rng = np.random.default_rng(seed)
    k = max(1, min(d, math.ceil(ratio * d)))
    x = rng.normal(size=d).astype(np.float32)
    if levels:  # only a few distinct magnitudes: ties everywhere
        x = (np.round(np.abs(x) * levels) / levels * np.sign(x)).astype(np.float32)
    x[rng.integers(d)] = outlier
    want = set(np.asarray(lax.top_k(jnp.abs(jnp.asarray(x)), k)[1]).tolist())
    for method in ("auto", "threshold", "sample"):
        got = np.asarray(_select(jnp.asarray(x), k=k, method=method)).tolist()
        assert len(set(got)) == k and set(got) == want, method


def test_the_sample_selection_under_grad_and_with_float64():
    """A gradient through code around the selection (its indices are integers; the host
    kernel has no derivative rule and needs none) is the one-hot of the kept entries; a
    float64 array, whose values may differ beyond float32, is refused by ``sample`` and
    taken by ``lax.top_k`` under ``auto``."""
    d = 1 << 16  # above AUTO_SAMPLE_FROM: auto is the sample selection on the CPU
    x = jnp.asarray(np.random.default_rng(0).normal(size=d), jnp.float32)
    for method in ("auto", "sample"):
        g = jax.grad(
            lambda v, m=method: jnp.sum(jaxcomm.codecs.topk_encode(v, ratio=0.01, method=m).values)
        )(x)
        want = np.zeros(d, np.float32)
        want[np.asarray(lax.top_k(jnp.abs(x), math.ceil(0.01 * d))[1])] = 1.0
        np.testing.assert_array_equal(np.asarray(g), want)
    with jax.enable_x64(True):
        y = np.full(d, 1.0) + np.arange(d) * 1e-12  # equal in float32, ordered in float64
        with pytest.raises(ValueError, match="method='sample' orders float32 bit patterns"):
            jaxcomm.codecs.topk_indices(jnp.asarray(y), 10, method="sample")
        got = np.asarray(jaxcomm.codecs.topk_indices(jnp.asarray(y), 10, method="auto"))
        assert sorted(got.tolist()) == list(range(d - 10, d))


@pytest.mark.parametrize(
    ("d", "k", "cpu", "cuda", "other"),
    [
        (1 << 12, 400, "while", "top_k", "while"),  # above AUTO_THRESHOLD_ABOVE, small
        (1 << 12, 4, "top_k", "top_k", "top_k"),  # below it
        (1 << 16, 6000, "custom_call", "top_k", "while"),  # from AUTO_SAMPLE_FROM on
    ],
)
def test_auto_lowers_to_each_platforms_measured_selection(d, k, cpu, cuda, other):
    """``auto`` is the host sample kernel on the CPU from AUTO_SAMPLE_FROM entries on (a
    custom call), ``lax.top_k`` on CUDA at every size and share (the H200 measurement), and
    the share rule elsewhere (a threshold search is a while loop): read off the program
    lowered for each platform on this machine."""
    x = jax.ShapeDtypeStruct((d,), jnp.float32)
    f = jax.jit(lambda v: jaxcomm.codecs.topk_indices(v, k, method="auto"))
    marks = {"while": "stablehlo.while", "top_k": "chlo.top_k", "custom_call": "custom_call"}
    for platform, want in (("cpu", cpu), ("cuda", cuda), ("tpu", other)):
        text = f.trace(x).lower(lowering_platforms=(platform,)).as_text()
        found = [name for name, mark in marks.items() if mark in text]
        assert found == [want], (platform, found)


def _magnitude_order_reference(x, k):
    """The k largest magnitudes' indices by a stable sort of the magnitude bit patterns
    (NaN and Inf above every finite value; ties to the lower index), ascending."""
    bits = (x.view(np.int32) & np.int32(0x7FFFFFFF)).astype(np.int64)
    return np.sort(np.argsort(-bits, kind="stable")[:k]).astype(np.int32)


@given(
    d=st.integers(1, 300_000),
    ratio=st.floats(1e-5, 1.0),
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from(["normal", "ascending", "descending", "periodic", "ties", "nan"]),
)
@settings(max_examples=60, deadline=None)
def test_the_sample_selection_is_exact_whatever_the_data(d, ratio, seed, shape):
    """The host kernel of ``method="sample"`` against a stable sort, on data chosen to
    mislead its strided sample: sorted either way, a period that puts every sampled entry
    on the smallest values, a few distinct magnitudes (ties), and more NaNs than k. A
    misplaced threshold may only cost time."""
    from jaxcomm._src.codecs import _SAMPLE, _sample_select_host

    rng = np.random.default_rng(seed)
    k = max(1, min(d, math.ceil(ratio * d)))
    x = rng.normal(size=d).astype(np.float32)
    if shape == "ascending":
        x = np.sort(np.abs(x))
    elif shape == "descending":
        x = -np.sort(np.abs(x))[::-1]
    elif shape == "periodic":  # sampled entries (every d // _SAMPLE-th) are the tiny ones
        stride = max(1, d // _SAMPLE)
        x = np.where(np.arange(d) % stride == 0, 1e-3 * x, x).astype(np.float32)
    elif shape == "ties":
        x = (np.round(x * 2) / 2).astype(np.float32)
    elif shape == "nan":
        x[rng.integers(0, d, size=k + 3)] = np.nan
    got = _sample_select_host(x, k)
    assert got.dtype == np.int32 and got.shape == (k,)
    np.testing.assert_array_equal(got, _magnitude_order_reference(x, k))


def test_default_selection_recall_at_ratio_0_1_with_one_outlier():
    """The case found by review: 10% of 100,000 normal entries and one at 1e6. Recall 1.0."""
    x = np.random.default_rng(0).normal(size=100_000).astype(np.float32)
    x[123] = 1e6
    k = 10_000
    want = set(np.asarray(lax.top_k(jnp.abs(jnp.asarray(x)), k)[1]).tolist())
    got = set(np.asarray(jaxcomm.codecs.topk_indices(jnp.asarray(x), k, method="auto")).tolist())
    assert len(got & want) / k == 1.0


def test_threshold_selection_with_ties_and_zeros_picks_k_distinct_largest():
    x = jnp.asarray([0.0, 3.0, -3.0, 1.0, 3.0, 0.0, 2.0, -1.0])
    idx = np.asarray(jaxcomm.codecs.topk_indices(x, 4, method="threshold"))
    assert sorted(idx.tolist()) == [1, 2, 4, 6]
    z = np.asarray(jaxcomm.codecs.topk_indices(jnp.zeros(10), 3, method="threshold"))
    assert len(set(z.tolist())) == 3


def _log_time(state, net):
    log = state.log
    k = len(jaxcomm.network.KINDS)
    rounds = np.asarray(log.rounds).reshape(N, k).sum(1)
    path = as_bytes(np.asarray(log.path_bytes).reshape(N, k, 2)).sum(1)
    return rounds * net.latency_s + path * net.beta


@pytest.mark.parametrize(
    "reduce,kind", [("ring", "art_ring"), ("tree", "art_tree"), ("allgather", "ag_topk")]
)
def test_logged_time_is_the_papers_cost_of_the_kind(reduce, kind):
    """With ``N | k`` the step's logged rounds and path bytes are Eqs. (4a), (4b) and the
    AG top-k cost of the paper at the step's dense size and ratio."""
    ratio = 0.125  # k = 48, a multiple of N
    net = Network(2e-3, 3e9)
    (_, state), *_ = _run(jaxcomm.ar_topk("data", ratio=ratio, reduce=reduce), _grads(1), 1)
    want = jaxcomm.network.collective_time(kind, 4 * D, N, net, ratio=ratio)
    np.testing.assert_allclose(_log_time(state, net), want, rtol=1e-12)
    i = jaxcomm.network.KINDS.index(kind)
    assert np.all(np.asarray(state.log.calls)[:, i] == 1)


@pytest.mark.parametrize(
    "net,ratio",
    [(Network(1e-3, 10e9), 0.001), (Network(0.0, 1e9), 0.1), (Network(1e-3, 1e8), 0.47)],
    ids=["allgather", "art_ring", "art_tree"],
)
def test_auto_runs_the_collective_the_model_chooses(net, ratio, request):
    big = {"w": (1000, 10)}
    d = 10000
    choice = jaxcomm.network.choose_collective(4 * d, N, math.ceil(ratio * d) / d, net)
    assert choice == request.node.callspec.id.split("-")[0]
    kind = {"allgather": "ag_topk", "art_ring": "art_ring", "art_tree": "art_tree"}[choice]
    mesh = jax.make_mesh((N,), ("data",))
    tx = jaxcomm.ar_topk("data", ratio=ratio, reduce="auto", network=net)
    params = {"w": jnp.zeros(big["w"])}

    def per_worker(g):
        _, s = tx.update({"w": g[0]}, tx.init(params), params)
        return jax.tree.map(lambda a: a[None], s)

    f = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    g = jax.random.normal(jax.random.key(0), (N, *big["w"]))
    state = f(jax.device_put(g, NamedSharding(mesh, P("data"))))
    calls = np.asarray(state.log.calls)[0]
    assert calls[jaxcomm.network.KINDS.index(kind)] == 1
    assert calls.sum() == 1


@settings(max_examples=60, deadline=None)
@given(
    nbytes=st.floats(1e3, 1e10),
    n=st.integers(2, 256),
    ratio=st.floats(1e-4, 1.0),
    latency=st.floats(0.0, 0.1),
    bandwidth=st.floats(1e6, 1e11),
)
def test_chooser_returns_the_argmin_of_the_modelled_costs(nbytes, n, ratio, latency, bandwidth):
    """Against the paper's formulas written out by hand (``tests/_alpha_beta.py``), not the
    library's cost table."""
    from _alpha_beta import hand_costs

    net = Network(latency, bandwidth)
    costs = hand_costs(nbytes, n, ratio, latency, bandwidth)
    choice = jaxcomm.network.choose_collective(nbytes, n, ratio, net)
    assert costs[choice] <= min(costs.values()) * (1 + 1e-9)


def test_nonfinite_gradient_reaches_the_update_of_every_worker():
    grads = _grads(1)
    grads = {**grads, "b": grads["b"].at[5, 0, 3].set(jnp.nan)}
    for tx in (
        jaxcomm.ar_topk("data", ratio=0.01),
        jaxcomm.ar_topk("data", ratio=0.01, select="var"),
        jaxcomm.lw_topk("data", ratio=0.01),
    ):
        ((u, _),) = _run(tx, grads, 1)
        assert np.all(~np.isfinite(_flat(u)).all(1))


def test_trains_a_linear_model_to_the_dense_loss():
    """STAR-Topk at 10% (5 of 50 entries per step) reaches the least-squares fit."""
    mesh = jax.make_mesh((N,), ("data",))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 64, 50)).astype(np.float32)
    w_true = rng.normal(size=(50,)).astype(np.float32)
    y = x @ w_true

    def loss(w, xb, yb):
        return jnp.mean((xb @ w - yb) ** 2)

    def train(tx, steps=300):
        def per_worker(w, xb, yb):  # w: replicated, as a user's parameters
            xb, yb = xb[0], yb[0]
            grad = jaxcomm.worker_grad(loss, "data")
            g0 = grad(w, xb, yb)  # this worker's own first gradient

            def step(carry, _):
                w, s = carry
                u, s = tx.update(grad(w, xb, yb), s, w)
                return (optax.apply_updates(w, u), s), None

            (w, _), _ = jax.lax.scan(step, (w, tx.init(w)), None, length=steps)
            return w, g0[None]

        f = jax.shard_map(
            per_worker, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"))
        )
        sharded = NamedSharding(mesh, P("data"))
        w, g0 = jax.jit(f)(jnp.zeros(50), jax.device_put(x, sharded), jax.device_put(y, sharded))
        g0 = np.asarray(g0)
        # The workers' gradients differ before aggregation, and are not their sum.
        assert np.min(np.abs(g0[:, None] - g0[None]).sum(-1) + np.eye(N)) > 1e-2
        local = np.stack([jax.grad(loss)(jnp.zeros(50), x[i], y[i]) for i in range(N)])
        np.testing.assert_allclose(g0, local, rtol=1e-5, atol=1e-5)
        w = np.asarray(w)
        return w, float(np.mean((x.reshape(-1, 50) @ w - y.reshape(-1)) ** 2))

    start = float(np.mean(y**2))
    w_sparse, sparse = train(optax.chain(jaxcomm.ar_topk("data", ratio=0.1), optax.sgd(0.05)))
    w_dense, dense = train(optax.chain(jaxcomm.dense_all_reduce("data"), optax.sgd(0.05)))
    assert dense < 1e-6 * start
    assert sparse < 1e-6 * start
    np.testing.assert_allclose(w_sparse, w_true, atol=1e-3)
    np.testing.assert_allclose(w_dense, w_true, atol=1e-3)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: jaxcomm.ar_topk("data", ratio=0.0), "ratio"),
        (lambda: jaxcomm.ar_topk("data", ratio=1.5), "ratio"),
        (lambda: jaxcomm.ar_topk("data", ratio=float("nan")), "ratio"),
        (lambda: jaxcomm.ar_topk("data", ratio=0.1, select="max"), "select"),
        (lambda: jaxcomm.ar_topk("data", ratio=0.1, reduce="psum"), "reduce"),
        (lambda: jaxcomm.ar_topk("data", ratio=0.1, reduce="auto"), "network"),
        (lambda: jaxcomm.ar_topk("data", ratio=0.1, reduce="auto", network="1ms"), "network"),
        (lambda: jaxcomm.ar_topk("data", ratio=0.1, method="sort"), "method"),
        (lambda: jaxcomm.lw_topk("data", ratio=-0.1), "ratio"),
        (lambda: jaxcomm.ms_topk("data", ratio=0.1, rounds=0), "rounds"),
        (lambda: Network(1e-3, 0.0), "bandwidth"),
        (lambda: Network(1e-3, -1e9), "bandwidth"),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


@pytest.mark.parametrize("make", [jaxcomm.ar_topk, jaxcomm.ms_topk])
def test_a_ratio_whose_k_rounds_to_zero_is_an_error(make):
    with pytest.raises(ValueError, match=r"less than one entry.*at least 1 / d"):
        _run(make("data", ratio=0.001), _grads(1), 1)  # 0.001 * 384 < 1


def test_k_is_the_decimal_ceiling():
    """``k = ceil(ratio * d)`` of the ratio as written: 0.07 of 100 entries is 7, although
    ``0.07 * 100`` is 7.000000000000001 in floating point."""
    from jaxcomm._src.sparse import ratio_k

    assert 0.07 * 100 > 7 and ratio_k(0.07, 100) == 7
    assert ratio_k(0.1, 96) == 10 and ratio_k(0.011, 1000) == 11 and ratio_k(1.0, 5) == 5
    assert ratio_k(0.29, 100) == 29 and ratio_k(0.57, 100) == 57


@pytest.mark.parametrize("make", [jaxcomm.lw_topk, jaxcomm.ms_topk])
def test_allgather_sum_is_added_in_rank_order_and_bit_identical(make):
    """Entries several workers send at the same index are summed worker 0, 1, ... in float32
    on every device: the updates equal a NumPy accumulation in that order bit for bit, and
    every worker holds the same bits."""
    rng = np.random.default_rng(3)
    grads = {  # the same large entries on every worker, plus each worker's own noise
        k: jnp.asarray(rng.normal(size=(1, 1, *s)) * 1e3 + rng.normal(size=(N, 1, *s)), jnp.float32)
        for k, s in SHAPES.items()
    }
    ((u, state),) = _run(make("data", ratio=0.1), grads, 1)
    g = _flat(jax.tree.map(lambda a: a[:, 0], grads))
    kept = g - np.asarray(state.residual)  # what each worker sent, zero elsewhere
    sent = [np.flatnonzero(kept[w]) for w in range(N)]
    assert set.intersection(*(set(x.tolist()) for x in sent))  # indices shared by all
    total = np.zeros(g.shape[1], np.float32)
    for w in range(N):
        total[sent[w]] += kept[w, sent[w]]
    got = _flat(u)
    for w in range(N):
        np.testing.assert_array_equal(got[w], total / np.float32(N))


@pytest.mark.parametrize("shape", ["normal", "ties", "nan", "inf_and_nan"])
@pytest.mark.parametrize("ratio", [0.001, 0.1, 0.75])
def test_the_off_cpu_branch_selects_the_same_set_as_the_host_kernel(shape, ratio):
    """``"sample"`` and ``"auto"`` run the 31-round threshold search off the CPU: it must
    pick the same set (the largest magnitude bit patterns, NaN and Inf above every finite
    value, ties to the lower index), with no index twice."""
    from jaxcomm._src.codecs import EXACT_ROUNDS, _threshold_indices

    rng = np.random.default_rng(7)
    d = 5000
    k = max(1, int(ratio * d))
    x = rng.normal(size=d).astype(np.float32)
    if shape == "ties":
        x = (np.round(x * 2) / 2).astype(np.float32)
    elif shape == "nan":
        x[rng.integers(0, d, size=k + 3)] = np.nan
    elif shape == "inf_and_nan":
        x[[5, 900]], x[[17, 4000]] = np.nan, -np.inf
    got = np.asarray(jax.jit(lambda v: _threshold_indices(jnp.abs(v), k, EXACT_ROUNDS))(x))
    assert len(set(got.tolist())) == k
    np.testing.assert_array_equal(np.sort(got), _magnitude_order_reference(x, k))
    small = np.array([0.0, 0.0, np.nan, 1.0], np.float32)  # the largest finite is kept
    for kk, want in ((3, [0, 2, 3]), (4, [0, 1, 2, 3])):
        out = np.asarray(_threshold_indices(jnp.abs(jnp.asarray(small)), kk, EXACT_ROUNDS))
        assert sorted(out.tolist()) == want


def test_auto_takes_the_exact_sort_for_integers():
    """Integers above 2**24 that float32 cannot tell apart: ``auto`` must not round them."""
    x = jnp.arange(70_000, dtype=jnp.int32) * 97 % 65_536
    x = x.at[69_996:69_999].set(2**25).at[69_999].set(2**25 + 1)  # the largest, last
    got = sorted(np.asarray(jaxcomm.codecs.topk_indices(x, 3, method="auto")).tolist())
    want = sorted(np.asarray(lax.top_k(jnp.abs(x), 3)[1]).tolist())
    assert got == want


def test_topk_indices_defaults_to_the_selection_topk_encode_makes():
    """``topk_indices(x, k)`` and ``topk_encode(x, k=k)`` choose the same entries by default
    (one automatic, exact selection; not ``lax.top_k`` on one and the host kernel on the
    other)."""
    x = jax.random.normal(jax.random.key(3), (1 << 16,))
    for k in (1, 100, 3000):
        got = np.sort(np.asarray(jaxcomm.codecs.topk_indices(x, k)))
        want = np.sort(np.asarray(jaxcomm.codecs.topk_encode(x, k=k).indices))
        np.testing.assert_array_equal(got, want)
        exact = np.sort(np.argsort(-np.abs(np.asarray(x)), kind="stable")[:k])
        np.testing.assert_array_equal(got, exact)
    # The same program as the automatic choice (on the CPU at this size, the host kernel).
    default = jax.jit(lambda v: jaxcomm.codecs.topk_indices(v, 100)).lower(x).as_text()
    auto = jax.jit(lambda v: jaxcomm.codecs.topk_indices(v, 100, method="auto")).lower(x).as_text()
    assert default == auto
