"""Per-worker state resized to another number of workers (:func:`jaxcomm.elastic.resize_workers`):
every aggregator and sync wrapper of the contract suite, 8 to 4 and 4 to 8 workers.

* Each rule keeps what it promises, checked on states built by real updates: rows equal on
  every worker stay bit for bit; error-feedback residuals keep their mean over workers (the
  correction still owed to the model); re-cut segments join to the same vector; rows that
  differ (local replicas) become their mean, the averaged model.
* The resized state runs on the new world.
* What error feedback owed the model before a resize is paid after it: fed zero gradients,
  the new world applies the same total update as the old one would have (a rule that
  dropped the residuals, or summed them, fails this).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_contract import CASES, SHAPES

import jaxcomm
from jaxcomm._src.network import CommLog, empty_log


def _mesh(case, n):
    if len(case.axes) == 2:  # a torus: rows of 2
        return jax.make_mesh((2, n // 2), case.axes, devices=jax.devices()[:n])
    return jax.make_mesh((n,), case.axes, devices=jax.devices()[:n])


def _first(tree):
    return jax.tree_util.tree_map(lambda a: a[0], tree)


def _lead(tree):
    return jax.tree_util.tree_map(lambda a: a[None], tree)


def _world(case, n):
    """``(init, update, put)`` of ``case`` on ``n`` workers; parameters are per worker
    (``[n, ...]``) and every update is applied to them."""
    mesh, tx, spec = _mesh(case, n), case.make(case.axis), P(case.axes)

    def init(params):
        return _lead(tx.init(_first(params)))

    def update(grads, state, params):
        p = _first(params)
        u, s = tx.update(_first(grads), _first(state), p)
        u = jaxcomm.collectives.as_varying(u, case.axes)
        return _lead(optax.apply_updates(p, u)), _lead(u), _lead(s)

    init_f = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=spec, out_specs=spec))
    update_f = jax.jit(
        jax.shard_map(update, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3)
    )

    def put(tree):
        return jax.device_put(tree, NamedSharding(mesh, spec))

    return init_f, update_f, put


def _grads(n, seed):
    keys = jax.random.split(jax.random.key(seed), len(SHAPES))
    return {
        k: jax.random.normal(key, (n, *shape))
        for key, (k, shape) in zip(keys, SHAPES.items(), strict=True)
    }


def _trained(case, n, steps=3):
    """Parameters and state of ``case`` after ``steps`` updates on ``n`` workers, each
    worker with its own gradients (residuals, replicas and momenta differ per worker)."""
    init, update, put = _world(case, n)
    params = put({k: jnp.full((n, *s), 0.5, jnp.float32) for k, s in SHAPES.items()})
    state = init(params)
    for t in range(steps):
        params, _, state = update(put(_grads(n, t)), state, params)
    return jax.device_get(params), jax.device_get(state)


def _join(x, d):
    """Segments ``[N, *mid, s]`` (worker ``i`` holding segment ``i``) joined: ``[*mid, d]``."""
    return np.moveaxis(x, 0, -2).reshape(*x.shape[1:-1], -1)[..., :d]


def _check_rules(old, new, n_new, path=()):
    """Walk the old and the resized state side by side and check each field's rule,
    independently of :func:`jaxcomm.elastic.resize_workers`'s code."""
    if isinstance(old, CommLog):  # what the last step sent: empty on the new world
        for a, e in zip(new, empty_log(), strict=True):
            a = np.asarray(a)
            assert a.shape[0] == n_new
            # (A pipeline's embedding and head states are saved as zeros off their stage.)
            assert np.all((a == np.asarray(e)) | (a == 0))
        return
    if type(old) in jaxcomm.elastic.RULES:
        beside = jaxcomm.elastic.RULES[type(old)]
        for f in old._fields:
            a, b = getattr(old, f), getattr(new, f)
            if a is None:  # a field this configuration does not use (e.g. no segments)
                assert b is None
                continue
            if f not in beside:  # replica (residuals too: their mean is kept)
                _check_rules(a, b, n_new, (*path, f))
                continue
            # Segments of the flattened vector, worker i holding segment i.
            assert jaxcomm.elastic.resize_rule_of(old, f) == "segments"
            a, b = np.asarray(a), np.asarray(b)
            assert b.shape[0] == n_new
            d = np.shape(getattr(old, beside[f]))[-1]
            np.testing.assert_array_equal(_join(b, d), _join(a, d))
            assert b.shape[-1] == -(-d // n_new)
        return
    if isinstance(old, tuple | list | dict):
        items = old.items() if isinstance(old, dict) else enumerate(old)
        for k, a in items:
            _check_rules(a, new[k], n_new, (*path, k))
        return
    if old is None or not hasattr(old, "shape"):
        return
    a, b = np.asarray(old), np.asarray(new)
    assert b.shape == (n_new, *a.shape[1:]), path
    if all(np.array_equal(a[0], r, equal_nan=True) for r in a):
        for r in b:  # kept bit for bit
            bits = lambda x: x.reshape(-1).view(np.uint8)  # noqa: E731
            np.testing.assert_array_equal(bits(r), bits(a[0]))
    else:  # averaged: every new worker holds the old workers' mean
        mean = a.astype(np.float64).mean(0)
        for r in b:
            np.testing.assert_allclose(r, mean, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("old,new", [(8, 4), (4, 8)], ids=["8to4", "4to8"])
def test_each_rule_keeps_its_invariant_and_the_state_runs_on_the_new_world(name, old, new):
    case = CASES[name]
    params, state = _trained(case, old)
    resized = jaxcomm.elastic.resize_workers({"params": params, "state": state}, new)
    assert resized.state["params"].keys() == params.keys()
    _check_rules(params, resized.state["params"], new)
    _check_rules(state, resized.state["state"], new)
    # Every array whose rows differed (traffic logs aside) is named in the notes.
    flat = jax.tree_util.tree_flatten_with_path({"params": params, "state": state})[0]
    differ = {
        jax.tree_util.keystr(k)
        for k, x in flat
        if ".log." not in jax.tree_util.keystr(k) and not all(np.array_equal(x[0], r) for r in x)
    }
    segments = {k for k, v in resized.notes.items() if "segments" in v}
    assert set(resized.notes) - segments == differ - segments
    # The resized state is a valid state of the new world: it runs and stays finite.
    _, update, put = _world(case, new)
    p, s = put(resized.state["params"]), put(resized.state["state"])
    for t in range(2):
        p, u, s = update(put(_grads(new, 10 + t)), s, p)
    assert all(np.all(np.isfinite(x)) for x in jax.tree_util.tree_leaves(jax.device_get(u)))


# Error-fed aggregators whose residual is paid in full when the gradients stop (top-k sends
# the largest entries first; the quantizers' and signs' errors contract). SparseLoCo's decay
# forgets on purpose: decay 1 here.
_OWED = {
    "ec_quantized": lambda ax: jaxcomm.ec_quantized_all_reduce(ax, bits=3, bucket_size=8),
    "ar_topk_star": lambda ax: jaxcomm.ar_topk(ax, ratio=0.1),
    "lw_topk": lambda ax: jaxcomm.lw_topk(ax, ratio=0.1),
    "ms_topk": lambda ax: jaxcomm.ms_topk(ax, ratio=0.1),
    "chunk_topk": lambda ax: jaxcomm.chunk_topk(ax, chunk=16, k=4, decay=1.0),
    "ef_signsgd": lambda ax: jaxcomm.ef_signsgd(ax, lr=0.01),
    "marsit": lambda ax: jaxcomm.marsit(ax, local_lr=0.1, global_lr=0.01, full_sync_every=2),
}


def _flush(case, n, params, state, steps):
    """The total update ``n`` workers apply over ``steps`` steps of zero gradients."""
    _, update, put = _world(case, n)
    p, s = put(params), put(state)
    zero = put({k: jnp.zeros((n, *sh), jnp.float32) for k, sh in SHAPES.items()})
    total = {k: np.zeros(sh, np.float64) for k, sh in SHAPES.items()}
    for _ in range(steps):
        p, u, s = update(zero, s, p)
        u = jax.device_get(u)
        for k in total:
            total[k] += np.asarray(u[k][0], np.float64)
    return total


@pytest.mark.parametrize("name", _OWED)
@pytest.mark.parametrize("old,new", [(8, 4), (4, 8)], ids=["8to4", "4to8"])
def test_what_error_feedback_owes_the_model_is_paid_after_a_resize(name, old, new):
    case = CASES[name].__class__(make=_OWED[name], axes=CASES[name].axes)
    params, state = _trained(case, old, steps=4)
    steps = 80
    kept = _flush(case, old, params, state, steps)
    resized = jaxcomm.elastic.resize_workers({"p": params, "s": state}, new).state
    moved = _flush(case, new, resized["p"], resized["s"], steps)
    owed = np.sqrt(sum(np.sum(v**2) for v in kept.values()))
    assert owed > 1e-3  # the residuals owed something: the test can tell
    gap = np.sqrt(sum(np.sum((kept[k] - moved[k]) ** 2) for k in kept))
    assert gap < 0.05 * owed, (gap, owed)


def test_bfloat16_rows_are_averaged_and_equal_ones_kept():
    rows = np.arange(8 * 4, dtype=np.float32).reshape(8, 4).astype(jnp.bfloat16)
    same = np.broadcast_to(np.float32(1.5).astype(jnp.bfloat16), (8, 4))
    out = jaxcomm.elastic.resize_workers({"local": rows, "synced": same}, 2).state
    assert out["local"].dtype == jnp.bfloat16 and out["local"].shape == (2, 4)
    want = rows.astype(np.float64).mean(0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(out["local"][1], want)
    np.testing.assert_array_equal(out["synced"], same[:2])


def test_bad_input_is_refused_naming_it():
    with pytest.raises(ValueError, match="leading worker axis"):
        jaxcomm.elastic.resize_workers({"a": np.zeros((8, 3)), "b": np.zeros((4, 3))}, 2)
    with pytest.raises(ValueError, match=r"\['count'\].*int32 rows"):
        jaxcomm.elastic.resize_workers({"count": np.arange(8, dtype=np.int32)}, 4)
    with pytest.raises(ValueError, match="workers must be an integer"):
        jaxcomm.elastic.resize_workers({"a": np.zeros((8, 3))}, 0)
    with pytest.raises(ValueError, match="has no field 'resid'"):
        jaxcomm.elastic.register_resize_rule(jaxcomm.TopKState, resid="pending")
    with pytest.raises(ValueError, match="has no field 'whole'"):
        jaxcomm.elastic.register_resize_rule(jaxcomm.TopKState, residual="whole")


def test_the_earlier_pending_rule_warns_and_changes_nothing():
    """``pending`` ran ``replica``'s code: registering it warns and leaves no rule, and a
    residual is averaged (its mean kept) all the same."""
    with pytest.warns(FutureWarning, match="ignored"):
        jaxcomm.elastic.register_resize_rule(_Residual, residual="pending")
    assert _Residual not in jaxcomm.elastic.RULES
    state = _Residual(np.arange(24.0).reshape(8, 3), np.full(8, 5, np.int32))
    out = jaxcomm.elastic.resize_workers(state, 2)
    mean = np.broadcast_to(state.residual.mean(0), (2, 3))
    np.testing.assert_array_equal(out.state.residual, mean)
    np.testing.assert_array_equal(out.state.count, [5, 5])
    assert "averaged" in out.notes[".residual"] and ".count" not in out.notes


def test_the_earlier_rule_kinds_still_register_segments():
    """``residual="pending", server_error="segments"`` (the earlier spelling) warns and
    registers what ``server_error="residual"`` does."""
    with pytest.warns(FutureWarning, match="earlier spelling"):
        jaxcomm.elastic.register_resize_rule(
            _Segmented, residual="pending", server_error="segments"
        )
    assert jaxcomm.elastic.RULES[_Segmented] == {"server_error": "residual"}
    state = _Segmented(np.zeros((4, 10), np.float32), np.arange(12.0).reshape(4, 3))
    out = jaxcomm.elastic.resize_workers(state, 2).state
    np.testing.assert_array_equal(out.server_error.reshape(-1), np.arange(10.0))
    with pytest.raises(ValueError, match="needs a 'pending' field"):
        jaxcomm.elastic.register_resize_rule(_Segmented, server_error="segments")


class _Segmented(NamedTuple):
    residual: np.ndarray
    server_error: np.ndarray


class _Residual(NamedTuple):
    residual: np.ndarray
    count: np.ndarray
