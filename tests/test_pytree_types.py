"""The layer-aware wrappers keep the user's parameter pytree: an ``nnx.State`` from
``nnx.split``, a Linen ``FrozenDict`` or a plain dict goes in and comes back with the same
structure (treedef), and the numbers equal the plain-dict run's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core import FrozenDict
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

N = 8
STEPS = 4
LAYERS = ["layer0", "layer1", "layer2"]  # input to output
SIZES = (5, 6, 4, 3)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layer0 = nnx.Linear(SIZES[0], SIZES[1], rngs=rngs)
        self.layer1 = nnx.Linear(SIZES[1], SIZES[2], rngs=rngs)
        self.layer2 = nnx.Linear(SIZES[2], SIZES[3], rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.layer0(x))
        x = jax.nn.relu(self.layer1(x))
        return self.layer2(x)


GRAPHDEF, STATE = nnx.split(MLP(nnx.Rngs(0)))
# The same numbers as plain nested dicts, and as Linen keeps them.
PLAIN = {
    name: {k: jnp.asarray(v) for k, v in STATE[name].to_pure_dict().items()} for name in LAYERS
}


def _as_type(kind):
    if kind == "nnx":
        return STATE
    if kind == "frozen":
        return FrozenDict(PLAIN)
    return PLAIN


def _forward(params, x):
    if isinstance(params, nnx.State):
        return nnx.merge(GRAPHDEF, params)(x)
    for name in LAYERS[:-1]:
        x = jax.nn.relu(x @ params[name]["kernel"] + params[name]["bias"])
    return x @ params[LAYERS[-1]]["kernel"] + params[LAYERS[-1]]["bias"]


def _loss(params, batch):
    x, y = batch
    return jnp.mean((_forward(params, x) - y) ** 2)


WRAPPERS = {
    "partial_local_sgd": lambda: jaxcomm.partial_local_sgd(
        optax.adam(1e-2), "data", schedule=[(2,), (1,), (0,)], layers=LAYERS
    ),
    "local_sgd": lambda: jaxcomm.local_sgd(optax.sgd(0.1), "data", period=2, layers=LAYERS),
    "diloco": lambda: jaxcomm.diloco(optax.sgd(0.1), "data", period=2, fragments=2, layers=LAYERS),
}


def _train(tx, params):
    """``STEPS`` steps on 8 workers, each with its own copy of ``params`` (a leading [8]
    axis outside ``shard_map``) and its own data; returns the per-worker parameters after
    every step, the last updates and the final state."""
    mesh = jax.make_mesh((N,), ("data",))
    lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731

    def step(params, opt_state, x, y):
        params, opt_state = first(params), first(opt_state)
        grads = jaxcomm.worker_grad(_loss, "data")(params, (x, y))
        updates, opt_state = tx.update(grads, opt_state, params)
        return lead(optax.apply_updates(params, updates)), lead(opt_state), lead(updates)

    sharded = NamedSharding(mesh, P("data"))
    params = jax.device_put(jax.tree.map(lambda a: jnp.stack([a] * N), params), sharded)
    init = jax.shard_map(
        lambda p: lead(tx.init(first(p))), mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )
    opt_state = jax.jit(init)(params)
    train_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    rng = np.random.default_rng(0)
    history, updates = [], None
    for _ in range(STEPS):
        x = rng.normal(size=(N * 4, SIZES[0])).astype(np.float32)
        y = rng.normal(size=(N * 4, SIZES[-1])).astype(np.float32)
        x, y = jax.device_put((x, y), sharded)
        params, opt_state, updates = jax.block_until_ready(train_step(params, opt_state, x, y))
        history.append(params)
    return history, updates, opt_state


_PLAIN_RUNS = {}


def _plain_run(wrapper):
    if wrapper not in _PLAIN_RUNS:
        _PLAIN_RUNS[wrapper] = _train(WRAPPERS[wrapper](), PLAIN)
    return _PLAIN_RUNS[wrapper]


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("kind", ["nnx", "frozen", "plain"])
@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_wrapper_keeps_the_parameters_pytree_and_numbers(wrapper, kind):
    params = _as_type(kind)
    history, updates, state = _train(WRAPPERS[wrapper](), params)
    per_worker = jax.tree.structure(jax.tree.map(lambda a: a[None], params))
    assert jax.tree.structure(updates) == per_worker
    for p in history:
        assert jax.tree.structure(p) == per_worker
    if kind == "nnx":  # the trained parameters merge back into the user's model
        model = nnx.merge(GRAPHDEF, jax.tree.map(lambda a: np.asarray(a)[0], history[-1]))
        assert model(jnp.ones((2, SIZES[0]))).shape == (2, SIZES[-1])
    if wrapper == "diloco":  # theta_sync keeps the parameters' structure too
        assert jax.tree.structure(state.anchor) == per_worker

    plain_history, plain_updates, _ = _plain_run(wrapper)
    # Leaves of every structure here come in the same (sorted key) order.
    assert [x.shape for x in _leaves(params)] == [x.shape for x in _leaves(PLAIN)]
    for got, ref in zip(history, plain_history, strict=True):
        for g, r in zip(_leaves(got), _leaves(ref), strict=True):
            np.testing.assert_allclose(g, r, rtol=0, atol=1e-6)
    for g, r in zip(_leaves(updates), _leaves(plain_updates), strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-6)
    # The averaging happened: after the last step every worker agrees on the layers
    # synchronised at that step, and not on layer0 (averaged at an earlier step, or by
    # local_sgd at this one).
    last = history[-1]
    synced = {"local_sgd": LAYERS, "diloco": ["layer1"], "partial_local_sgd": ["layer2"]}
    for name in synced[wrapper]:
        for leaf in _leaves(last[name]):
            assert np.max(np.abs(leaf - leaf[0:1])) < 1e-5, name
    if wrapper != "local_sgd":
        assert max(np.max(np.abs(v - v[0:1])) for v in _leaves(last["layer0"])) > 1e-4


@pytest.mark.parametrize("kind", ["nnx", "frozen"])
def test_profile_layers_hands_the_loss_the_parameters_own_type(kind):
    """The backward prefixes rebuild the parameters in their own structure for ``loss_fn``,
    and cost the same as with a plain dict."""
    seen = []

    def loss(params, batch):
        seen.append(jax.tree.structure(params))
        return _loss(params, batch)

    params = _as_type(kind)
    batch = (jnp.ones((4, SIZES[0])), jnp.ones((4, SIZES[-1])))
    v100 = jaxcomm.compute.roofline("v100")
    prof = jaxcomm.compute.profile_layers(loss, params, batch, LAYERS, roofline=v100)
    assert seen and set(seen) == {jax.tree.structure(params)}
    plain = jaxcomm.compute.profile_layers(_loss, PLAIN, batch, LAYERS, roofline=v100)
    assert (prof.forward_s, prof.backward_s, prof.param_bytes) == (
        plain.forward_s,
        plain.backward_s,
        plain.param_bytes,
    )
