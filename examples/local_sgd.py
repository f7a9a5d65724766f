"""Local SGD and DreamDDP wrapping your own optimizer: 8 workers train their own copies of an
MLP on scikit-learn's digits and average layers on a schedule.

    python examples/local_sgd.py --sync dreamddp --period 5 --steps 200

Each worker keeps its own parameters between synchronisations, so parameters live per
worker (a leading [8] axis outside ``shard_map``, ``P("data")``), not replicated.
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

LAYERS = ["layer0", "layer1", "layer2"]  # input to output: DreamDDP's layer order


def init_params(key, sizes=(64, 256, 256, 10)):
    keys = jax.random.split(key, len(LAYERS))
    return {
        name: {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for name, k, a, b in zip(LAYERS, keys, sizes[:-1], sizes[1:], strict=True)
    }


def loss_fn(params, batch):
    x, y = batch
    for name in LAYERS[:-1]:
        x = jax.nn.relu(x @ params[name]["w"] + params[name]["b"])
    logits = x @ params[LAYERS[-1]]["w"] + params[LAYERS[-1]]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync", default="dreamddp", choices=["local_sgd", "dreamddp"])
    parser.add_argument("--period", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--network", default="1ms,100Mbps")
    args = parser.parse_args(argv)

    digits = load_digits()
    images = (digits.images.reshape(-1, 64) / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    params = init_params(jax.random.key(0))
    inner = optax.adam(3e-3)  # your optimizer; its state stays on each worker
    if args.sync == "local_sgd":
        tx = jaxcomm.local_sgd(inner, "data", period=args.period)
    else:  # DreamDDP: which layers to average at which local step, from a layer profile
        batch = (images[:32], labels[:32])
        prof = jaxcomm.compute.profile_layers(
            loss_fn, params, batch, LAYERS, roofline=jaxcomm.compute.roofline("v100")
        )
        comm = prof.comm_s(jaxcomm.network.Network.parse(args.network), n=8)
        schedule = jaxcomm.schedules.dreamddp_schedule(
            prof.backward_s, comm, args.period, forward_s=prof.forward_s
        )
        print(schedule)
        tx = jaxcomm.partial_local_sgd(inner, "data", schedule=schedule, layers=LAYERS)

    mesh = jax.make_mesh((8,), ("data",))
    lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
    first = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731

    def step(params, opt_state, x, y):  # every worker: its own parameters and state
        params, opt_state = first(params), first(opt_state)
        loss, grads = jaxcomm.worker_value_and_grad(loss_fn, "data")(params, (x, y))
        updates, opt_state = tx.update(grads, opt_state, params)  # local step, then averaging
        return lead(optax.apply_updates(params, updates)), lead(opt_state), loss[None]

    sharded = NamedSharding(mesh, P("data"))
    params = jax.device_put(jax.tree.map(lambda a: jnp.stack([a] * 8), params), sharded)
    init = jax.shard_map(
        lambda p: lead(tx.init(first(p))), mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )
    opt_state = jax.jit(init)(params)
    train_step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))

    rng, losses = np.random.default_rng(0), []
    sent = np.zeros(8, np.int64)  # bytes each worker sent, over all steps
    for i in range(args.steps):
        ids = rng.choice(len(labels), 256, replace=False)
        x, y = jax.device_put((images[ids], labels[ids]), sharded)
        if i == 0:
            unlogged = jaxcomm.unlogged_traffic(train_step.lower(params, opt_state, x, y).compile())
        params, opt_state, loss = train_step(params, opt_state, x, y)
        # The state's traffic logs hold what this step sent (nothing on a purely local step).
        for log in jaxcomm.network.find_logs(opt_state):
            sent += jaxcomm.network.as_bytes(np.asarray(log.sent_bytes)).reshape(-1)
        losses.append(float(jnp.mean(loss)))
        if i % 50 == 0 or i == args.steps - 1:
            spread = max(float(jnp.max(jnp.std(a, axis=0))) for a in jax.tree.leaves(params))
            print(
                f"step {i:4d}  loss {losses[-1]:.3f}  largest spread between workers {spread:.2e}"
            )
    d = sum(a.size for a in jax.tree.leaves(params)) // 8
    ring = 2 * 7 * 4 * -(-d // 8)  # bytes per worker of a float32 ring all-reduce
    per_step = int(sent.max()) / args.steps
    print(
        f"bytes sent per worker per step: {per_step:,.0f} (mean over {args.steps} steps; "
        f"a float32 ring all-reduce every step: {ring:,})"
    )
    print(f"{args.sync}: unlogged collectives: {len(unlogged)}")
    return {"losses": losses, "unlogged": unlogged, "sent_per_step": per_step, "ring": ring}


if __name__ == "__main__":
    main()
