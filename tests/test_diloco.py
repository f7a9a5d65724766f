"""DiLoCo / Streaming DiLoCo (jaxcomm.diloco) against an independent numpy simulation, and
the chunk-wise top-k codec and aggregator (SparseLoCo's compressor)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# The local SGD tests' per-worker quadratics (the gradient depends on the parameters, so a
# wrong merge or outer step changes the trajectory).
from test_localsgd import LAYERS, SHAPES, N, _loss, _problem  # noqa: E402

import jaxcomm
from jaxcomm._src.network import as_bytes, find_logs, merge_logs


def _run(tx, steps, *, seed=0, dense=False):
    """``steps`` user steps per worker (``worker_grad`` inside ``shard_map``, per-worker
    parameters); returns the parameters after every step ``[T, N, ...]`` and the state.
    ``dense``: ``tx`` gets the workers' mean gradient (synchronous data parallelism)."""
    mesh = jax.make_mesh((N,), ("data",))
    a, y, p0 = _problem(seed)

    def per_worker(a, y, p):
        a, y, p = (jax.tree_util.tree_map(lambda v: v[0], t) for t in (a, y, p))
        state = tx.init(p)
        history = []
        for _ in range(steps):
            g = jaxcomm.worker_grad(_loss, "data")(p, a, y)
            if dense:
                g = jax.tree_util.tree_map(lambda v: jax.lax.pmean(v, "data"), g)
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
        )
    )
    sharded = NamedSharding(mesh, P("data"))
    stacked = jax.tree_util.tree_map(lambda v: np.broadcast_to(v, (N, *v.shape)), p0)
    put = lambda t: jax.device_put(t, sharded)  # noqa: E731
    hist, state = f(put(a), put(y), put(stacked))
    return jax.tree_util.tree_map(np.asarray, hist), state


# --------------------------------------------------------------------------- reference


