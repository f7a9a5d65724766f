"""A Flax NNX classifier on scikit-learn's 8x8 digits, data parallel over 8 workers.

    python examples/nnx_digits.py --aggregator ar_topk --steps 200

Parameters stay replicated (``in_specs=P()``); each worker takes its own gradient with
``jaxcomm.worker_grad`` and the aggregator chosen by ``--aggregator`` combines them. A fifth
of the digits is held out: training batches never draw from it, and the accuracy printed at
the end is measured on it. The bytes each worker sent come from the aggregator's traffic
log, read after every step.
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
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from sklearn.datasets import load_digits

import jaxcomm

# Aggregators chain before Adam; the sign family, Marsit and DeMo are whole optimizers.
AGGREGATORS = {
    "psum": lambda: jaxcomm.dense_all_reduce("data", reduce="psum"),
    "ring": lambda: jaxcomm.dense_all_reduce("data", reduce="ring"),
    "tree": lambda: jaxcomm.dense_all_reduce("data", reduce="tree"),
    "ec_quantized": lambda: jaxcomm.ec_quantized_all_reduce("data", bits=4),
    "ar_topk": lambda: jaxcomm.ar_topk("data", ratio=0.05),
    "ar_topk_var": lambda: jaxcomm.ar_topk("data", ratio=0.05, select="var"),
    "lw_topk": lambda: jaxcomm.lw_topk("data", ratio=0.05),
    "ms_topk": lambda: jaxcomm.ms_topk("data", ratio=0.05),
    "chunk_topk": lambda: jaxcomm.chunk_topk("data", chunk=256, k=16),
    "statistical_quantized": lambda: jaxcomm.statistical_quantized("data", bits=2),
    "powersgd": lambda: jaxcomm.powersgd("data", rank=2),
    "error_fed": lambda c=jaxcomm.codecs.StatQuantizeCodec(2): jaxcomm.error_fed(  # noqa: B008
        c, "data", exchange="two_phase"
    ),
}
WHOLE = {
    "marsit": lambda: jaxcomm.marsit("data", local_lr=0.05, global_lr=2e-3, full_sync_every=5),
    "signsgd_mv": lambda: jaxcomm.signsgd_mv("data", lr=2e-3),
    "ef_signsgd": lambda: jaxcomm.ef_signsgd("data", lr=2e-3),
    "ssdm": lambda: jaxcomm.ssdm("data", lr=2e-3),
    "cascading_sign": lambda: jaxcomm.cascading_sign("data", lr=1e-3),
    "demo": lambda: jaxcomm.demo("data", lr=2e-3, beta=0.9),
}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(64, 128, rngs=rngs)
        self.out = nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.relu(self.hidden(x.reshape(x.shape[0], -1))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--aggregator", default="ar_topk", choices=[*AGGREGATORS, *WHOLE])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)

    mesh = jax.make_mesh((8,), ("data",))
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    if args.aggregator in WHOLE:
        tx = optax.chain(WHOLE[args.aggregator](), optax.identity())
    else:
        tx = optax.chain(AGGREGATORS[args.aggregator](), optax.adam(3e-3))
    # The chain's state: the aggregator's differs per worker (stored with a leading [8] axis),
    # the optimizer's after it is the same on every worker (replicated).
    state_specs = (P("data"), P())

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def init(params):
        agg, rest = tx.init(params)
        return jax.tree.map(lambda a: a[None], agg), rest

    def step(params, opt_state, x, y):  # runs on every worker; x, y: this worker's rows
        agg, rest = opt_state
        opt_state = (jax.tree.map(lambda a: a[0], agg), rest)
        loss, grads = jaxcomm.worker_value_and_grad(loss_fn, "data")(params, x, y)
        updates, (agg, rest) = tx.update(grads, opt_state, params)
        opt_state = (jax.tree.map(lambda a: a[None], agg), rest)
        return optax.apply_updates(params, updates), opt_state, loss[None]

    opt_state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=state_specs))(params)
    train_step = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), state_specs, P("data"), P("data")),
            out_specs=(P(), state_specs, P("data")),
        )
    )

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    rng, batch, losses = np.random.default_rng(0), 128, []
    order = rng.permutation(len(labels))
    held_out, train = order[: len(order) // 5], order[len(order) // 5 :]
    sharded = NamedSharding(mesh, P("data"))
    sent = np.zeros(8, np.int64)  # bytes each worker sent, over all steps
    for i in range(args.steps):
        ids = rng.choice(train, batch, replace=False)
        x, y = jax.device_put((images[ids], labels[ids]), sharded)
        if i == 0:  # every collective of the step is one the aggregator logs
            unlogged = jaxcomm.unlogged_traffic(train_step.lower(params, opt_state, x, y).compile())
        params, opt_state, loss = train_step(params, opt_state, x, y)
        sent += step_bytes(opt_state)
        losses.append(float(jnp.mean(loss)))
        if i % 50 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {losses[-1]:.3f}")
    logits = nnx.merge(graphdef, params)(jnp.asarray(images[held_out]))
    accuracy = float(jnp.mean(jnp.argmax(logits, -1) == labels[held_out]))
    per_step = int(sent.max()) / args.steps
    print(f"bytes sent per worker per step: {per_step:,.0f} (mean over {args.steps} steps)")
    print(
        f"{args.aggregator}: held-out accuracy {accuracy:.3f} ({len(held_out)} digits not "
        f"trained on), unlogged collectives: {len(unlogged)}"
    )
    return {
        "losses": losses,
        "accuracy": accuracy,
        "held_out": held_out,
        "train": train,
        "sent_per_step": per_step,
        "unlogged": unlogged,
    }


def step_bytes(opt_state) -> np.ndarray:
    """``int64[workers]``: the bytes each worker sent in the step that wrote ``opt_state``'s
    traffic logs (every log in the state, summed)."""
    logs = jaxcomm.network.find_logs(opt_state)
    return sum(jaxcomm.network.as_bytes(np.asarray(log.sent_bytes)).reshape(-1) for log in logs)


if __name__ == "__main__":
    main()
