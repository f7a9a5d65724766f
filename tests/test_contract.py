"""The aggregator contract: one suite that every jaxcomm aggregator passes.

Each aggregator, inside ``jax.shard_map`` with ``check_vma`` on (the default):

* runs its ``init``/``update`` under ``jit``, also as a ``lax.scan`` over steps whose carry
  holds replicated parameters (``out_specs=P()``; per-worker ones for the local SGD
  wrappers, whose workers' parameters differ between synchronisations), and gives the same
  result as a loop;
* runs under ``lax.cond`` on its state;
* survives an Orbax save/restore of its state bit for bit, and continues identically;
* lets a NaN in one worker's gradient reach every worker's update (for local SGD: that
  worker's update at once, everyone's at the step that averages it);
* logs exactly the bytes, rounds and path bytes that the compiled program's collectives
  move (read by :func:`jaxcomm.wire_audit`), device by device.

A new aggregator joins by adding a line to ``CASES``.
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.network import as_bytes, find_logs, merge_logs

N = 8
SHAPES = {"w": (13, 7), "b": (5,)}  # d = 96: not a multiple of the segment or bucket sizes
# DeMo at chunk=8 cuts the prime 13 rows into blocks of 1, on purpose (and warns of it).
pytestmark = pytest.mark.filterwarnings("ignore:demo. chunk=8 cuts a dimension of 13")


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable  # axis_name -> GradientTransformation
    mesh: tuple = (N,)
    axes: tuple = ("data",)
    # Conditionals holding collectives, as {op-name part: branch}, from the step index and
    # the state after that step.
    branches: Callable = lambda step, state: None
    # Parameters differ between workers (local SGD): kept per worker in the scan test.
    local: bool = False
    # Whether a NaN in one worker's gradient at this step reaches every worker's update.
    spreads: Callable = lambda step: True

    @property
    def axis(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes


def _marsit_rounds(step, state=None):
    # Round t is full precision when t % 2 == 0 (the cond's true branch, index 1).
    return {"cond": 1 if step % 2 == 0 else 0}


def _root(step, state):
    # AR-Topk broadcasts from the root it logged (branch r of the switch = root r).
    return {jaxcomm.audit.ROOT_SCOPE: int(np.asarray(state.root).reshape(-1)[0])}


def _sync(schedule):
    def branches(step, state):
        return {jaxcomm.schedules.SYNC_SCOPE: jaxcomm.schedules.sync_branch(schedule, step)}

    return branches


def _diloco(period, schedule=None, overlap=0, root=False, warmup=0):
    def branches(step, state):
        out = {}
        if period > 1 or warmup:  # period 1 has one kind of step: no conditional
            out.update(
                jaxcomm.schedules.diloco_branches(
                    period, step, schedule=schedule, overlap=overlap, warmup=warmup
                )
            )
        if root:  # AR-Topk inside: the root the synchronised fragment's state logged
            synced = jaxcomm.schedules.diloco_steps(period, schedule=schedule, overlap=overlap)
            out.update(_root(step, state.reduce[synced[step % period][0]]))
        return out

    return branches


CASES = {
    "psum": Case(lambda ax: jaxcomm.dense_all_reduce(ax, reduce="psum")),
    "ring": Case(lambda ax: jaxcomm.dense_all_reduce(ax, reduce="ring")),
    "tree": Case(lambda ax: jaxcomm.dense_all_reduce(ax, reduce="tree")),
    "ec_quantized": Case(lambda ax: jaxcomm.ec_quantized_all_reduce(ax, bits=3, bucket_size=8)),
    "marsit": Case(
        lambda ax: jaxcomm.marsit(ax, local_lr=0.1, global_lr=0.01, full_sync_every=2),
        branches=_marsit_rounds,
    ),
    "marsit_torus": Case(
        lambda ax: jaxcomm.marsit(
            ax, local_lr=0.1, global_lr=0.01, full_sync_every=2, topology="torus"
        ),
        mesh=(2, 4),
        axes=("row", "col"),
        branches=_marsit_rounds,
    ),
    "ar_topk_star": Case(lambda ax: jaxcomm.ar_topk(ax, ratio=0.1), branches=_root),
    "ar_topk_var_tree": Case(
        lambda ax: jaxcomm.ar_topk(ax, ratio=0.1, select="var", reduce="tree"), branches=_root
    ),
    "ar_topk_allgather": Case(lambda ax: jaxcomm.ar_topk(ax, ratio=0.1, reduce="allgather")),
    "lw_topk": Case(lambda ax: jaxcomm.lw_topk(ax, ratio=0.1)),
    "ms_topk": Case(lambda ax: jaxcomm.ms_topk(ax, ratio=0.1)),
    "signsgd_mv": Case(lambda ax: jaxcomm.signsgd_mv(ax, lr=0.01)),
    "ef_signsgd": Case(lambda ax: jaxcomm.ef_signsgd(ax, lr=0.01)),
    "ssdm": Case(lambda ax: jaxcomm.ssdm(ax, lr=0.01)),
    "cascading_sign": Case(lambda ax: jaxcomm.cascading_sign(ax, lr=0.01)),
    # Averages everything after step 1 (step 0 is local).
    "local_sgd": Case(
        lambda ax: jaxcomm.local_sgd(optax.sgd(0.1), ax, period=2),
        branches=_sync(((), (0,))),
        local=True,
        spreads=lambda step: step % 2 == 1,
    ),
    # Layer 1 ("w") after every step, layer 0 ("b") after step 1, one ring each, Adam local.
    "partial_local_sgd": Case(
        lambda ax: jaxcomm.partial_local_sgd(
            optax.adam(0.01), ax, schedule=((1,), (1, 0)), layers=["b", "w"]
        ),
        branches=_sync(((1,), (1, 0))),
        local=True,
    ),
    "chunk_topk": Case(lambda ax: jaxcomm.chunk_topk(ax, chunk=16, k=4, decay=0.9)),
    "chunk_topk_senders": Case(
        lambda ax: jaxcomm.chunk_topk(ax, chunk=16, k=4, decay=0.9, average="senders")
    ),
    "statistical_quantized": Case(lambda ax: jaxcomm.statistical_quantized(ax, bits=2)),
    "powersgd": Case(lambda ax: jaxcomm.powersgd(ax, rank=2)),
    # Blocks of 1 x 7 ("w": 13 is prime) and 5 ("b"), the top 4 DCT coefficients of each.
    "demo": Case(lambda ax: jaxcomm.demo(ax, lr=0.01, chunk=8, k=4)),
    "error_fed_two_phase": Case(
        lambda ax, c=jaxcomm.codecs.QuantizeCodec(2, 16): jaxcomm.error_fed(  # noqa: B008
            c, ax, exchange="two_phase"
        )
    ),
    # Synchronises after step 1 (Nesterov outer step of the averaged pseudo-gradient).
    "diloco": Case(
        lambda ax: jaxcomm.diloco(optax.sgd(0.1), ax, period=2),
        branches=_diloco(2),
        local=True,
        spreads=lambda step: step % 2 == 1,
    ),
    # Two fragments ("b" at step 0, "w" at step 1), each merged one step later, 4-bit
    # error-fed pseudo-gradients: a NaN in "w" at step 1 reaches the others at step 2
    # (test_a_nonfinite_pseudo_gradient_reaches_every_worker_at_its_merge).
    "diloco_streaming": Case(
        lambda ax: jaxcomm.diloco(
            optax.adam(0.01),
            ax,
            period=2,
            layers=["b", "w"],
            fragments=2,
            overlap=1,
            aggregate=jaxcomm.ec_quantized_all_reduce(ax, bits=4, bucket_size=8),
        ),
        branches=_diloco(2, jaxcomm.schedules.streaming_schedule(2, 2, 2), overlap=1),
        local=True,
        spreads=lambda step: False,
    ),
    # A data-parallel warm start of one step (the gradients averaged by a ring), then
    # periods of 2 from step 1: synchronises after step 2. SGD inside: Adam's first step is
    # blind to the gradient's scale, so a pre-summed gradient would go unnoticed.
    "diloco_warmup": Case(
        lambda ax: jaxcomm.diloco(optax.sgd(0.1), ax, period=2, warmup=1),
        branches=_diloco(2, warmup=1),
        local=True,
        spreads=lambda step: step % 2 == 0,
    ),
    # SparseLoCo: chunk-wise top-k, 2-bit values, decayed error feedback, outer SGD 1.0.
    "diloco_sparseloco": Case(
        lambda ax: jaxcomm.diloco(
            optax.sgd(0.1),
            ax,
            period=1,
            outer=optax.sgd(1.0),
            aggregate=jaxcomm.chunk_topk(ax, chunk=16, k=4, decay=0.95),
        ),
        branches=_diloco(1),
        local=True,
    ),
    # AR-Topk's shared root indices on the pseudo-gradient (a ring all-reduce of values),
    # two fragments ("b" at step 0, "w" at step 1): each branch of DiLoCo's switch holds its
    # own AR-Topk root switch, resolved by the one that runs.
    "diloco_ar_topk": Case(
        lambda ax: jaxcomm.diloco(
            optax.sgd(0.1),
            ax,
            period=2,
            layers=["b", "w"],
            fragments=2,
            aggregate=jaxcomm.ar_topk(ax, ratio=0.2),  # "b" has 5 entries: k >= 1
        ),
        branches=_diloco(2, jaxcomm.schedules.streaming_schedule(2, 2, 2), root=True),
        local=True,
        spreads=lambda step: step % 2 == 1,
    ),
}


def _mesh(case):
    return jax.make_mesh(case.mesh, case.axes)


def _grads(steps, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {
        k: jax.random.normal(key, (steps, N, *shape))
        for key, (k, shape) in zip(keys, SHAPES.items(), strict=True)
    }


def _params():
    return {k: jnp.full(shape, 0.5, jnp.float32) for k, shape in SHAPES.items()}


def _first(tree):
    return jax.tree_util.tree_map(lambda a: a[0], tree)


def _lead(tree):
    return jax.tree_util.tree_map(lambda a: a[None], tree)


def _lead_n(tree):
    return jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), tree)


def _programs(case):
    """Jitted ``init(params) -> state [N, ...]`` and
    ``update(grads [N, ...], state [N, ...], params) -> (updates [N, ...], state [N, ...])``."""
    mesh, tx, spec = _mesh(case), case.make(case.axis), P(case.axes)

    def init(params):
        return _lead(tx.init(params))

    def update(grads, state, params):
        u, s = tx.update(_first(grads), _first(state), params)
        return _lead(jaxcomm.collectives.as_varying(u, case.axes)), _lead(s)

    init_f = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=spec))
    update_f = jax.jit(
        jax.shard_map(update, mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec, spec))
    )
    return mesh, init_f, update_f


def _same(a, b):
    """Integers (counters, keys, byte counts) exactly; floats to rtol 1e-6 and atol 1e-6
    (XLA compiles a ``cond`` branch or a loop body apart from the same code outside it, and
    may order or contract its arithmetic differently: a last-bit difference in an operand
    of order 1 is a few 1e-7 in a residual near zero that cancels it). State not threaded
    through would be off by 1e-2 or more here."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if np.issubdtype(a.dtype, np.floating):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    else:
        np.testing.assert_array_equal(a, b)


