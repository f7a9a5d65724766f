"""Pure JAX + Optax: a two-layer network on scikit-learn's digits, 8 workers, AR-Topk.

    python examples/pure_jax.py --ratio 0.01 --steps 300

The train step is the README's: replicated parameters in and out of ``jax.shard_map``,
``check_vma`` on, each worker's own gradient from ``jaxcomm.worker_grad``, and a chained
optimizer state whose aggregator part is per worker.
"""

import argparse
import os

if "device_count" not in os.environ.get("XLA_FLAGS", ""):  # 8 simulated CPU devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

import jaxcomm


def init_params(key, sizes=(64, 256, 10)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def loss_fn(params, x, y):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)

    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.chain(jaxcomm.ar_topk("data", ratio=args.ratio), optax.sgd(0.1, momentum=0.9))
    state_specs = (P("data"), P())  # AR-Topk's residuals per worker, momentum replicated

    def init(params):
        agg, rest = tx.init(params)
        return jax.tree.map(lambda a: a[None], agg), rest

    def step(params, opt_state, x, y):  # x, y: this worker's rows of the batch
        agg, rest = opt_state
        opt_state = (jax.tree.map(lambda a: a[0], agg), rest)
        grads = jaxcomm.worker_grad(loss_fn, "data")(params, x, y)  # this worker's own
        updates, (agg, rest) = tx.update(grads, opt_state, params)  # top-k all-reduce here
        return optax.apply_updates(params, updates), (jax.tree.map(lambda a: a[None], agg), rest)

    params = init_params(jax.random.key(0))
    opt_state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=state_specs))(params)
    train_step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), state_specs, P("data"), P("data")),
            out_specs=(P(), state_specs),
        )
    )

    digits = load_digits()
    images = (digits.images.reshape(-1, 64) / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    full_loss = jax.jit(loss_fn)
    rng, losses, sharded = np.random.default_rng(0), [], NamedSharding(mesh, P("data"))
    for i in range(args.steps):
        ids = rng.choice(len(labels), 256, replace=False)
        x, y = jax.device_put((images[ids], labels[ids]), sharded)
        if i == 0:
            compiled = train_step.lower(params, opt_state, x, y).compile()
            unlogged = jaxcomm.unlogged_traffic(compiled)
            audited = int(
                jaxcomm.wire_audit(compiled).traffic({jaxcomm.audit.ROOT_SCOPE: 0}).sent.max()
            )
        params, opt_state = train_step(params, opt_state, x, y)
        if i % 50 == 0 or i == args.steps - 1:
            losses.append(float(full_loss(params, images, labels)))
            print(f"step {i:4d}  loss {losses[-1]:.3f}")
    d = sum(a.size for a in jax.tree.leaves(params))
    ring = 2 * 7 * 4 * -(-d // 8)  # bytes per worker of a float32 ring all-reduce
    print(f"{d:,} parameters; the step sends {audited:,} bytes per worker (float32 ring: {ring:,})")
    print(f"unlogged collectives: {len(unlogged)}")
    return {"losses": losses, "unlogged": unlogged, "audited": audited}


if __name__ == "__main__":
    main()
