"""DeMo against an independent numpy implementation of the paper's algorithm, its wire
bytes against the compiled program, and its argument checks."""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.network import as_bytes

# SHAPES' prime-length vector at chunk=4 is cut into blocks of 1 (the authors' rule, tested
# here on purpose); the warning it brings is test_a_badly_blocked_tensor_is_warned_of's.
pytestmark = pytest.mark.filterwarnings("ignore:demo. chunk=4 cuts a dimension of 7")

N = 8
# A matrix, a kernel of three axes (the matrix [6, 8]), a vector, a prime-length vector and
# a matrix whose 2-D blocks pass 256 coefficients at chunk=32 (uint16 indices).
SHAPES = {"w": (12, 8), "conv": (2, 3, 8), "b": (10,), "odd": (7,), "big": (32, 16)}


def _dct(n):
    """The orthonormal DCT-II matrix from its definition, entry by entry."""
    d = np.empty((n, n))
    for a in range(n):
        scale = math.sqrt((1.0 if a == 0 else 2.0) / n)
        for h in range(n):
            d[a, h] = scale * math.cos(math.pi * a * (2 * h + 1) / (2 * n))
    return d


def test_the_reference_dct_is_scipys_orthonormal_dct_ii():
    scipy_fft = pytest.importorskip("scipy.fft")
    x = np.random.default_rng(0).normal(size=(5, 12))
    for n in (1, 2, 7, 12):
        np.testing.assert_allclose(x[:, :n] @ _dct(n).T, scipy_fft.dct(x[:, :n], norm="ortho"))
        np.testing.assert_allclose(_dct(n) @ _dct(n).T, np.eye(n), atol=1e-12)


def _side(n, chunk):
    """The authors' block side: the largest divisor of ``n`` that is at most ``chunk``."""
    return max(b for b in range(1, min(n, chunk) + 1) if n % b == 0)


