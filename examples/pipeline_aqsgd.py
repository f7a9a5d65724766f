"""Your own model split into 4 pipeline stages, with AQ-SGD at every stage boundary.

    python examples/pipeline_aqsgd.py --fw-bits 2 --bw-bits 4 --epochs 6

Stage 0 embeds an 8x8 digit, every stage runs a residual block of your own, the last stage
computes the loss. The first epoch's activations cross in float32; from the second epoch on
only quantized deltas against each sample's previous message (kept in a ``MessageBuffer``
per boundary, on the host) cross.
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

S, M, MB, WIDTH = 4, 4, 16, 64  # stages, microbatches per step, samples per microbatch, width


def first_fn(p, micro):  # stage 0's input layer: [MB, 64] pixels -> [MB, WIDTH]
    return micro["x"] @ p["embed"]


def stage_fn(p, h):  # your own layers, on every stage
    return h + jnp.tanh(h @ p["w1"]) @ p["w2"]


def last_fn(p, h, micro):  # the last stage's loss of one microbatch
    logits = h @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, micro["y"]).mean()


def init_stage(key):
    k = jax.random.split(key, 4)
    return {
        "embed": jax.random.normal(k[0], (64, WIDTH)) / 8.0,
        "w1": jax.random.normal(k[1], (WIDTH, WIDTH)) / np.sqrt(WIDTH),
        "w2": jnp.zeros((WIDTH, WIDTH)),
        "head": jax.random.normal(k[3], (WIDTH, 10)) / np.sqrt(WIDTH),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fw-bits", type=int, default=2)
    parser.add_argument("--bw-bits", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args(argv)

    mesh = jax.make_mesh((S,), ("stage",), devices=jax.devices()[:S])
    boundary = jaxcomm.pipeline.aqsgd_boundary(args.fw_bits, args.bw_bits)
    loss_fn = jaxcomm.pipeline.gpipe(
        first_fn, stage_fn, last_fn, axis_name="stage", boundary=boundary
    )
    tx = optax.adam(3e-3)  # each stage updates its own parameters: no data axis here

    def step(params, opt_state, inputs, state, key, seen):
        params, opt_state, state = jax.tree.map(lambda a: a[0], (params, opt_state, state))
        (loss, (state, log)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, inputs, state, key, seen
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return loss, jax.tree.map(lambda a: a[None], (params, opt_state, state, log))

    def compiled_step(seen):  # one program per boundary mode (first visit or deltas)
        f = jax.shard_map(
            lambda *a: step(*a, seen),
            mesh=mesh,
            in_specs=(P("stage"), P("stage"), P(), P("stage"), P()),
            out_specs=(P(), P("stage")),
            check_vma=False,  # the stages hold different parameters by construction
        )
        return jax.jit(f)

    steps = {False: compiled_step(False), True: compiled_step(True)}
    sharded = NamedSharding(mesh, P("stage"))
    params = jax.device_put(jax.vmap(init_stage)(jax.random.split(jax.random.key(0), S)), sharded)
    opt_state = jax.jit(jax.vmap(tx.init), out_shardings=sharded)(params)
    buffers = [jaxcomm.pipeline.MessageBuffer(args.samples, (WIDTH,)) for _ in range(S - 1)]

    digits = load_digits()
    images = (digits.images.reshape(-1, 64) / 16.0).astype(np.float32)[: args.samples]
    labels = digits.target.astype(np.int32)[: args.samples]
    rng, losses, sent, unlogged = np.random.default_rng(0), [], {}, None
    batch = M * MB
    for epoch in range(args.epochs):
        order = rng.permutation(args.samples)
        for i in range(args.samples // batch):
            ids = order[i * batch : (i + 1) * batch]
            seen = bool(all(buf.seen(ids).all() for buf in buffers))
            prev = [buf.read(ids).reshape(M, MB, WIDTH) for buf in buffers]
            zeros = np.zeros((M, MB, WIDTH), np.float32)
            state = jaxcomm.pipeline.BoundaryState(
                prev_in=np.stack([zeros, *prev]), prev_out=np.stack([*prev, zeros])
            )  # stage s receives over boundary s - 1 and sends over boundary s
            inputs = {"x": images[ids].reshape(M, MB, 64), "y": labels[ids].reshape(M, MB)}
            args_ = (
                params,
                opt_state,
                inputs,
                jax.device_put(state, sharded),
                jax.random.key(epoch * 1000 + i),
            )
            if seen not in sent:  # audit each program once: bytes and unlogged collectives
                program = steps[seen].lower(*args_).compile()
                sent[seen] = jaxcomm.wire_audit(program).traffic().sent
                unlogged = (unlogged or ()) + jaxcomm.unlogged_traffic(program)
            loss, (params, opt_state, new_state, log) = steps[seen](*args_)
            new_prev = np.asarray(new_state.prev_out)
            for b, buf in enumerate(buffers):  # what boundary b's receiver now holds
                buf.write(ids, new_prev[b].reshape(batch, WIDTH))
            losses.append(float(loss))
        print(f"epoch {epoch}  loss {np.mean(losses[-(args.samples // batch):]):.3f}  "
              f"{'deltas' if seen else 'float32'}")  # fmt: skip
    for mode, bytes_ in sent.items():
        print(
            f"{'deltas ' if mode else 'float32'}: bytes sent per stage per step {bytes_.tolist()}"
        )
    if len(sent) == 2:
        ratio = sent[False].sum() / sent[True].sum()
        print(f"AQ-SGD steps send {ratio:.1f}x less than the first epoch's")
    print(f"unlogged collectives: {len(unlogged)}")
    return {"losses": losses, "unlogged": unlogged, "sent": sent}


if __name__ == "__main__":
    main()