class _NumpyDiLoCo:
    """DiLoCo / Streaming DiLoCo written out from the papers, in float64 numpy.

    Inner: SGD or Adam per worker. Outer: SGD with Nesterov momentum (PyTorch's form:
    ``b <- mu b + delta``, ``theta <- theta - lr (delta + mu b)``). Fragment ``p`` of ``F``
    holds layers ``p, p + F, ...`` and is synchronised at local step ``(p + 1) H // F - 1``;
    ``tau`` steps later each worker mixes ``alpha * local + (1 - alpha) * theta``. A warm
    start of ``warmup`` steps steps every worker on the workers' mean gradient and sets
    ``theta`` to the result; the periods count from its end.
    """

    def __init__(self, p0, *, inner, lr, H, F=1, tau=0, alpha=0.0, outer_lr=0.7, mu=0.9, warmup=0):
        self.theta = {k: v.astype(np.float64) for k, v in p0.items()}
        self.local = [{k: v.copy() for k, v in self.theta.items()} for _ in range(N)]
        self.inner, self.lr, self.H, self.F, self.tau, self.alpha = inner, lr, H, F, tau, alpha
        self.outer_lr, self.mu, self.warmup = outer_lr, mu, warmup
        self.buf = {k: np.zeros_like(v) for k, v in self.theta.items()}
        self.m = [{k: np.zeros_like(v) for k, v in self.theta.items()} for _ in range(N)]
        self.v = [{k: np.zeros_like(v) for k, v in self.theta.items()} for _ in range(N)]
        self.t = 0
        self.frags = [[LAYERS[i] for i in range(p, len(LAYERS), F)] for p in range(F)]
        self.sync_at = [(p + 1) * H // F - 1 for p in range(F)]

    def step(self, a, y):
        self.t += 1
        warm = self.t <= self.warmup
        grads = [
            {k: a[k][w] * (a[k][w] * self.local[w][k] - y[k][w]) for k in SHAPES} for w in range(N)
        ]
        if warm:  # data parallelism: every worker steps on the mean gradient
            mean = {k: np.mean([g[k] for g in grads], axis=0) for k in SHAPES}
            grads = [mean] * N
        for w in range(N):
            for k in SHAPES:
                p = self.local[w][k]
                g = grads[w][k]
                if self.inner == "sgd":
                    self.local[w][k] = p - self.lr * g
                else:
                    m = self.m[w][k] = 0.9 * self.m[w][k] + 0.1 * g
                    v = self.v[w][k] = 0.999 * self.v[w][k] + 0.001 * g * g
                    mhat, vhat = m / (1 - 0.9**self.t), v / (1 - 0.999**self.t)
                    self.local[w][k] = p - self.lr * mhat / (np.sqrt(vhat) + 1e-8)
        if warm:
            self.theta = {k: v.copy() for k, v in self.local[0].items()}
            return
        t = self.t - 1 - self.warmup  # steps since the periods began
        h = t % self.H
        for frag, at in zip(self.frags, self.sync_at, strict=True):
            if h == at:
                for k in frag:
                    delta = self.theta[k] - np.mean([loc[k] for loc in self.local], axis=0)
                    self.buf[k] = self.mu * self.buf[k] + delta
                    self.theta[k] = self.theta[k] - self.outer_lr * (delta + self.mu * self.buf[k])
            if h == (at + self.tau) % self.H and t >= self.tau:
                for k in frag:
                    for loc in self.local:
                        loc[k] = self.alpha * loc[k] + (1 - self.alpha) * self.theta[k]


@pytest.mark.parametrize(
    "inner, kw",
    [
        ("sgd", dict(period=3)),
        ("adam", dict(period=4)),
        ("adam", dict(period=4, fragments=2, layers=LAYERS)),
        ("sgd", dict(period=6, fragments=3, layers=LAYERS, overlap=1)),
        ("adam", dict(period=4, fragments=2, layers=LAYERS, overlap=2, alpha=0.25)),
        ("adam", dict(period=4, warmup=3)),
        ("sgd", dict(period=4, fragments=2, layers=LAYERS, overlap=1, warmup=2)),
    ],
)
def test_diloco_matches_an_independent_numpy_simulation(inner, kw):
    """Every worker's parameters after every step, and theta_sync, equal the numpy
    simulation of the papers' algorithm (DiLoCo's Nesterov outer step, Streaming DiLoCo's
    staggered strided fragments and delayed mixing, a data-parallel warm start)."""
    steps, lr = 13, 0.02
    make = optax.sgd(lr) if inner == "sgd" else optax.adam(lr)
    hist, state = _run(jaxcomm.diloco(make, "data", **kw), steps)
    a, y, p0 = _problem()
    overlap = kw.get("overlap", 0)
    ref = _NumpyDiLoCo(
        p0,
        inner=inner,
        lr=lr,
        H=kw["period"],
        F=kw.get("fragments", 1),
        tau=overlap,
        alpha=kw.get("alpha", 0.5 if overlap else 0.0),
        warmup=kw.get("warmup", 0),
    )
    for t in range(steps):
        ref.step(a, y)
        for k in SHAPES:
            want = np.stack([loc[k] for loc in ref.local])
            np.testing.assert_allclose(hist[k][t], want, rtol=2e-5, atol=2e-5, err_msg=f"{t} {k}")
    for k in SHAPES:
        anchor = np.asarray(state.anchor[k])
        assert np.all(anchor == anchor[0:1])  # identical on every worker
        np.testing.assert_allclose(anchor[0], ref.theta[k], rtol=2e-5, atol=2e-5)
    # The workers diverge between synchronisations (local steps on their own data).
    assert np.max(np.abs(hist["out"][-1] - hist["out"][-1][0:1])) > 1e-3


@pytest.mark.parametrize("inner", ["sgd", "momentum"])
def test_period_one_with_unit_outer_sgd_is_data_parallel(inner):
    make = {"sgd": lambda: optax.sgd(0.05), "momentum": lambda: optax.sgd(0.05, momentum=0.9)}
    tx = jaxcomm.diloco(make[inner](), "data", period=1, outer=optax.sgd(1.0))
    hist, _ = _run(tx, 6)
    sync, _ = _run(make[inner](), 6, dense=True)
    for k in SHAPES:
        np.testing.assert_allclose(hist[k], sync[k], rtol=1e-5, atol=1e-6)
    # ... and the default Nesterov outer step is not.
    other, _ = _run(jaxcomm.diloco(make[inner](), "data", period=1), 6)
    assert np.max(np.abs(other["out"] - sync["out"])) > 1e-3


def test_steps_between_synchronisations_are_the_inner_optimizers_own():
    """Until the first synchronisation each worker's parameters are those of the inner
    optimizer run alone on its own gradients (to XLA's fusion of the same arithmetic); the
    inner state stays local."""
    inner = optax.adam(0.01)
    hist, state = _run(jaxcomm.diloco(inner, "data", period=5), 4)
    alone, alone_state = _run(
        optax.chain(optax.identity(), inner), 4
    )  # identity: per-worker gradients, no averaging
    for k in SHAPES:
        np.testing.assert_allclose(hist[k], alone[k], rtol=1e-6, atol=1e-7)
    mu = np.asarray(state.inner[0].mu["out"])
    assert np.max(np.abs(mu - mu[0:1])) > 1e-4


def _step_bytes(tx, steps):
    """Bytes each step sent per worker (from the logs)."""
    mesh = jax.make_mesh((N,), ("data",))
    a, y, p0 = _problem()

    def per_worker(a, y, p):
        a, y, p = (jax.tree_util.tree_map(lambda v: v[0], t) for t in (a, y, p))
        state, sent = tx.init(p), []
        for _ in range(steps):
            g = jaxcomm.worker_grad(_loss, "data")(p, a, y)
            u, state = tx.update(g, state, p)
            p = optax.apply_updates(p, u)
            sent.append(merge_logs(*find_logs(state)).sent_bytes)
        return jnp.stack(sent)[None]

    f = jax.jit(
        jax.shard_map(per_worker, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data"))
    )
    stacked = jax.tree_util.tree_map(lambda v: np.broadcast_to(v, (N, *v.shape)), p0)
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))  # noqa: E731
    return as_bytes(np.asarray(f(put(a), put(y), put(stacked))))[0]


