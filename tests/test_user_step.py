"""Every aggregator used from the user's own train step, exactly as the docs show.

Parameters enter ``jax.shard_map`` replicated (``in_specs=P()``, ``check_vma`` on), each
worker has its own data, and the gradient is taken inside with :func:`jaxcomm.worker_grad`.
Checked for every aggregator of the contract suite:

* the workers' gradients differ before aggregation (the data differ, and nothing sums them);
* the update equals the aggregator's rule applied to gradients computed independently, one
  worker at a time, outside ``shard_map`` (and, for the dense baselines, their plain mean);
* it differs from what the same aggregator makes of a pre-summed gradient (what autodiff
  hands over when the parameters are differentiated replicated);
* the compiled step holds no collective that the logs do not account for;
* the naive pattern (plain ``jax.grad`` of replicated parameters) is refused with the error
  that explains it; and misuse at this boundary (state for another pytree, an unbound axis,
  ``jax.vmap``, integer leaves) gets jaxcomm's own error; ``bfloat16`` parameters get
  ``bfloat16`` updates.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_contract import CASES, SHAPES, N, _first, _lead, _mesh, _programs

import jaxcomm

DENSE = ("psum", "ring", "tree")
STATEFUL = (
    "ec_quantized",
    "marsit",
    "ar_topk_star",
    "lw_topk",
    "ms_topk",
    "ef_signsgd",
    "ssdm",
    "local_sgd",
    "marsit_torus",
    "ar_topk_var_tree",
    "ar_topk_allgather",
    "partial_local_sgd",
    "chunk_topk",
    "diloco",
    "diloco_sparseloco",
)


def loss_fn(params, x):
    """A small model that uses every parameter: ``x: [B, 13]``."""
    h = jnp.tanh(x @ params["w"])  # [B, 7]
    return jnp.mean(h**2) + jnp.mean((x[:, :5] * params["b"] - 0.3) ** 2)


def _params():
    """Distinct entries, so that no two gradient entries tie (top-k picks the same set from
    gradients that differ in the last bit)."""
    keys = jax.random.split(jax.random.key(7), len(SHAPES))
    return {
        k: 0.5 * jax.random.normal(key, shape)
        for key, (k, shape) in zip(keys, SHAPES.items(), strict=True)
    }


def _data(seed=0):
    return jax.random.normal(jax.random.key(seed), (N, 6, 13))  # [workers, B, 13]


def _specs(case):
    return P(case.axes), (P(case.axes) if case.local else P())


def _user_step(case, tx, grad_fn):
    """The README's step: ``(params, batch) -> (new params, updates, the gradient each
    worker handed the aggregator [N, ...], the new state [N, ...])``."""
    data_spec, p_spec = _specs(case)

    def per_worker(params, x):
        if case.local:
            params = _first(params)
        grads = grad_fn(params, x[0])
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        new = optax.apply_updates(params, updates)
        if case.local:
            return _lead(new), _lead(updates), _lead(grads), _lead(state)
        return new, updates, _lead(grads), _lead(state)

    out_specs = (p_spec, p_spec, P(case.axes), P(case.axes))
    return jax.jit(
        jax.shard_map(
            per_worker, mesh=_mesh(case), in_specs=(p_spec, data_spec), out_specs=out_specs
        )
    )


def _inputs(case):
    mesh = _mesh(case)
    x = jax.device_put(_data(), NamedSharding(mesh, P(case.axes)))
    params = _params()
    if case.local:
        lead = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, (N, *a.shape)), params)
        params = jax.device_put(lead, NamedSharding(mesh, P(case.axes)))
    return x, params


def _leaves(tree):
    return [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("name", CASES)
def test_user_step_gives_the_rule_on_each_workers_own_gradient(name):
    case = CASES[name]
    tx = case.make(case.axis)
    x, params = _inputs(case)
    step = _user_step(case, tx, jaxcomm.worker_grad(loss_fn, case.axis))
    new, updates, handed, _ = step(params, x)

    # Independent reference: each worker's gradient computed alone, outside shard_map.
    local = [jax.grad(loss_fn)(_params(), _data()[i]) for i in range(N)]
    stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *local)
    # What the aggregator was handed: each worker's own gradient, all different, not a sum.
    for a, b in zip(_leaves(handed), _leaves(stacked), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    g = np.asarray(handed["w"]).reshape(N, -1)
    assert np.min(np.abs(g[:, None] - g[None]).sum(-1) + np.eye(N)) > 1e-3

    # The aggregator's rule (tested against hand references in its own test file) applied
    # to those independently computed gradients must give the same update.

    mesh, init_f, update_f = _programs(case)
    spec = NamedSharding(mesh, P(case.axes))
    want, _ = update_f(jax.device_put(stacked, spec), init_f(_params()), _params())
    got = updates if not case.local else updates
    for a, b in zip(_leaves(got), _leaves(want), strict=True):
        b = b if case.local else b[0]
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    if name in DENSE:
        mean = jax.tree_util.tree_map(lambda a: np.mean(np.asarray(a), 0), stacked)
        for a, b in zip(_leaves(updates), _leaves(mean), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        for p, u, p0 in zip(_leaves(new), _leaves(updates), _leaves(_params()), strict=True):
            np.testing.assert_allclose(p, p0 + u, rtol=1e-6)

    # What a pre-summed gradient (autodiff over replicated parameters) would have given.
    summed = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a.sum(0), a.shape), stacked)
    bad, _ = update_f(jax.device_put(summed, spec), init_f(_params()), _params())
    gap = max(
        float(np.max(np.abs(a - (b if case.local else b[0]))))
        for a, b in zip(_leaves(updates), _leaves(bad), strict=True)
    )
    assert gap > 1e-4, gap

    audit = step.lower(params, x).compile()
    assert jaxcomm.unlogged_traffic(audit) == ()
    assert jaxcomm.wire_audit(audit).ops  # the aggregator's own traffic is there


@pytest.mark.parametrize("name", CASES)
def test_plain_grad_of_replicated_params_is_refused(name):
    case = CASES[name]
    if case.local:  # local SGD's parameters are per worker; replicated ones are the misuse
        case = CASES[name].__class__(**{**CASES[name].__dict__, "local": False})
    tx = case.make(case.axis)
    x, params = _inputs(case)
    step = _user_step(case, tx, jax.grad(loss_fn))
    with pytest.raises(ValueError, match="does not vary over axis.*jaxcomm.worker_grad"):
        step(params, x)


def test_the_audit_names_autodiffs_hidden_all_reduce():
    """A gradient summed by autodiff and then re-typed by hand passes the aggregator's check,
    but the compiled step's extra all-reduce is reported with its shape, bytes and origin."""
    mesh = jax.make_mesh((N,), ("data",))
    tx = jaxcomm.dense_all_reduce("data", reduce="ring")

    def per_worker(params, x):
        grads = jaxcomm.varying(jax.grad(loss_fn)(params, x[0]), "data")  # wrong
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    f = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))
    x = jax.device_put(_data(), NamedSharding(mesh, P("data")))
    compiled = f.lower(_params(), x).compile()
    ops = jaxcomm.unlogged_traffic(compiled)
    assert ops and all(op.kind == "all-reduce" for op in ops)
    # 96 float32 gradient entries as a ring all-reduce: 2 (N - 1) ceil(size / N) per array.
    total = sum(int(op.sent.max()) for op in ops)
    assert total == sum(2 * (N - 1) * -(-int(np.prod(s)) // N) * 4 for s in SHAPES.values())
    with pytest.raises(jaxcomm.UnloggedTrafficError, match="transpose.*worker_grad"):
        jaxcomm.check_logged_traffic(compiled)


# --------------------------------------------------------------------------- misuse


def _run(case, fn, params, x):
    data_spec, p_spec = _specs(case)
    f = jax.shard_map(fn, mesh=_mesh(case), in_specs=(P(), data_spec), out_specs=P())
    return jax.jit(f)(params, x)


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("other", ["sizes", "structure"])
def test_state_for_another_pytree_is_named(name, other):
    case = CASES[name]
    tx = case.make(case.axis)
    if other == "sizes":
        wrong = {"w": jnp.zeros((13, 6)), "b": jnp.zeros((5,))}
    else:  # same total size, other structure
        wrong = {"w": jnp.zeros((13, 7)), "b": jnp.zeros((2,)), "c": jnp.zeros((3,))}

    def per_worker(params, x):
        grads = jaxcomm.worker_grad(loss_fn, case.axis)(params, x[0])
        updates, _ = tx.update(grads, tx.init(wrong), params)
        return jax.tree_util.tree_map(jnp.sum, updates)

    x, _ = _inputs(case)
    with pytest.raises(ValueError, match=r"built by init for parameters of .* but update got"):
        _run(case, per_worker, _params(), x)


@pytest.mark.parametrize("name", CASES)
def test_unbound_axis_and_vmap_get_jaxcomms_error(name):
    case = CASES[name]
    wrong = tuple(a + "x" for a in case.axes) if len(case.axes) > 1 else case.axes[0] + "x"
    tx = case.make(wrong)
    first = wrong[0] if isinstance(wrong, tuple) else wrong

    def per_worker(params, x):
        grads = jaxcomm.worker_grad(loss_fn, case.axis)(params, x[0])
        updates, _ = tx.update(grads, tx.init(params), params)
        return jax.tree_util.tree_map(jnp.sum, updates)

    x, _ = _inputs(case)
    with pytest.raises(ValueError, match=f"axis_name='{first}' is not bound"):
        _run(case, per_worker, _params(), x)

    tx = case.make(case.axes[0] if len(case.axes) == 1 else case.axes)
    g = jax.tree_util.tree_map(lambda a: jnp.ones((N, *a.shape)), _params())
    in_vmap = jax.vmap(lambda g: tx.update(g, tx.init(g), g)[0], axis_name=case.axes[0])
    with pytest.raises(ValueError, match="bound by jax.vmap.*jax.shard_map"):
        in_vmap(g)


@pytest.mark.parametrize("name", CASES)
def test_dtype_policy(name):
    """bfloat16 parameters get bfloat16 updates close to the float32 ones; an integer leaf
    is refused by name."""
    case = CASES[name]
    tx = case.make(case.axis)
    x, _ = _inputs(case)

    def updates_for(params):
        def per_worker(p, x):
            grads = jaxcomm.worker_grad(loss_fn, case.axis)(p, x[0])
            u, _ = tx.update(grads, tx.init(p), p)
            return jaxcomm.varying(u, case.axis) if not case.local else u

        data_spec, _ = _specs(case)
        f = jax.shard_map(
            lambda p, x: _lead(per_worker(p, x)),
            mesh=_mesh(case),
            in_specs=(P(), data_spec),
            out_specs=P(case.axes),
        )
        return jax.jit(f)(params, x)

    bf16 = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), _params())
    u16, u32 = updates_for(bf16), updates_for(_params())
    for a, b in zip(jax.tree_util.tree_leaves(u16), jax.tree_util.tree_leaves(u32), strict=True):
        assert a.dtype == jnp.bfloat16 and b.dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(a, np.float32)))
        if name in DENSE:  # the same mean, rounded to bfloat16 (and from bf16 parameters)
            np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=3e-2, atol=1e-3)

    def with_int(params, x):
        grads = jaxcomm.worker_grad(loss_fn, case.axis)(params, x[0])
        grads = {**grads, "step": jnp.zeros((), jnp.int32)}
        u, _ = tx.update(grads, tx.init(grads), {**params, "step": jnp.zeros((), jnp.int32)})
        return jax.tree_util.tree_map(jnp.sum, u)

    with pytest.raises(TypeError, match=r"must be floating.*\['step'\]"):
        _run(case, with_int, _params(), x)


