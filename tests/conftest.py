"""Test setup: eight simulated CPU devices, set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def mesh8():
    """A one-dimensional mesh of the eight CPU devices, axis name ``data``."""
    return jax.make_mesh((8,), ("data",))


@pytest.fixture(scope="session")
def run_tx():
    """Driver for an optax transform per worker inside shard_map over ``data``.

    ``run_tx(mesh, tx, grads_seq [T, N, d], params [N, d])`` applies ``tx.update`` for T steps
    on every worker and returns ``(updates [N, T, d], final state with a leading N axis)``.
    """
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    def _run_tx(mesh, tx, grads_seq, params):
        """Apply ``tx`` for len(grads_seq) steps per worker; grads_seq: [T, N, d]."""

        def per_worker(g_seq, p):
            p = p[0]
            state = tx.init(p)
            outs = []
            for t in range(g_seq.shape[0]):
                upd, state = tx.update(g_seq[t, 0], state, p)
                outs.append(upd)
            return jnp.stack(outs)[None], jax.tree_util.tree_map(lambda a: a[None], state)

        f = jax.shard_map(
            per_worker, mesh=mesh, in_specs=(P(None, "data"), P("data")), out_specs=P("data")
        )
        g = jax.device_put(grads_seq, NamedSharding(mesh, P(None, "data")))
        p = jax.device_put(params, NamedSharding(mesh, P("data")))
        return jax.jit(f)(g, p)

    return _run_tx