def test_fragments_divide_the_peak_and_keep_the_total():
    """Plain DiLoCo sends the whole model at one step of the period; three fragments send a
    third each at three steps: the peak falls to the largest fragment, the bytes per period
    stay the same up to each ring's segment padding."""
    plain = _step_bytes(jaxcomm.diloco(optax.sgd(0.01), "data", period=6, reduce="psum"), 12)
    frag = _step_bytes(
        jaxcomm.diloco(
            optax.sgd(0.01), "data", period=6, layers=LAYERS, fragments=3, reduce="psum"
        ),
        12,
    )
    d = sum(int(np.prod(s)) for s in SHAPES.values())
    # psum is logged with a ring's bytes: 2 (N - 1) segments of ceil(d / N) floats.
    assert list(np.nonzero(plain)[0]) == [5, 11]
    assert plain[5] == 2 * (N - 1) * -(-d // N) * 4
    assert list(np.nonzero(frag)[0]) == [1, 3, 5, 7, 9, 11]
    per_layer = [2 * (N - 1) * -(-int(np.prod(SHAPES[k])) // N) * 4 for k in LAYERS]
    assert sorted(frag[[1, 3, 5]].tolist()) == sorted(per_layer)  # one layer per fragment here
    assert frag.max() < plain.max() and frag.sum() <= plain.sum() * 1.2  # segment padding


def test_streaming_schedule():
    s = jaxcomm.schedules.streaming_schedule(6, 6, 3)
    assert s.groups == ((), (3, 0), (), (4, 1), (), (5, 2))
    s = jaxcomm.schedules.streaming_schedule(5, 4, 2, pattern="sequential")
    assert s.groups == ((), (2, 1, 0), (), (4, 3))
    # A DreamDDP-style schedule whose groups are disjoint works as fragments.
    tx = jaxcomm.diloco(
        optax.sgd(0.02), "data", period=3, layers=LAYERS, schedule=((2,), (), (1, 0))
    )
    hist, _ = _run(tx, 3)
    assert np.all(hist["out"][0] == hist["out"][0][0:1])  # "out" synchronised at step 0
    assert np.max(np.abs(hist["emb"][0] - hist["emb"][0][0:1])) > 1e-4


def test_bad_arguments():
    sgd = optax.sgd(0.1)
    with pytest.raises(ValueError, match=r"period must be an integer in \[1, inf\], got 0"):
        jaxcomm.diloco(sgd, "data", period=0)
    with pytest.raises(TypeError, match="outer must be an optax.GradientTransformation"):
        jaxcomm.diloco(sgd, "data", period=2, outer=0.7)
    with pytest.raises(TypeError, match="aggregate must be an optax.GradientTransformation"):
        jaxcomm.diloco(sgd, "data", period=2, aggregate="ring")
    with pytest.raises(ValueError, match=r"overlap must be an integer in \[0, 3\], got 4"):
        jaxcomm.diloco(sgd, "data", period=4, overlap=4)
    with pytest.raises(ValueError, match="alpha must be a finite number in"):
        jaxcomm.diloco(sgd, "data", period=4, alpha=1.0)
    with pytest.raises(ValueError, match="fragments=4 exceeds the model's 3 layers"):
        jaxcomm.schedules.streaming_schedule(3, 8, 4)
    with pytest.raises(ValueError, match="fragments=3 exceeds period=2"):
        jaxcomm.schedules.streaming_schedule(3, 2, 3)
    with pytest.raises(ValueError, match="fragments=2 splits the model by layers: pass layers="):
        jaxcomm.diloco(sgd, "data", period=2, fragments=2)
    with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation"):
        jaxcomm.diloco(None, "data", period=2)
    with pytest.raises(ValueError, match="each layer must be in exactly one group"):
        _run(jaxcomm.diloco(sgd, "data", period=2, layers=LAYERS, schedule=((2, 1), (1, 0))), 1)
    with pytest.raises(ValueError, match="schedule has 2 steps, but period=3"):
        jaxcomm.diloco(sgd, "data", period=3, layers=LAYERS, schedule=((2, 1), (0,)))
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 16\], got 0"):
        jaxcomm.chunk_topk("data", chunk=16, k=0)
    # Arguments that the others make meaningless are refused, not ignored.
    agg = jaxcomm.chunk_topk("data", chunk=16, k=2)
    with pytest.raises(ValueError, match="reduce='tree' picks the default aggregator"):
        jaxcomm.diloco(sgd, "data", period=2, aggregate=agg, reduce="tree")
    with pytest.raises(ValueError, match="pattern='sequential' shapes the fragments"):
        jaxcomm.diloco(sgd, "data", period=2, layers=LAYERS, schedule=((0, 1, 2), ()),
                       pattern="sequential")  # fmt: skip
    with pytest.raises(ValueError, match="give either schedule or fragments"):
        jaxcomm.schedules.diloco_steps(
            6, fragments=3, schedule=jaxcomm.schedules.streaming_schedule(3, 6, 3)
        )


def test_the_step_helpers_follow_the_fragment_count_as_diloco_does():
    """``diloco_steps``/``diloco_branch`` given ``fragments`` (as :func:`jaxcomm.diloco`
    is) give the same synchronisation steps as the layer schedule the transform builds,
    whatever the layer count or pattern; without it, one fragment."""
    for layers, frags, pattern in ((6, 3, "strided"), (7, 3, "sequential"), (5, 5, "strided")):
        sched = jaxcomm.schedules.streaming_schedule(layers, 10, frags, pattern=pattern)
        for overlap in (0, 2):
            want = jaxcomm.schedules.diloco_steps(10, schedule=sched, overlap=overlap)
            assert jaxcomm.schedules.diloco_steps(10, fragments=frags, overlap=overlap) == want
            got = [jaxcomm.schedules.diloco_branch(10, t, fragments=frags, overlap=overlap) for t in
                   range(20)]  # fmt: skip
            assert got == [jaxcomm.schedules.diloco_branch(10, t, schedule=sched, overlap=overlap)
                           for t in range(20)]  # fmt: skip
    assert [s for s, _ in jaxcomm.schedules.diloco_steps(6, fragments=3)] == [-1, 0, -1, 1, -1, 2]
    assert [s for s, _ in jaxcomm.schedules.diloco_steps(6)] == [-1, -1, -1, -1, -1, 0]


# --------------------------------------------------------------------------- chunk top-k


def _chunk_reference(x, chunk, k):
    """Per chunk, the k largest magnitudes (ties to the lower index), as a dense array."""
    flat = np.asarray(x, np.float32).reshape(-1)
    d = flat.size
    padded = np.concatenate([flat, np.zeros((-d) % chunk, np.float32)]).reshape(-1, chunk)
    out = np.zeros_like(padded)
    for c, row in enumerate(padded):
        order = sorted(range(chunk), key=lambda i: (-abs(row[i]), i))[:k]
        out[c, order] = row[order]
    return out.reshape(-1)[:d].reshape(np.shape(x))


@settings(max_examples=30, deadline=None)
@given(
    d=st.integers(1, 300),
    chunk=st.sampled_from([2, 3, 16, 64, 100]),
    frac=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_chunk_topk_keeps_each_chunks_largest(d, chunk, frac, seed, ties):
    k = max(1, min(chunk, int(frac * chunk)))
    rng = np.random.default_rng(seed)
    x = rng.normal(size=d).astype(np.float32)
    if ties:
        x = np.round(x * 2) / 2  # many equal magnitudes
    # Jitted: one compile a shape instead of one for each operation (4x faster here).
    encode = jax.jit(functools.partial(jaxcomm.codecs.chunk_topk_encode, chunk=chunk, k=k))
    p = encode(jnp.asarray(x))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(jaxcomm.codecs.chunk_topk_decode)(p)), _chunk_reference(x, chunk, k)
    )
    # Bytes: positions in ceil(log2 chunk) bits, float32 values.
    chunks = -(-d // chunk)
    bits = max(1, int(np.ceil(np.log2(chunk))))
    assert jaxcomm.codecs.payload_bytes(p) == -(-chunks * k * bits // 8) + 4 * chunks * k


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(1, 31), n=st.integers(0, 70), seed=st.integers(0, 2**16))
def test_pack_uints_round_trips(bits, n, seed):
    v = np.random.default_rng(seed).integers(0, 2**bits, size=n, dtype=np.uint64).astype(np.uint32)
    packed = jax.jit(jaxcomm.codecs.pack_uints, static_argnums=1)(jnp.asarray(v), bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (-(-n * bits // 8),)
    unpack = jax.jit(jaxcomm.codecs.unpack_uints, static_argnums=(1, 2))
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits, n)), v)


def test_chunk_topk_two_bit_values_and_a_nan_anywhere():
    x = np.random.default_rng(0).normal(size=4096 * 3 + 17).astype(np.float32)
    p = jaxcomm.codecs.chunk_topk_encode(jnp.asarray(x), chunk=4096, k=64, bits=2)
    # SparseLoCo's payload: 64 12-bit positions, 64 2-bit codes and one scale per chunk.
    assert jaxcomm.codecs.payload_bytes(p) == 4 * (64 * 12 // 8 + 64 * 2 // 8 + 4)
    dense = np.asarray(jaxcomm.codecs.chunk_topk_decode(p))
    kept = _chunk_reference(x, 4096, 64)
    assert np.array_equal(dense != 0, kept != 0)  # the same positions
    scale = np.abs(kept).reshape(-1)[: 4096 * 3].reshape(3, 4096).max(1)
    levels = dense[: 4096 * 3].reshape(3, 4096) / scale[:, None]
    assert set(np.round(levels[levels != 0] * 3).astype(int)) <= {-3, -1, 1, 3}
    np.testing.assert_allclose(dense, _two_bit_reference(kept, 4096), rtol=1e-6, atol=0)
    encode = jax.jit(
        lambda v: jaxcomm.codecs.chunk_topk_decode(
            jaxcomm.codecs.chunk_topk_encode(v, chunk=4096, k=64, bits=2)
        )
    )
    for at in (0, 4095, 4096, 5000, len(x) - 1):  # never among the kept entries: small
        bad = x.copy()
        bad[at] = np.nan
        small = np.argsort(np.abs(x[(at // 4096) * 4096 :][:4096]))[0] + (at // 4096) * 4096
        bad[small] = np.nan
        out = np.asarray(encode(jnp.asarray(bad)))
        chunk = slice((at // 4096) * 4096, min(len(x), (at // 4096 + 1) * 4096))
        sent = out[chunk][out[chunk] != 0]  # NaN != 0
        assert len(sent) == min(64, len(out[chunk])) and np.all(~np.isfinite(sent))
        others = np.ones(len(x), bool)
        others[chunk] = False
        assert np.all(np.isfinite(out[others]))


def _two_bit_reference(kept, chunk):
    """Each chunk's kept entries on the grid ``{-1, -1/3, 1/3, 1} * max|kept|`` by nearest
    level, computed by distances to the four levels (float64)."""
    kept = np.asarray(kept, np.float64).reshape(-1)
    d = len(kept)
    rows = np.pad(kept, (0, (-d) % chunk)).reshape(-1, chunk)
    out = np.zeros_like(rows)
    for c, row in enumerate(rows):
        s = np.max(np.abs(row))
        if s == 0:
            continue
        levels = s * np.array([-1.0, -1 / 3, 1 / 3, 1.0])
        nz = row != 0
        out[c, nz] = levels[np.argmin(np.abs(row[nz, None] - levels[None]), axis=1)]
    return out.reshape(-1)[:d]


def test_diloco_with_sparseloco_matches_a_numpy_simulation():
    """DiLoCo with SparseLoCo's compressor, against float64 numpy: each worker's
    pseudo-gradient plus its decayed error buffer is cut to the top-2 of every 8 entries
    of the flattened model (leaves in tree order), put on the 2-bit grid, averaged, and
    applied by outer SGD 1.0; the buffer keeps what was not sent. Every worker's
    parameters after every step and theta_sync match."""
    period, steps, lr, decay = 2, 6, 0.05, 0.9
    tx = jaxcomm.diloco(
        optax.sgd(lr),
        "data",
        period=period,
        outer=optax.sgd(1.0),
        aggregate=jaxcomm.chunk_topk("data", chunk=8, k=2, bits=2, decay=decay),
    )
    hist, state = _run(tx, steps)
    a, y, p0 = _problem()
    keys = sorted(SHAPES)  # jax flattens a dict by sorted keys
    sizes = [int(np.prod(SHAPES[k])) for k in keys]

    def flat(tree):
        return np.concatenate([np.asarray(tree[k], np.float64).reshape(-1) for k in keys])

    def unflat(v):
        parts = np.split(v, np.cumsum(sizes)[:-1])
        return {k: p.reshape(SHAPES[k]) for k, p in zip(keys, parts, strict=True)}

    theta = flat(p0)
    local = [theta.copy() for _ in range(N)]
    error = [np.zeros_like(theta) for _ in range(N)]
    for t in range(steps):
        for w in range(N):
            p = unflat(local[w])
            g = {k: a[k][w] * (a[k][w] * p[k] - y[k][w]) for k in keys}
            local[w] = local[w] - lr * flat(g)
        if t % period == period - 1:
            sent = []
            for w in range(N):
                error[w] = decay * error[w] + (theta - local[w])
                c = _two_bit_reference(_chunk_reference(error[w], 8, 2), 8)
                error[w] = error[w] - c
                sent.append(c)
            theta = theta - np.mean(sent, axis=0)
            local = [theta.copy() for _ in range(N)]
        got = np.stack([flat({k: hist[k][t][w] for k in keys}) for w in range(N)])
        np.testing.assert_allclose(got, np.stack(local), rtol=1e-5, atol=1e-6, err_msg=str(t))
    np.testing.assert_allclose(
        flat({k: np.asarray(state.anchor[k])[0] for k in keys}), theta, rtol=1e-5, atol=1e-6
    )
    assert np.abs(theta - flat(p0)).max() > 1e-3  # the outer steps moved the model


def test_chunk_topk_error_feedback_keeps_what_it_did_not_send():
    """Over steps, ``residual_new = decay * residual + g - sent`` exactly (sent = the
    decoded payload), and the updates are the mean of every worker's decoded payload."""
    mesh = jax.make_mesh((N,), ("data",))
    tx = jaxcomm.chunk_topk("data", chunk=8, k=2, bits=2, decay=0.5)
    g = np.random.default_rng(1).normal(size=(3, N, 21)).astype(np.float32)

    def per_worker(g):
        state, out = tx.init({"x": g[0, 0]}), []
        for t in range(3):
            before = state.residual
            u, state = tx.update({"x": g[t, 0]}, state)
            out.append((before, state.residual, u["x"]))
        return jax.tree_util.tree_map(lambda *a: jnp.stack(a)[None], *out)

    f = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=P(None, "data"), out_specs=P("data")))
    before, after, u = (
        np.asarray(a) for a in f(jax.device_put(g, NamedSharding(mesh, P(None, "data"))))
    )
    for t in range(3):
        e = 0.5 * before[:, t] + g[t]
        sent = np.stack(
            [
                np.asarray(
                    jaxcomm.codecs.chunk_topk_decode(
                        jaxcomm.codecs.chunk_topk_encode(v, chunk=8, k=2, bits=2)
                    )
                )
                for v in e
            ]
        )
        np.testing.assert_allclose(after[:, t], e - sent, rtol=0, atol=1e-6)
        np.testing.assert_allclose(u[:, t], np.broadcast_to(sent.mean(0), u[:, t].shape), atol=1e-6)
        assert np.all(u[:, t] == u[0:1, t])  # identical on every worker


def _chunk_positions(x, chunk, k):
    """Per chunk, where the k largest magnitudes are (ties to the lower index): bool."""
    flat = np.asarray(x, np.float32).reshape(-1)
    d = flat.size
    padded = np.concatenate([flat, np.zeros((-d) % chunk, np.float32)]).reshape(-1, chunk)
    out = np.zeros(padded.shape, bool)
    for c, row in enumerate(padded):
        out[c, sorted(range(chunk), key=lambda i: (-abs(row[i]), i))[:k]] = True
    return out.reshape(-1)[:d]


@pytest.mark.parametrize("bits", [None, 2])
def test_chunk_topk_averages_over_all_workers_or_over_the_senders(bits):
    """``average="workers"`` divides the summed payloads by N (SparseLoCo's equation);
    ``"senders"`` divides each entry by the number of workers that sent it (the authors'
    code): checked against numpy with an entry only worker 0 sends, one every worker sends
    and entries no one sends. Both send the same payload: the same logged and compiled
    bytes."""
    mesh = jax.make_mesh((N,), ("data",))
    g = np.random.default_rng(3).normal(size=(N, 21)).astype(np.float32)
    g[:, 3] = 1e-4
    g[0, 3] = 50.0  # only worker 0 sends entry 3
    g[:, 12] = 40.0 + np.arange(N)  # every worker sends entry 12
    put = jax.device_put(g, NamedSharding(mesh, P("data")))
    out, sent_bytes = {}, {}
    for average in ("workers", "senders"):
        tx = jaxcomm.chunk_topk("data", chunk=8, k=2, bits=bits, average=average)

        def per_worker(g, tx=tx):
            u, state = tx.update({"x": g[0]}, tx.init({"x": g[0]}))
            return u["x"][None], jnp.asarray(merge_logs(*find_logs(state)).sent_bytes)[None]

        f = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        u, logged = f(put)
        out[average] = np.asarray(u)
        audit = jaxcomm.wire_audit(f.lower(put)).traffic().sent
        sent_bytes[average] = (as_bytes(np.asarray(logged)).tolist(), audit.tolist())
        assert np.all(out[average] == out[average][0:1])  # identical on every worker
    assert sent_bytes["workers"] == sent_bytes["senders"]
    masks = np.stack([_chunk_positions(x, 8, 2) for x in g])
    sent = np.stack(
        [
            np.where(m, x, 0.0)
            if bits is None
            else _two_bit_reference(_chunk_reference(x, 8, 2), 8)
            for x, m in zip(g, masks, strict=True)
        ]
    )
    count = masks.sum(0)
    assert count[3] == 1 and count[12] == N and np.any(count == 0) and np.any(count > 1)
    total = sent.sum(0)
    np.testing.assert_allclose(out["workers"][0], total / N, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        out["senders"][0], np.where(count > 0, total / np.maximum(count, 1), 0.0), atol=1e-5
    )
    assert out["senders"][0, 3] == pytest.approx(N * out["workers"][0, 3], rel=1e-6)
    assert out["senders"][0, 3] == pytest.approx(sent[0, 3], rel=1e-6)  # worker 0's own value


def test_sparseloco_wire_is_141x_below_fp32_in_the_compiled_program():
    """The all-gather in the compiled DiLoCo step carries SparseLoCo's packed payload:
    per worker and chunk of 4096, 96 bytes of positions, 16 of codes and a 4-byte scale."""
    mesh = jax.make_mesh((N,), ("data",))
    d = 4096 * 4
    tx = jaxcomm.diloco(
        optax.sgd(0.1),
        "data",
        period=1,
        outer=optax.sgd(1.0),
        aggregate=jaxcomm.chunk_topk("data", decay=0.95),
    )

    def per_worker(g, p):
        g, p = g[0], p[0]
        u, s = tx.update({"x": g}, tx.init({"x": p}), {"x": p})
        return u["x"][None], jax.tree_util.tree_map(lambda a: a[None], s)

    f = jax.jit(
        jax.shard_map(per_worker, mesh=mesh, in_specs=(P("data"),) * 2, out_specs=P("data"))
    )
    g = np.random.default_rng(0).normal(size=(N, d)).astype(np.float32)
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))  # noqa: E731
    audit = jaxcomm.wire_audit(f.lower(put(g), put(np.zeros((N, d), np.float32))))
    payload = 4 * (96 + 16 + 4)  # 141x below one float32 copy (4 x 16,384 bytes)
    assert audit.traffic().sent.tolist() == [(N - 1) * payload] * N


def test_the_docs_block_runs_as_printed():
    """The DiLoCo block of docs/algorithms/diloco.md, executed as printed: its construction
    as it stands, its step lines inside ``shard_map`` with per-worker parameters, for one
    period of 30 steps.
    Each of the three fragments is synchronised once, at steps 9, 19 and 29, over 4-bit
    codes; theta_sync is the same on every worker and has moved."""
    import pathlib

    import models

    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "algorithms" / "diloco.md"
    block = page.read_text().split("<!-- diloco:begin -->")[1].split("<!-- diloco:end -->")[0]
    code = block.split("```py\n")[1].split("```")[0]
    build, step = code.split("# inside jax.shard_map")
    step = "\n".join(step.splitlines()[1:])  # the lines after that comment
    rng = np.random.default_rng(0)
    shapes = {"embed": (5, 3), "block_0": (3, 3), "block_1": (3, 3), "head": (3, 2)}
    params0 = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    ns = {"models": models, "jaxcomm": jaxcomm, "optax": optax, "params": params0}
    exec(compile(build, "diloco.md", "exec"), ns)  # noqa: S102
    tx = ns["tx"]

    def loss_fn(p, batch):
        h = batch @ p["embed"]
        h = jnp.tanh(h @ p["block_0"])
        h = jnp.tanh(h @ p["block_1"])
        return jnp.mean((h @ p["head"]) ** 2)

    def per_worker(params, batches):
        params = jax.tree_util.tree_map(lambda a: a[0], params)

        def one_step(carry, batch):  # the page's lines, as printed, as one step of a scan
            params, opt_state = carry
            scope = {"jaxcomm": jaxcomm, "optax": optax, "loss_fn": loss_fn, "tx": tx}
            scope.update(params=params, opt_state=opt_state, batch=batch)
            exec(compile(step, "diloco.md", "exec"), scope)  # noqa: S102
            params, opt_state = scope["params"], scope["opt_state"]
            sent = merge_logs(*find_logs(opt_state)).sent_bytes
            return (params, opt_state), (scope["synchronised"], sent)

        start = (params, tx.init(params))
        (params, _), (synchronised, sent) = jax.lax.scan(one_step, start, batches[0])
        synchronised = jax.tree_util.tree_map(lambda a: a[-1], synchronised)  # the last step's
        lead = lambda tree: jax.tree_util.tree_map(lambda a: a[None], tree)  # noqa: E731
        return lead(params), lead(synchronised), sent[None]

    mesh = jax.make_mesh((N,), ("data",))
    f = jax.jit(
        jax.shard_map(per_worker, mesh=mesh, in_specs=(P("data"),) * 2, out_specs=P("data"))
    )
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))  # noqa: E731
    stacked = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), params0)
    batches = rng.normal(size=(N, 30, 4, 5)).astype(np.float32)
    params, anchor, sent = f(put(stacked), put(batches))
    sent = as_bytes(np.asarray(sent))[0]
    assert list(np.nonzero(sent)[0]) == [9, 19, 29]
    for k in shapes:
        a, p = np.asarray(anchor[k]), np.asarray(params[k])
        assert np.all(a == a[0:1]) and np.all(np.isfinite(p))
        assert not np.allclose(a[0], np.asarray(params0[k]))
