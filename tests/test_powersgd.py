"""PowerSGD against an independent numpy implementation of the paper's algorithm."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

N = 8
SHAPES = {"b": (6,), "conv": (3, 2, 5), "w": (12, 9), "wide": (2, 3)}


def _gram_schmidt(p):
    p = p.copy()
    for i in range(p.shape[1]):
        for j in range(i):
            p[:, i] -= (p[:, j] @ p[:, i]) * p[:, j]
        p[:, i] /= np.sqrt(p[:, i] @ p[:, i]) + 1e-8
    return p


def _reference(grads, rank, seed, steps):
    """numpy PowerSGD with error feedback and warm start, every worker by hand:
    ``grads[t][w][name]``; returns the averaged update of every step."""
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    compressed = {}
    for name, shape in sorted(SHAPES.items()):
        if len(shape) < 2:
            continue
        n, m = int(np.prod(shape[:-1])), shape[-1]
        if rank * (n + m) < n * m:  # else cheaper sent whole
            q0 = np.asarray(jax.random.normal(keys[len(compressed)], (m, rank), jnp.float32))
            compressed[name] = (n, m, q0)
    err = [{k: np.zeros(s, np.float32) for k, s in SHAPES.items()} for _ in range(N)]
    qs = {k: v[2] for k, v in compressed.items()}
    out = []
    for t in range(steps):
        step = {}
        for name, shape in SHAPES.items():
            ms = [grads[t][w][name] + err[w][name] for w in range(N)]
            if name not in compressed:
                step[name] = np.mean(ms, axis=0)
                continue
            n, m, _ = compressed[name]
            mats = [x.reshape(n, m) for x in ms]
            p = np.mean([x @ qs[name] for x in mats], axis=0)
            p_hat = _gram_schmidt(p)
            q = np.mean([x.T @ p_hat for x in mats], axis=0)
            approx = p_hat @ q.T
            for w in range(N):
                err[w][name] = (mats[w] - approx).reshape(shape)
            qs[name] = q
            step[name] = approx.reshape(shape)
        out.append(step)
    return out


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_powersgd_matches_the_numpy_algorithm_step_by_step(rank):
    """As a user calls it: replicated parameters into shard_map, each worker's own
    gradient inside, the aggregator then SGD; five steps (warm start, error feedback)."""
    steps = 5
    rng = np.random.default_rng(rank)
    grads = [[{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
              for _ in range(N)] for _ in range(steps)]  # fmt: skip
    want = _reference(grads, rank, seed=7, steps=steps)
    mesh = jax.make_mesh((N,), ("data",))
    tx = optax.chain(jaxcomm.powersgd("data", rank=rank, seed=7), optax.sgd(1.0))
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}

    def train(params, g_seq):
        state = tx.init(params)
        ups = []
        for t in range(steps):
            g = jax.tree_util.tree_map(lambda a, t=t: a[t, 0], g_seq)
            up, state = tx.update(g, state, params)
            ups.append(up)
        return jax.tree_util.tree_map(lambda *u: jnp.stack(u), *ups)

    stacked = {k: np.stack([[grads[t][w][k] for w in range(N)] for t in range(steps)])
               for k in SHAPES}  # fmt: skip
    g = jax.device_put(stacked, NamedSharding(mesh, P(None, "data")))
    f = jax.jit(jax.shard_map(train, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=P()))
    got = f(params, g)
    for t in range(steps):
        for k in SHAPES:
            # SGD at lr 1 steps by minus the averaged approximation.
            np.testing.assert_allclose(-np.asarray(got[k][t]), want[t][k], rtol=2e-4, atol=2e-5)


def test_powersgd_sends_the_factors_and_the_small_tensors_only():
    """Two ring all-reduces of float32: ``sum n r`` factor numbers plus the tensors sent
    whole, then ``sum m r``; the compiled program (the wire audit) and the log agree."""
    from jaxcomm.network import as_bytes

    rank = 2
    mesh = jax.make_mesh((N,), ("data",))
    tx = jaxcomm.powersgd("data", rank=rank)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}

    def step(params, g):
        g = jax.tree_util.tree_map(lambda a: a[0], g)
        up, state = tx.update(g, tx.init(params), params)
        return up, state.log.sent_bytes[None]  # the update keeps the collectives alive

    g = {k: jnp.ones((N, *s)) for k, s in SHAPES.items()}
    g = jax.device_put(g, NamedSharding(mesh, P("data")))
    f = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
    )
    # conv: n = 6, m = 5 (2 * 11 < 30: factors); w: 12 x 9; wide (2 x 3) and b sent whole.
    first = rank * (6 + 12) + 6 + 6
    second = rank * (5 + 9)
    ring = lambda k: 2 * (N - 1) * 4 * -(-k // N)  # noqa: E731  (bytes a worker sends)
    audit = jaxcomm.wire_audit(f.lower(params, g)).traffic()
    assert int(audit.sent.max()) == ring(first) + ring(second)
    logged = as_bytes(np.asarray(f(params, g)[1]).reshape(N, 2))
    assert int(np.max(logged)) == ring(first) + ring(second)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rank"):
        jaxcomm.powersgd("data", rank=0)
    with pytest.raises(ValueError, match="reduce"):
        jaxcomm.powersgd("data", reduce="fast")