def _put(mesh, tree, spec):
    return jax.device_put(tree, NamedSharding(mesh, spec))


@pytest.mark.parametrize("name", CASES)
def test_scan_with_replicated_params_matches_a_loop(name):
    """``lax.scan`` over steps inside ``shard_map`` (``check_vma`` on) with parameters kept
    replicated (``in_specs``/``out_specs`` ``P()``) runs, and equals the same steps unrolled."""
    case = CASES[name]
    mesh, tx, steps = _mesh(case), case.make(case.axis), 3

    def per_worker(g_seq, params):
        g_seq = jax.tree_util.tree_map(lambda a: a[:, 0], g_seq)  # [T, ...] this worker's
        if case.local:  # [1, ...] this worker's own parameters
            params = _first(params)

        def step(carry, g):
            p, s = carry
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        (p_scan, s_scan), _ = jax.lax.scan(step, (params, tx.init(params)), g_seq)
        p_loop, s_loop = params, tx.init(params)
        for t in range(steps):
            (p_loop, s_loop), _ = step(
                (p_loop, s_loop), jax.tree_util.tree_map(lambda a, t=t: a[t], g_seq)
            )
        if case.local:
            return _lead(p_scan), _lead(p_loop), _lead(s_scan), _lead(s_loop)
        return p_scan, p_loop, _lead(s_scan), _lead(s_loop)

    spec = P(None, case.axes)
    p_spec = P(case.axes) if case.local else P()
    f = jax.jit(
        jax.shard_map(
            per_worker,
            mesh=mesh,
            in_specs=(spec, p_spec),
            out_specs=(p_spec, p_spec, P(case.axes), P(case.axes)),
        )
    )
    params = _put(mesh, _lead_n(_params()), p_spec) if case.local else _params()
    p_scan, p_loop, s_scan, s_loop = f(_put(mesh, _grads(steps), spec), params)
    for a, b, p0 in zip(
        jax.tree_util.tree_leaves(p_scan),
        jax.tree_util.tree_leaves(p_loop),
        jax.tree_util.tree_leaves(_params()),
        strict=True,
    ):
        assert np.all(np.isfinite(a)) and not np.array_equal(a, p0)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    jax.tree_util.tree_map(_same, s_scan, s_loop)


