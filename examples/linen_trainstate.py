"""A Flax Linen CNN with a ``TrainState``, trained on scikit-learn's digits over 8 workers
with error-compensated 4-bit gradient averaging.

    python examples/linen_trainstate.py --steps 150

The whole ``TrainState`` enters ``jax.shard_map`` replicated except the aggregator's part of
the optimizer state, which is per worker (its error feedback differs between workers).
"""

import argparse
import os

if "device_count" not in os.environ.get("XLA_FLAGS", ""):  # 8 simulated CPU devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

import jaxcomm


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):  # x: [B, 8, 8, 1]
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Dense(64)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--bits", type=int, default=4)
    args = parser.parse_args(argv)

    mesh = jax.make_mesh((8,), ("data",))
    model = CNN()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 1)))["params"]
    tx = optax.chain(jaxcomm.ec_quantized_all_reduce("data", bits=args.bits), optax.adam(3e-3))

    def create(params):  # inside shard_map: the aggregator's state is built per worker
        state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        agg, rest = state.opt_state
        return state.replace(opt_state=(jax.tree.map(lambda a: a[None], agg), rest))

    # Specs of the TrainState's pytree: everything replicated but the aggregator's state.
    specs = TrainState(
        step=P(), apply_fn=model.apply, params=P(), tx=tx, opt_state=(P("data"), P())
    )

    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(state, x, y):
        agg, rest = state.opt_state
        state = state.replace(opt_state=(jax.tree.map(lambda a: a[0], agg), rest))
        loss, grads = jaxcomm.worker_value_and_grad(loss_fn, "data")(state.params, x, y)
        state = state.apply_gradients(grads=grads)  # gradients averaged inside the chain
        agg, rest = state.opt_state
        return state.replace(opt_state=(jax.tree.map(lambda a: a[None], agg), rest)), loss[None]

    state = jax.jit(jax.shard_map(create, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.jit(
        jax.shard_map(
            train_step,
            mesh=mesh,
            in_specs=(specs, P("data"), P("data")),
            out_specs=(specs, P("data")),
        )
    )

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    rng, losses, sharded = np.random.default_rng(0), [], NamedSharding(mesh, P("data"))
    for i in range(args.steps):
        ids = rng.choice(len(labels), 128, replace=False)
        x, y = jax.device_put((images[ids], labels[ids]), sharded)
        if i == 0:
            unlogged = jaxcomm.unlogged_traffic(step.lower(state, x, y).compile())
        state, loss = step(state, x, y)
        losses.append(float(jnp.mean(loss)))
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {losses[-1]:.3f}")
    # What crossed the wire in the last step, per worker (from the aggregator's log).
    (log,) = jaxcomm.network.find_logs(state.opt_state)
    sent = int(jaxcomm.network.as_bytes(np.asarray(log.sent_bytes)[0]))
    print(
        f"bytes sent per worker per step: {sent:,} "
        f"(a float32 ring all-reduce: {2 * 7 * 4 * -(-num(params) // 8):,})"
    )
    print(f"unlogged collectives: {len(unlogged)}")
    return {"losses": losses, "unlogged": unlogged, "sent": sent}


def num(params):
    return sum(a.size for a in jax.tree.leaves(params))


if __name__ == "__main__":
    main()
