"""JAX's multi-process runtime for the trainers: start it, and read global arrays on a host.

A multi-process run is ``P`` copies of ``python -m train`` (one per host, or several on one
machine through :mod:`train.launch`), each owning some of the mesh's devices. Each process
calls :func:`initialize` before touching JAX: it reads

- ``JAXCOMM_COORDINATOR`` (``host:port`` of process 0's coordinator service),
  ``JAXCOMM_NUM_PROCESSES`` and ``JAXCOMM_PROCESS_ID``, as :mod:`train.launch` sets them; or
- ``JAXCOMM_DISTRIBUTED=auto``: ``jax.distributed.initialize()`` with no arguments, which
  detects the cluster itself (SLURM, Open MPI, Kubernetes, Cloud TPU environments).

On CPU the collectives between processes go over gloo (TCP); on GPUs over NCCL, JAX's
default there.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_AUTO",
    "initialize",
    "is_primary",
    "to_host",
]

ENV_COORDINATOR = "JAXCOMM_COORDINATOR"
ENV_NUM_PROCESSES = "JAXCOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXCOMM_PROCESS_ID"
ENV_AUTO = "JAXCOMM_DISTRIBUTED"
# Exit code of a process of a multi-process run stopped at once by a second Ctrl-C: it
# skips JAX's shutdown barrier (the others are not coming to it), and the launcher stops the
# others at once on seeing it.
STOPPED_AT_ONCE = 119  # not a code Python, a signal or the trainer's errors use


def requested(environ: dict[str, str] | None = None) -> bool:
    """Whether the environment asks for a multi-process run."""
    env = os.environ if environ is None else environ
    auto = env.get(ENV_AUTO, "")
    if auto not in ("", "auto"):
        raise ValueError(f"{ENV_AUTO} must be 'auto' or unset, got {auto!r}")
    return ENV_COORDINATOR in env or auto == "auto"


def _env_int(env: dict[str, str], name: str, lo: int, hi: int | None = None) -> int:
    raw = env.get(name)
    if raw is None:
        raise ValueError(f"{name} must be set with {ENV_COORDINATOR}")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < lo or (hi is not None and value > hi):
        top = "" if hi is None else f" and <= {hi}"
        raise ValueError(f"{name} must be >= {lo}{top}, got {value}")
    return value


def initialize(environ: dict[str, str] | None = None) -> bool:
    """Start ``jax.distributed`` from the environment; False (nothing done) when not asked.

    Must run before JAX creates its backends (before the first array or device query).
    """
    env = dict(os.environ if environ is None else environ)
    if not requested(env):
        return False
    import jax

    # gloo carries CPU collectives between processes; GPUs use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # JAX's preemption service catches SIGTERM; a launcher stopping a run means it.
    jax.config.update("jax_enable_preemption_service", False)
    if env.get(ENV_AUTO, "") == "auto" and ENV_COORDINATOR not in env:
        jax.distributed.initialize()
        return True
    address = env[ENV_COORDINATOR]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ENV_COORDINATOR} must be host:port, got {address!r}")
    n = _env_int(env, ENV_NUM_PROCESSES, 1)
    pid = _env_int(env, ENV_PROCESS_ID, 0, n - 1)
    # A coordinator on this machine only (train.launch) listens on loopback alone, not on
    # every interface; a cluster's coordinator keeps JAX's default.
    local = host in ("localhost", "::1", "[::1]") or host.startswith("127.")
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=n,
        process_id=pid,
        coordinator_bind_address=address if local else None,
    )
    return True


def is_primary() -> bool:
    """True on the process that writes files (process 0; the only one of a 1-process run)."""
    import jax

    return jax.process_index() == 0


def to_host(tree: Any) -> Any:
    """Every leaf of ``tree`` as a whole host ``numpy`` array on every process.

    One process: ``np.asarray``. Several: an all-gather of the leaves (every process must
    call it at the same point of the program) via
    ``jax.experimental.multihost_utils.process_allgather``.
    """
    import jax

    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree.flatten(tree)
    # Every device array is gathered, also one this process holds whole: which leaves go
    # through the collective must be the same on every process, and an array on another
    # process's devices only looks fully addressable (it has no shards) where it is absent.
    spread = [i for i, a in enumerate(leaves) if isinstance(a, jax.Array)]
    # Each process fills in the shards it holds (an array may live on a few processes'
    # devices only) and a mask of them; all leaves travel as one byte buffer in a single
    # all-gather over every process.
    chunks, layout = [], []
    for i in spread:
        a = leaves[i]
        data, have = np.zeros(a.shape, a.dtype), np.zeros(a.shape, np.bool_)
        for shard in a.addressable_shards:
            data[shard.index] = np.asarray(shard.data)
            have[shard.index] = True
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        chunks += [raw, have.reshape(-1).view(np.uint8)]
        layout.append((i, a.shape, data.dtype, raw.size, have.size))
    out = [np.asarray(a) if i not in spread else None for i, a in enumerate(leaves)]
    if chunks:
        gathered = np.asarray(multihost_utils.process_allgather(np.concatenate(chunks)))
        at = 0
        for i, shape, dtype, nbytes, n in layout:
            data = gathered[:, at : at + nbytes].copy().view(dtype).reshape(-1, *shape)
            have = gathered[:, at + nbytes : at + nbytes + n].astype(bool).reshape(-1, *shape)
            at += nbytes + n
            if not have.any(0).all():
                raise RuntimeError(f"to_host: leaf {i} has elements no process holds")
            first = np.argmax(have, axis=0)[None]
            out[i] = np.take_along_axis(data, first, 0)[0]
    return jax.tree.unflatten(treedef, out)