def test_the_readme_train_step_runs_as_printed(capsys):
    """The train-step block of docs/user-step.md, executed as printed: the update is the mean of the
    workers' own gradients and the compiled step holds no unlogged collective."""
    import pathlib

    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "user-step.md"
    readme = page.read_text()
    block = readme.split("<!-- user-step:begin -->")[1].split("<!-- user-step:end -->")[0]
    code = block.split("```python")[1].split("```")[0]
    ns: dict = {}
    exec(compile(code, "docs/user-step.md", "exec"), ns)  # noqa: S102
    assert capsys.readouterr().out.strip() == "()"
    params, new = ns["params"], ns["new_params"]
    x, y = ns["x_host"], ns["y_host"]
    local = [
        jax.grad(ns["loss_fn"])(params, x[8 * i : 8 * i + 8], y[8 * i : 8 * i + 8])
        for i in range(N)
    ]
    mean = jax.tree_util.tree_map(lambda *g: np.mean(np.stack(g), 0), *local)
    for k in params:
        np.testing.assert_allclose(new[k], params[k] - 0.1 * mean[k], rtol=1e-5, atol=1e-7)
    assert not np.allclose(np.asarray(new["w"]), np.asarray(params["w"] - 0.1 * N * mean["w"]))
    assert (
        jaxcomm.unlogged_traffic(
            ns["train_step"].lower(params, ns["opt_state"], ns["x"], ns["y"]).compile()
        )
        == ()
    )


def test_the_vma_flag_the_check_reads_exists():
    """The check reads whether ``shard_map`` types values (``check_vma``); a JAX without
    that flag would turn the check off silently, so its absence fails here."""
    from jaxcomm._src.worker import _vma_checked

    mesh = jax.make_mesh((N,), ("data",))
    seen = {}

    def probe(x):
        seen["on"] = _vma_checked("data")
        return x

    x = jax.device_put(jnp.zeros(N), NamedSharding(mesh, P("data")))
    jax.shard_map(probe, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x)
    assert seen["on"] is True
    jax.shard_map(probe, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)(x)
    assert seen["on"] is False


def test_state_with_a_layout_round_trips_through_flax_serialization():
    from flax import serialization

    case = CASES["ar_topk_star"]
    mesh, init_f, _ = _programs(case)
    state = jax.device_get(init_f(_params()))
    restored = serialization.from_bytes(state, serialization.to_bytes(state))
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(state)
    for a, b in zip(
        jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(restored), strict=True
    ):
        np.testing.assert_array_equal(a, b)
