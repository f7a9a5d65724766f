"""The pure JAX example over several processes with ``jax.distributed`` (one per host).

    python examples/multiprocess.py                       # 2 local processes x 4 CPU devices
    python examples/multiprocess.py --coordinator HOST:PORT --num-processes P --process-id I

The first form starts the processes itself on this machine. On a cluster, run the second on
every host (``I = 0 .. P-1``; host 0 runs the coordinator). Each process feeds only its own
workers' rows; parameters stay replicated and every process ends with the same ones.
"""

import argparse
import os
import subprocess
import sys


def spawn(processes: int, devices: int, argv: list[str]) -> int:
    """Start ``processes`` copies of this script on this machine, wired to one coordinator."""
    import socket

    with socket.socket() as s:  # a free local port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}  # fmt: skip
    common = [sys.executable, __file__, "--coordinator", f"127.0.0.1:{port}"]
    common += ["--num-processes", str(processes), *argv]
    procs = [subprocess.Popen([*common, "--process-id", str(i)], env=env) for i in range(processes)]
    codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--steps", type=int, default=100)
    args, rest = parser.parse_known_args(argv)
    if args.coordinator is None:
        return spawn(args.num_processes, 8 // args.num_processes, ["--steps", str(args.steps)])

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU; GPUs use NCCL
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from pure_jax import init_params, loss_fn
    from sklearn.datasets import load_digits

    import jaxcomm

    mesh = jax.make_mesh((jax.device_count(),), ("data",))  # every process's devices
    tx = optax.chain(jaxcomm.ar_topk("data", ratio=0.01), optax.sgd(0.1, momentum=0.9))
    state_specs = (P("data"), P())

    def init(params):
        agg, rest = tx.init(params)
        return jax.tree.map(lambda a: a[None], agg), rest

    def step(params, opt_state, x, y):
        agg, rest = opt_state
        opt_state = (jax.tree.map(lambda a: a[0], agg), rest)
        grads = jaxcomm.worker_grad(loss_fn, "data")(params, x, y)
        updates, (agg, rest) = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), (jax.tree.map(lambda a: a[None], agg), rest)

    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = jax.tree.map(  # the same values on every process, as one global array
        lambda a: jax.make_array_from_process_local_data(replicated, np.asarray(a)),
        init_params(jax.random.key(0)),
    )
    opt_state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=state_specs))(params)
    train_step = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), state_specs, P("data"), P("data")),
                      out_specs=(P(), state_specs))
    )  # fmt: skip

    digits = load_digits()
    images = (digits.images.reshape(-1, 64) / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    rng, batch = np.random.default_rng(0), 256  # the same draws on every process
    me, n = jax.process_index(), jax.process_count()
    sent = 0  # bytes sent by this process's busiest worker, over all steps
    for i in range(args.steps):
        ids = rng.choice(len(labels), batch, replace=False)
        mine = ids.reshape(n, -1)[me]  # this process's workers' rows, in mesh order
        x = jax.make_array_from_process_local_data(rows, images[mine])
        y = jax.make_array_from_process_local_data(rows, labels[mine])
        if i == 0:
            unlogged = jaxcomm.unlogged_traffic(train_step.lower(params, opt_state, x, y).compile())
        params, opt_state = train_step(params, opt_state, x, y)
        (log,) = jaxcomm.network.find_logs(opt_state)
        # A process reads only its own workers' rows of the per-worker log.
        words = [np.asarray(shard.data) for shard in log.sent_bytes.addressable_shards]
        sent += int(jaxcomm.network.as_bytes(np.concatenate(words)).max())
        if i % 25 == 0 or i == args.steps - 1:
            host = jax.tree.map(np.asarray, params)  # replicated: each process holds it all
            print(f"[process {me}] step {i:4d}  loss {float(loss_fn(host, images, labels)):.3f}",
                  flush=True)  # fmt: skip
    print(f"[process {me}] bytes sent per worker per step: {sent / args.steps:,.0f} "
          f"(mean over {args.steps} steps)", flush=True)  # fmt: skip
    print(f"[process {me}] unlogged collectives: {len(unlogged)}", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
