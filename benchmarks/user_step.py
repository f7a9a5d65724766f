"""The README's train step, measured: bytes each device sends (wire audit of the compiled
step) and the update against the mean of the workers' own gradients.

    python benchmarks/user_step.py                  # the README's step (jaxcomm.worker_grad)
    python benchmarks/user_step.py --grad plain     # plain jax.grad of replicated parameters

``--grad plain`` is the pattern the README showed before aggregators checked their
gradients: on a jaxcomm that checks, it reports the refusal. The reference gradients are
computed one worker at a time outside ``shard_map``.
"""

import argparse
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomm  # noqa: E402

LR = 0.1


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def measure(grad: str) -> dict:
    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.chain(jaxcomm.dense_all_reduce("data", reduce="ring"), optax.sgd(LR))
    state_specs = (P("data"), P())
    take = jaxcomm.worker_grad(loss_fn, "data") if grad == "worker" else jax.grad(loss_fn)

    def init(params):
        agg, rest = tx.init(params)
        return jax.tree.map(lambda a: a[None], agg), rest

    def step(params, opt_state, x, y):
        agg, rest = opt_state
        opt_state = (jax.tree.map(lambda a: a[0], agg), rest)
        grads = take(params, x, y)
        updates, (agg, rest) = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), (jax.tree.map(lambda a: a[None], agg), rest)

    train_step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), state_specs, P("data"), P("data")),
            out_specs=(P(), state_specs),
        )
    )
    params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros(1)}
    opt_state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=state_specs))(params)
    rng = np.random.default_rng(0)
    x_host = rng.normal(size=(64, 4)).astype(np.float32)
    y_host = x_host @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    x, y = jax.device_put((x_host, y_host), NamedSharding(mesh, P("data")))
    try:
        compiled = train_step.lower(params, opt_state, x, y).compile()
    except ValueError as e:
        return {"grad": grad, "refused": str(e).splitlines()[0][:300]}
    new, _ = compiled(params, opt_state, x, y)
    audit = jaxcomm.wire_audit(compiled)
    rows = [slice(8 * i, 8 * i + 8) for i in range(8)]  # worker i's rows
    local = [jax.grad(loss_fn)(params, x_host[r], y_host[r]) for r in rows]
    mean = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *local)
    ratios = np.concatenate(
        [((np.asarray(params[k]) - np.asarray(new[k])) / (LR * mean[k])).ravel() for k in params]
    )
    out = {
        "grad": grad,
        "sent_bytes_per_device": int(audit.traffic().sent.max()),
        "collectives": [
            {
                "kind": op.kind,
                "shape": getattr(op, "shape", "?"),
                "bytes": int(op.sent.max()),
                "op": op.op_name,
            }
            for op in audit.ops
        ],
        "update_over_mean_gradient": [float(ratios.min()), float(ratios.max())],
    }
    unlogged = getattr(jaxcomm, "unlogged_traffic", None)
    if unlogged is not None:
        out["unlogged_bytes_per_device"] = int(sum(op.sent.max() for op in unlogged(compiled)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grad", choices=["worker", "plain"], default="worker")
    args = parser.parse_args(argv)
    if args.grad == "worker" and not hasattr(jaxcomm, "worker_grad"):
        sys.exit("this jaxcomm has no worker_grad; run with --grad plain")
    print(json.dumps(measure(args.grad), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
