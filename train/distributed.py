"""JAX's multi-process runtime for the trainers: start it, and read global arrays on a host.

A multi-process run is ``P`` copies of ``python -m train`` (one per host, or several on one
machine through :mod:`train.launch`), each owning some of the mesh's devices. Each process
calls :func:`initialize` before touching JAX: it reads

- ``JAXCOMM_COORDINATOR`` (``host:port`` of process 0's coordinator service),
  ``JAXCOMM_NUM_PROCESSES`` and ``JAXCOMM_PROCESS_ID``, as :mod:`train.launch` sets them; or
- ``JAXCOMM_DISTRIBUTED=auto``: ``jax.distributed.initialize()`` with no arguments, which
  detects the cluster itself (SLURM, Open MPI, Kubernetes, Cloud TPU environments).

On CPU the collectives between processes go over gloo (TCP); on GPUs over NCCL, JAX's
default there. Each process's gloo listens on one address, which its peers connect to:

- a coordinator on this machine (``127.0.0.1``, ``localhost``, ``::1``: :mod:`train.launch`):
  the coordinator's own loopback address, so nothing listens on the network;
- a cluster: the address this machine's host name resolves to (JAX's choice), unless
  ``JAXCOMM_GLOO_HOST`` (a host name or address of this machine) or
  ``JAXCOMM_GLOO_INTERFACE`` (a network interface such as ``eth0``: its address) says
  otherwise. Either variable also overrides the loopback choice of a local coordinator.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "free_port",
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_AUTO",
    "ENV_GLOO_HOST",
    "ENV_GLOO_INTERFACE",
    "gloo_address",
    "initialize",
    "is_primary",
    "to_host",
]

ENV_COORDINATOR = "JAXCOMM_COORDINATOR"
ENV_NUM_PROCESSES = "JAXCOMM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXCOMM_PROCESS_ID"
ENV_AUTO = "JAXCOMM_DISTRIBUTED"
ENV_GLOO_HOST = "JAXCOMM_GLOO_HOST"
ENV_GLOO_INTERFACE = "JAXCOMM_GLOO_INTERFACE"
# Set by train.launch on the processes it starts: messages then name its command.
ENV_LAUNCHED = "JAXCOMM_LAUNCHED"
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


def _local_host(host: str) -> bool:
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


def gloo_address(
    environ: dict[str, str] | None = None, coordinator_host: str | None = None
) -> tuple[str | None, str | None] | None:
    """Where gloo listens, as ``(hostname, interface)`` (one of them set), or None for JAX's
    choice (the address of this machine's host name): ``JAXCOMM_GLOO_HOST`` or
    ``JAXCOMM_GLOO_INTERFACE`` when set, else the loopback address of a local coordinator
    (``coordinator_host``; None for a cluster that finds its coordinator itself)."""
    env = os.environ if environ is None else environ
    host = env.get(ENV_GLOO_HOST, "").strip()
    interface = env.get(ENV_GLOO_INTERFACE, "").strip()
    if host and interface:
        raise ValueError(
            f"set {ENV_GLOO_HOST} or {ENV_GLOO_INTERFACE}, not both (got {host!r} and "
            f"{interface!r})"
        )
    if host:
        return host.removeprefix("[").removesuffix("]"), None
    if interface:
        return None, interface
    if coordinator_host is not None and _local_host(coordinator_host):
        return coordinator_host.removeprefix("[").removesuffix("]"), None
    return None


def _gloo_listener(hostname: str | None, interface: str | None) -> Callable[[], None]:
    """A function that makes JAX's CPU backend, once created, use gloo listening on
    ``hostname`` or on ``interface``'s address; call it after ``jax.distributed.initialize``
    and before JAX creates its backends.

    JAX has no public option for it: its CPU backend factory is registered again with gloo
    collectives made by ``make_gloo_tcp_collectives(hostname=..., interface=...)``, which JAX
    itself calls without them. Raises RuntimeError at once when this JAX lacks those
    internals.
    """
    import inspect

    import jax

    where = f"host {hostname!r}" if hostname else f"interface {interface!r}"
    try:
        from jax._src import distributed as jax_distributed
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        make_collectives = _jax.make_gloo_tcp_collectives
        make_client = xla_bridge.make_cpu_client
        registration = xla_bridge._backend_factories["cpu"]
        state = jax_distributed.global_state
        usable = (
            "collectives" in inspect.signature(make_client).parameters
            and "interface" in (make_collectives.__doc__ or "")
            and hasattr(registration, "priority")
            and hasattr(state, "client")
        )
    except (ImportError, AttributeError, KeyError, TypeError, ValueError):
        usable = False
    if not usable:
        raise RuntimeError(
            f"cannot make gloo listen on {where} with JAX {jax.__version__}: the internals "
            "this needs (jax._src.xla_bridge.make_cpu_client(collectives=...) and "
            "make_gloo_tcp_collectives(hostname=..., interface=...) in jax._src.lib._jax) "
            "are missing; use a JAX version that has them (0.10.x does)"
        )

    def cpu_client():
        if state.client is None:  # jax.distributed did not start: nothing to connect
            return make_client()
        try:
            collectives = make_collectives(
                distributed_client=state.client, hostname=hostname, interface=interface
            )
        except Exception as e:
            raise RuntimeError(
                f"gloo cannot listen on {where}: {e}; set {ENV_GLOO_HOST} to an address of this "
                f"machine or {ENV_GLOO_INTERFACE} to one of its network interfaces"
            ) from e
        return make_client(collectives=collectives)

    def register() -> None:
        xla_bridge.register_backend_factory(
            "cpu",
            cpu_client,
            priority=registration.priority,
            fail_quietly=registration.fail_quietly,
        )

    return register


def initialize(environ: dict[str, str] | None = None) -> bool:
    """Start ``jax.distributed`` from the environment; False (nothing done) when not asked.

    Must run before JAX creates its backends (before the first array or device query).
    Raises ValueError for a malformed environment, RuntimeError where gloo must listen on a
    chosen address and this JAX cannot be told one.
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
        gloo = gloo_address(env)
        listen = None if gloo is None else _gloo_listener(*gloo)
        jax.distributed.initialize()
        if listen is not None:
            listen()
        return True
    address = env[ENV_COORDINATOR]
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ENV_COORDINATOR} must be host:port, got {address!r}")
    n = _env_int(env, ENV_NUM_PROCESSES, 1)
    pid = _env_int(env, ENV_PROCESS_ID, 0, n - 1)
    gloo = gloo_address(env, host)
    listen = None if gloo is None else _gloo_listener(*gloo)
    # A coordinator on this machine only (train.launch) listens on loopback alone, not on
    # every interface; a cluster's coordinator keeps JAX's default.
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=n,
        process_id=pid,
        coordinator_bind_address=address if _local_host(host) else None,
    )
    if listen is not None:
        listen()
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