@pytest.mark.parametrize("name", CASES)
def test_cond_on_the_state(name):
    """``lax.cond`` between an update and a skip, on a traced flag: both branches type-check
    with ``check_vma`` on and the taken one is what runs."""
    case = CASES[name]
    mesh, tx, spec = _mesh(case), case.make(case.axis), P(case.axes)

    def per_worker(g, flag, params):
        g = _first(g)
        state = tx.init(params)
        _, state = tx.update(g, state, params)  # a non-trivial state
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        if case.local:  # local SGD's updates are per worker
            zeros = jaxcomm.collectives.as_varying(zeros, case.axes)
        u, s = jax.lax.cond(flag, lambda s: tx.update(g, s, params), lambda s: (zeros, s), state)
        u_direct, s_direct = tx.update(g, state, params)
        return p_out(u), p_out(u_direct), _lead(s), _lead(s_direct), _lead(state)

    def p_out(u):
        return _lead(jaxcomm.collectives.as_varying(u, case.axes))

    f = jax.jit(
        jax.shard_map(per_worker, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec,) * 5)
    )
    grads = _put(mesh, _first(_grads(1)), spec)
    u, u_direct, s, s_direct, before = f(grads, jnp.bool_(True), _params())
    jax.tree_util.tree_map(_same, u, u_direct)
    jax.tree_util.tree_map(_same, s, s_direct)
    assert any(np.any(np.asarray(a) != 0) for a in jax.tree_util.tree_leaves(u))
    u, _, s, _, before = f(grads, jnp.bool_(False), _params())
    assert all(np.all(np.asarray(a) == 0) for a in jax.tree_util.tree_leaves(u))
    jax.tree_util.tree_map(np.testing.assert_array_equal, s, before)