def _reference(grads, params, *, lr, beta, chunk, k, sign, wd, average):
    """numpy DeMo, every worker by hand, in float64: ``grads[t][w][name]``. Returns the
    step of every step, the ``Q`` of every step and the workers' final momenta."""
    mom = [{n: np.zeros(s) for n, s in SHAPES.items()} for _ in range(N)]
    params = {n: np.array(p, np.float64) for n, p in params.items()}
    steps, qs = [], []
    for g_t in grads:
        q_t = {}
        for name, shape in SHAPES.items():
            rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
            cols = shape[-1]
            b1, b2 = _side(rows, chunk), _side(cols, chunk)
            d1, d2 = _dct(b1), _dct(b2)
            keep = min(k, b1 * b2)
            total = np.zeros((rows // b1, cols // b2, b1 * b2))
            count = np.zeros_like(total)
            for w in range(N):
                m = beta * mom[w][name].reshape(rows, cols) + g_t[w][name].reshape(rows, cols)
                sent = np.zeros_like(m)
                for i in range(rows // b1):
                    for j in range(cols // b2):
                        at = np.s_[i * b1 : (i + 1) * b1, j * b2 : (j + 1) * b2]
                        coef = (d1 @ m[at] @ d2.T).ravel()  # 2-D DCT-II of the block
                        top = np.argsort(-np.abs(coef), kind="stable")[:keep]
                        q = np.zeros_like(coef)
                        q[top] = coef[top]
                        sent[at] = d1.T @ q.reshape(b1, b2) @ d2  # its inverse DCT
                        total[i, j, top] += coef[top]
                        count[i, j, top] += 1
                mom[w][name] = (m - sent).reshape(shape)  # m <- m - q
            mean = total / np.maximum(count, 1) if average == "senders" else total / N
            big_q = np.zeros((rows, cols))
            for i in range(rows // b1):
                for j in range(cols // b2):
                    at = np.s_[i * b1 : (i + 1) * b1, j * b2 : (j + 1) * b2]
                    big_q[at] = d1.T @ mean[i, j].reshape(b1, b2) @ d2
            q_t[name] = big_q.reshape(shape)
        step = {
            n: -lr * (np.sign(q_t[n]) if sign else q_t[n]) - lr * wd * params[n] for n in SHAPES
        }
        params = {n: params[n] + step[n] for n in SHAPES}
        steps.append(step)
        qs.append(q_t)
    return steps, qs, mom


def _run(tx, grads, params, steps):
    """As a user runs it: replicated parameters into ``shard_map``, each worker's own
    gradient from ``jaxcomm.worker_grad`` (the loss ``sum(params * batch)`` has the batch as
    its gradient), the whole optimizer's step applied. Returns the steps ``[T, ...]`` and
    the momenta ``[N, d]``."""
    mesh = jax.make_mesh((N,), ("data",))

    def loss_fn(p, batch):
        return sum(jnp.sum(p[n] * batch[n]) for n in SHAPES)

    def train(params, g_seq):
        state = tx.init(params)
        ups = []
        for t in range(steps):
            batch = jax.tree_util.tree_map(lambda a, t=t: a[t, 0], g_seq)
            grads = jaxcomm.worker_grad(loss_fn, "data")(params, batch)
            up, state = tx.update(grads, state, params)
            params = optax.apply_updates(params, up)
            ups.append(up)
        return jax.tree_util.tree_map(lambda *u: jnp.stack(u), *ups), state.momentum[None]

    stacked = {n: np.stack([[grads[t][w][n] for w in range(N)] for t in range(steps)])
               for n in SHAPES}  # fmt: skip
    g = jax.device_put(stacked, NamedSharding(mesh, P(None, "data")))
    f = jax.jit(
        jax.shard_map(train, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=(P(), P("data")))
    )
    params = {n: jnp.asarray(p, jnp.float32) for n, p in params.items()}
    return jax.device_get(f(params, g))


CASES = {  # chunk, k, sign, weight decay, average
    "c4_k2": (4, 2, False, 0.0, "senders"),
    "c8_k5_sign_wd": (8, 5, True, 0.1, "senders"),
    "c16_k16_workers": (16, 16, False, 0.0, "workers"),
    "c32_k3_sign_workers": (32, 3, True, 0.0, "workers"),
}


@pytest.mark.parametrize("case", CASES)
def test_demo_matches_the_numpy_algorithm_step_by_step(case):
    """Four steps on 8 workers: the momenta (what each worker keeps after sending) and every
    step equal numpy's. With ``sign=True`` an entry whose ``Q`` is within float32 rounding
    of zero may take either sign: those (a small fraction) are left out from then on."""
    chunk, k, sign, wd, average = CASES[case]
    steps, lr, beta = 4, 0.01, 0.9
    rng = np.random.default_rng(chunk)
    grads = [[{n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
              for _ in range(N)] for _ in range(steps)]  # fmt: skip
    params = {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    kw = dict(lr=lr, beta=beta, chunk=chunk, k=k, sign=sign, average=average)
    want, qs, mom = _reference(grads, params, wd=wd, **kw)
    tx = jaxcomm.demo("data", weight_decay=wd, **kw)
    got, momentum = _run(tx, grads, params, steps)

    np.testing.assert_allclose(
        momentum,
        [np.concatenate([mom[w][n].ravel() for n in sorted(SHAPES)]) for w in range(N)],
        rtol=1e-4,
        atol=1e-4,
    )
    left_out = {n: np.zeros(s, bool) for n, s in SHAPES.items()}
    for t in range(steps):
        for n in SHAPES:
            if not sign:
                np.testing.assert_allclose(got[n][t], want[t][n], rtol=1e-4, atol=1e-6)
                continue
            q = qs[t][n]
            left_out[n] |= np.abs(q) < 1e-5 * np.sqrt(np.mean(q**2))
            ok = ~left_out[n]
            np.testing.assert_allclose(got[n][t][ok], want[t][n][ok], rtol=1e-5, atol=1e-8)
    total = sum(a.size for a in left_out.values())
    assert sum(a.sum() for a in left_out.values()) <= 0.01 * total


def test_a_badly_blocked_tensor_is_warned_of():
    """A dimension longer than ``chunk`` with no divisor near it (a prime: blocks of 1, 5
    bytes an entry against float32's 4) is blocked as the authors do, with a warning that
    names the chunk and the tensor; a dimension that divides well is not."""
    tx = jaxcomm.demo("data", lr=1e-3, chunk=64, k=32)
    with pytest.warns(UserWarning, match=r"chunk=64 cuts a dimension of 67 \(a tensor of shape "
                      r"\(67, 67\)\) into blocks of 1") as seen:  # fmt: skip
        tx.init({"w": jnp.zeros((67, 67)), "v": jnp.zeros((80,))})
    assert len(seen) == 1  # once a tensor; 80 (blocks of 40) is not warned of
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tx.init({"w": jnp.zeros((128, 64)), "v": jnp.zeros((80,))})


@pytest.mark.parametrize("bad, k", [(np.nan, 2), (np.inf, 1)], ids=["nan", "inf"])
def test_a_non_finite_gradient_reaches_the_update_as_nan(bad, k):
    """A NaN or an infinity in one worker's gradient makes its block of every worker's step
    NaN, not a zero or a sign: the rest of the step stays finite. An infinity makes the
    block's coefficients infinite, not NaN: kept as they are (with k=1, the one largest),
    their inverse DCT would be infinite and its sign a finite step; the block is sent as NaN
    instead."""
    grads = [[{n: np.ones(s, np.float32) for n, s in SHAPES.items()} for _ in range(N)]]
    grads[0][3]["w"][1, 2] = bad
    params = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    got, momentum = _run(jaxcomm.demo("data", lr=0.01, chunk=4, k=k), grads, params, 1)
    w = got["w"][0]  # [12, 8] in 4 x 4 blocks: entry (1, 2) is in block (0, 0)
    assert np.all(np.isnan(w[:4, :4]))
    assert np.all(np.isfinite(w[:4, 4:])) and np.all(np.isfinite(w[4:]))  # blocks (0, 1), ...
    assert all(np.all(np.isfinite(got[n])) for n in SHAPES if n != "w")
    own = np.isnan(momentum[3]) if np.isnan(bad) else ~np.isfinite(momentum[3])
    assert own.any() and np.isfinite(momentum[[0, 1, 2, 4, 5, 6, 7]]).all()


def test_bytes_are_the_packed_payload_far_below_float32():
    """At the paper's ``chunk=64, k=32``: a [128, 64] matrix is two 64 x 64 blocks of 4,096
    coefficients (32 float32 values and uint16 numbers each: 192 bytes), a [64] vector one
    block of 64 (uint8 numbers: 160 bytes). The all-gather's payload holds exactly those
    arrays; the log and the compiled program agree on what each worker sends, and it is far
    below a float32 ring all-reduce of the same gradient."""
    from jaxcomm._src import demo as demo_module

    shapes = {"w": (128, 64), "b": (64,)}
    d = 128 * 64 + 64
    mesh = jax.make_mesh((N,), ("data",))
    params = {n: jnp.zeros(s, jnp.float32) for n, s in shapes.items()}
    g = {
        n: jax.random.normal(jax.random.key(i), (N, *s)) for i, (n, s) in enumerate(shapes.items())
    }
    g = jax.device_put(g, NamedSharding(mesh, P("data")))

    def program(tx):
        def step(params, g):
            g = jax.tree_util.tree_map(lambda a: a[0], g)
            up, state = tx.update(g, tx.init(params), params)
            return up, jax.tree_util.tree_map(lambda a: a[None], find_log(state))

        spec = (P(), P("data"))
        return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))

    def find_log(state):
        (log,) = jaxcomm.network.find_logs(state)
        return log

    seen = []
    real = demo_module.all_gather

    def spy(payload, axis_name):
        seen.append([(a.dtype.name, a.shape) for a in jax.tree_util.tree_leaves(payload)])
        return real(payload, axis_name)

    demo_module.all_gather = spy
    try:
        f = program(jaxcomm.demo("data", lr=1e-3))
        audit = jaxcomm.wire_audit(f.lower(params, g)).traffic()
    finally:
        demo_module.all_gather = real
    assert seen == [[("float32", (2 * 32 + 32,)), ("uint8", (32,)), ("uint16", (2 * 32,))]]
    payload = sum(np.dtype(dtype).itemsize * math.prod(shape) for dtype, shape in seen[0])
    assert payload == 2 * 32 * (4 + 2) + 32 * (4 + 1) == 544
    assert audit.sent.tolist() == [(N - 1) * payload] * N  # an all-gather: N - 1 payloads
    logged = as_bytes(np.asarray(f(params, g)[1].sent_bytes)).reshape(N)
    assert logged.tolist() == audit.sent.tolist()

    dense = jaxcomm.wire_audit(program(jaxcomm.dense_all_reduce("data", reduce="ring")).lower(
        params, g)).traffic().sent  # fmt: skip
    assert dense.tolist() == [2 * (N - 1) * 4 * d // N] * N  # 57,792 bytes
    assert dense[0] / audit.sent[0] > 15  # 15.2x at 8 workers (an all-gather grows with N)
    assert 4 * d / payload > 60  # the payload against the float32 gradient: 60.7x


def _trace(f, mesh):
    """Trace ``f(params {"w": [4]} replicated, grads [N, 4] one row a worker)``."""

    def shaped(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    return jax.eval_shape(f, {"w": shaped((4,), P())}, shaped((N, 4), P("data")))


def test_a_whole_optimizer_refusing_an_optimizer_after_it():
    tx = jaxcomm.demo("data", lr=1e-3)
    assert isinstance(tx, jaxcomm.WholeOptimizer)
    mesh = jax.make_mesh((N,), ("data",))
    chained = optax.chain(tx, optax.sgd(0.1))

    def step(params, g):
        return chained.update({"w": g[0]}, chained.init(params), params)[0]

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    with pytest.raises(ValueError, match=r"^jaxcomm\.demo returns the step to apply"):
        _trace(f, mesh)


def test_momentum_resizes_to_the_workers_mean():
    """The momentum is what each worker still owes the model: on another number of workers
    each new one starts from the old workers' mean, so the mean owed is unchanged."""
    momentum = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    log = jax.tree.map(lambda e: np.broadcast_to(np.asarray(e), (8, *np.shape(e))),
                       jaxcomm.network.empty_log())  # fmt: skip
    out = jaxcomm.elastic.resize_workers(jaxcomm.DeMoState(momentum, log, None), 2).state
    np.testing.assert_array_equal(out.momentum, np.broadcast_to(momentum.mean(0), (2, 3)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": 0.0}, r"lr must be a finite number in \(0.0, inf\], got 0.0"),
        ({"lr": 1e-3, "beta": 1.0}, r"beta must be a finite number in \[0.0, 1.0\), got 1.0"),
        ({"lr": 1e-3, "beta": -0.1}, r"beta must be"),
        ({"lr": 1e-3, "chunk": 1}, r"chunk must be an integer in \[2, inf\], got 1"),
        ({"lr": 1e-3, "chunk": 64, "k": 65}, r"k must be an integer in \[1, 64\], got 65"),
        ({"lr": 1e-3, "k": 0}, r"k must be an integer in \[1, 64\], got 0"),
        ({"lr": 1e-3, "weight_decay": -1.0}, r"weight_decay must be"),
        ({"lr": 1e-3, "average": "mean"}, r"average must be one of \('senders', 'workers'\)"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxcomm.demo("data", **kwargs)


def test_bad_types_and_integer_parameters_are_named():
    with pytest.raises(TypeError, match="chunk must be an int"):
        jaxcomm.demo("data", lr=1e-3, chunk=8.0)
    with pytest.raises(TypeError, match="sign must be True or False"):
        jaxcomm.demo("data", lr=1e-3, sign=1)
    tx = jaxcomm.demo("data", lr=1e-3)
    with pytest.raises(TypeError, match=r"demo: parameters must be floating.*\['steps'\]"):
        tx.init({"w": jnp.zeros(4), "steps": jnp.zeros((), jnp.int32)})


def test_weight_decay_needs_the_parameters():
    mesh = jax.make_mesh((N,), ("data",))
    tx = jaxcomm.demo("data", lr=1e-3, weight_decay=0.1)

    def step(params, g):
        return tx.update({"w": g[0]}, tx.init(params))[0]

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    with pytest.raises(ValueError, match="weight_decay > 0 needs update"):
        _trace(f, mesh)


def test_state_for_another_pytree_is_named():
    mesh = jax.make_mesh((N,), ("data",))
    tx = jaxcomm.demo("data", lr=1e-3)

    def step(params, g):
        return tx.update({"w": g[0]}, tx.init({"w": jnp.zeros(3), "b": jnp.zeros(1)}))[0]

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    with pytest.raises(ValueError, match=r"demo: the state was built by init for parameters"):
        _trace(f, mesh)