@pytest.mark.parametrize("name", CASES)
def test_orbax_round_trip_is_bit_exact(name, tmp_path):
    """The state after two steps saves and restores bit for bit, and the next step from the
    restored state equals the next step from the original."""
    case = CASES[name]
    mesh, init_f, update_f = _programs(case)
    spec = P(case.axes)
    grads = _put(mesh, _grads(3), P(None, case.axes))
    params = _params()
    state = init_f(params)
    for t in range(2):
        _, state = update_f(
            _first(jax.tree_util.tree_map(lambda a, t=t: a[t:], grads)), state, params
        )
    host = jax.tree_util.tree_map(np.asarray, state)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "state", host)
    ckpt.wait_until_finished()
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, host)
    restored = ckpt.restore(tmp_path / "state", target)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(host)
    for a, b in zip(
        jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(restored), strict=True
    ):
        assert np.asarray(b).dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(b), a)
    g2 = jax.tree_util.tree_map(lambda a: a[2], grads)
    u_a, s_a = update_f(g2, state, params)
    u_b, s_b = update_f(g2, _put(mesh, restored, spec), params)
    jax.tree_util.tree_map(np.testing.assert_array_equal, u_a, u_b)
    jax.tree_util.tree_map(np.testing.assert_array_equal, s_a, s_b)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_gradient_reaches_every_worker(name, bad):
    """A NaN or Inf in one worker's gradient makes every worker's update non-finite, in
    every kind of round (Marsit's full-precision round 0 and one-bit round 1)."""
    case = CASES[name]
    mesh, init_f, update_f = _programs(case)
    params = _params()
    grads = _grads(2)
    for step in range(2):
        g = jax.tree_util.tree_map(lambda a, step=step: a[step], grads)
        g = {**g, "w": g["w"].at[3, 2, 4].set(bad)}
        state = init_f(params)
        if step:  # reach the second kind of round with a finite first step
            _, state = update_f(
                _put(mesh, jax.tree_util.tree_map(lambda a: a[0], grads), P(case.axes)),
                state,
                params,
            )
        u, _ = update_f(_put(mesh, g, P(case.axes)), state, params)
        flat = np.concatenate(
            [np.asarray(a).reshape(N, -1) for a in jax.tree_util.tree_leaves(u)], 1
        )
        finite = np.all(np.isfinite(flat), axis=1)
        if case.spreads(step):
            assert np.all(~finite), (step, finite)
        else:  # a local step: only the worker with the NaN
            assert not finite[3] and finite.sum() == N - 1, (step, finite)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_pseudo_gradient_reaches_every_worker_at_its_merge(bad):
    """Streaming DiLoCo with overlap: a NaN (or Inf) in worker 3's "w" gradient at step 1
    (the step "w" synchronises) stays in worker 3's update that step, and is in every
    worker's update at step 2, when the averaged fragment is merged."""
    case = CASES["diloco_streaming"]
    mesh, init_f, update_f = _programs(case)
    params, grads, spec = _params(), _grads(3), P(case.axes)
    state = init_f(params)
    finite = []
    for step in range(3):
        g = jax.tree_util.tree_map(lambda a, step=step: a[step], grads)
        if step == 1:
            g = {**g, "w": g["w"].at[3, 2, 4].set(bad)}
        u, state = update_f(_put(mesh, g, spec), state, params)
        flat = np.concatenate(
            [np.asarray(a).reshape(N, -1) for a in jax.tree_util.tree_leaves(u)], 1
        )
        finite.append(np.all(np.isfinite(flat), axis=1))
    assert finite[0].all()
    assert not finite[1][3] and finite[1].sum() == N - 1
    assert not finite[2].any()


@pytest.mark.parametrize("name", CASES)
def test_logged_traffic_equals_the_compiled_program(name):
    """Bytes sent, rounds and path bytes in the aggregator's log equal what the compiled
    update's collectives move, device by device (two steps: Marsit's two kinds of round)."""
    case = CASES[name]
    mesh, init_f, update_f = _programs(case)
    params = _params()
    grads = _grads(2)
    state = init_f(params)
    g0 = _put(mesh, jax.tree_util.tree_map(lambda a: a[0], grads), P(case.axes))
    audit = jaxcomm.wire_audit(update_f.lower(g0, state, params))
    assert audit.num_devices == N and audit.ops
    most = 0
    for step in range(2):
        g = _put(mesh, jax.tree_util.tree_map(lambda a, step=step: a[step], grads), P(case.axes))
        _, state = update_f(g, state, params)
        want = audit.traffic(case.branches(step, state))
        log = merge_logs(*find_logs(state))  # one per aggregator (per DiLoCo fragment)
        k = len(jaxcomm.network.KINDS)
        sent = as_bytes(np.asarray(log.sent_bytes).reshape(N, 2))
        rounds = np.asarray(log.rounds).reshape(N, k).sum(1)
        path = as_bytes(np.asarray(log.path_bytes).reshape(N, k, 2)).sum(1)
        np.testing.assert_array_equal(sent, want.sent)
        np.testing.assert_array_equal(rounds, want.rounds)
        np.testing.assert_array_equal(path, want.path_bytes)
        most = max(most, sent.max())
    assert most > 0  # (local SGD sends nothing on a step that averages nothing)


def test_counters_work_for_a_600m_parameter_model():
    """A 600M-parameter update traces (nothing overflows int32 at trace time), and its byte
    counts, past 2**32, are exact."""
    mesh = jax.make_mesh((N,), ("data",))
    tx = jaxcomm.dense_all_reduce("data", reduce="ring")
    d = 600_000_000

    def per_worker(g):
        u, s = tx.update(g[0], tx.init(g[0]))
        return u[None], _lead(s)

    f = jax.shard_map(per_worker, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    sharding = NamedSharding(mesh, P("data"))
    out = jax.eval_shape(f, jax.ShapeDtypeStruct((N, d), jnp.float32, sharding=sharding))
    assert out[0].shape == (N, d)
    assert out[1].log.sent_bytes.shape == (N, 2)
    seg = jax.ShapeDtypeStruct((d // N,), jnp.float32)
    wire = jaxcomm.collectives.ring_all_reduce_wire(seg, N, message_bytes=4 * d)
    log = jaxcomm.network.log_wire(jaxcomm.network.empty_log(), wire)
    assert int(as_bytes(log.sent_bytes)) == 2 * (N - 1) * 4 * d // N == 4_200_000_000
    assert int(as_bytes(log.message_bytes).sum()) == 2_400_000_000
