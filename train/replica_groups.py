"""Replica groups as a trainer's synchronisation (``groups:`` with ``sync: diloco``).

The run is one replica group of several: separate programs (each its own JAX runtime,
its own workers and mesh) that run DiLoCo's outer step between them over torchft
(:mod:`train.replica`). Inside the group the configured aggregator averages the group's
own workers every step (:class:`train.sync.EveryStep`); between groups
:class:`jaxcomm.groups.GroupOuter` forms each fragment's pseudo-gradient, the codec's
payload, the token-weighted mean and the outer step, on the host.

**Overlap.** At a fragment's synchronising step the group reads the fragment's parameters,
and a host thread encodes, exchanges and steps ``theta_sync`` while the next ``overlap``
inner steps run on the devices; at the merge step the group waits for the thread (if it
is not done) and mixes ``alpha * local + (1 - alpha) * theta_sync`` into its parameters,
as Streaming DiLoCo does. ``overlap=0`` waits at once (DiLoCo's blocking exchange).

**Membership.** Every exchange asks the lighthouse for a quorum of the live groups; a
group that died, or missed the grace window, is not in it, and the mean is over the
members present (weighted by the samples each processed since the fragment's last
exchange). A member whose header shows another run, no samples, a non-finite
pseudo-gradient, another fragment or another ``theta_sync`` is left out by every member
alike (:func:`train.replica.left_out`). A group that starts behind the others (a restart
with or without its own checkpoint) is healed by torchft from a live peer during its first
exchange: the peer's parameters, optimizer state, every fragment's ``theta_sync`` and outer
state, the step and the data position, as the peer held them when it launched that
exchange; it then takes the exchange's outer step as the others do, so it holds what they
hold. At the start a handshake waits up to ``groups.start_timeout_s`` for all groups.

**Several processes.** A group may be one ``jax.distributed`` job: its first process (the
leader) alone holds the transport and runs the exchanges; at each merge (and at the start,
and when the exchanges are settled) every process calls :meth:`ReplicaGroups._resolve`
at the same point, and the leader's outcome, its state of the fragment, or everything a heal
brought, reach the others by a broadcast inside the group. At the end the processes check
that they hold one ``theta_sync`` and one set of parameters.

**Checkpoints.** Each group saves its own run folder: the trainer's state, each fragment's
``theta_sync``, outer state and error feedback, and the count of exchanges committed. A
whole-run stop resumes bit-exactly; a group resumed while the others train on is healed
from them.

Evaluation and the exported model use ``theta_sync``. Each metrics row records the
fragment exchanged (-1: none), the groups in the last exchange and in its mean, and the
seconds the step waited for an exchange; the summary's ``groups`` entry the exchanges,
heals, bytes this group sent (what the transport sent over the wire: headers and payloads
of every try) and the compute utilisation (the devices' measured step time over the wall
time of the training loop's steady state: from the end of its first step to the end of its
last, before the wait for the last exchange, reported apart).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

import jaxcomm
from jaxcomm.groups import GroupOuter, GroupState

from .checkpoint import has_rows
from .config import Config
from .models import layer_groups
from .replica import FIELDS, Transport, array_id, fingerprint_id
from .sync import EveryStep

if TYPE_CHECKING:
    from .context import Context

__all__ = ["ReplicaGroups", "exchange_seconds", "link_utilisation"]


def _copy(tree: Any) -> Any:
    """Device copies of ``tree`` (the next step donates the originals)."""
    return jax.tree_util.tree_map(lambda a: a.copy(), tree)


def _whole_everywhere(a: Any) -> bool:
    """Whether every process holds a whole copy of ``a`` (decided from its sharding alone,
    so every process of the group decides alike)."""
    if not isinstance(a, jax.Array) or jax.process_count() == 1:
        return True
    # Not ``is_fully_addressable``: that is true in the process holding an array that lives
    # on one process's devices alone, and false in the others.
    holders = {d.process_index for d in a.sharding.device_set}
    return a.is_fully_replicated and len(holders) == jax.process_count()


def _my_part(a: jax.Array) -> np.ndarray:
    """``a``'s shards that this process writes into a gathered copy, zeros elsewhere: each
    block of ``a`` is written by the first device (by process, then id) that holds it."""
    out = np.zeros(a.shape, a.dtype)
    key = lambda index: tuple((i.start, i.stop, i.step) for i in index)  # noqa: E731
    writer: dict[tuple, Any] = {}
    held = sorted(
        a.sharding.devices_indices_map(a.shape).items(),
        key=lambda kv: (kv[0].process_index, kv[0].id),
    )
    for device, index in held:
        writer.setdefault(key(index), device)
    for shard in a.addressable_shards:
        if writer[key(shard.index)] == shard.device:
            out[shard.index] = np.asarray(shard.data)
    return out


def _gathered(tree: Any) -> Any:
    """``tree`` with each leaf that not every process holds whole (a per-worker state
    sharded over the group's processes, such as a compressed aggregator's error feedback;
    a pipeline's stages; an optimizer state on one stage's devices) gathered whole into
    host memory, bit for bit; other leaves as they are. A collective of the group: every
    process calls it at the same point."""
    from jax.experimental import multihost_utils

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    split = [i for i, a in enumerate(leaves) if not _whole_everywhere(a)]
    if split:
        # Each block written by one process, zeros by the others: the sum over processes
        # of the unsigned bits is that block, exactly.
        parts = [_my_part(leaves[i]) for i in split]
        bits = [x.view(f"u{x.dtype.itemsize}") for x in parts]
        got = multihost_utils.process_allgather(bits)
        for i, x, g in zip(split, parts, got, strict=True):
            whole = np.asarray(g).sum(axis=0, dtype=f"u{x.dtype.itemsize}")
            leaves[i] = whole.view(x.dtype).reshape(x.shape)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _local(tree: Any) -> Any:
    """Host copies of ``tree``'s replicated device arrays, read from this process's own
    copy (no collective: the exchange thread of one process may call it)."""

    def read(a: Any) -> np.ndarray:
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            if not a.is_fully_replicated:
                raise ValueError("replica groups need the state held once (replicated)")
            return np.asarray(a.addressable_shards[0].data)
        return np.asarray(a)

    return jax.tree_util.tree_map(read, tree)


def _heal_id(params: Any, opt_state: Any, step: int, position: int) -> int:
    """A 62-bit hash of a heal's trainer state (host arrays' bytes, the step and the data
    position): the server's of what it sent, the healed group's of what it installed.
    One pass over the bytes, no copy of them (BLAKE2b, about 1 GB/s a core)."""
    h = hashlib.blake2b(digest_size=8)
    for a in jax.tree_util.tree_leaves((params, opt_state)):
        h.update(np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8))
    h.update(np.asarray([step, position], np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


def _state_arrays(st: GroupState) -> list[np.ndarray]:
    """A fragment's state as a list of host arrays (for a broadcast in the group)."""
    out = [np.asarray(st.anchor), np.asarray(st.residual)]
    out += [np.asarray(a) for a in jax.tree_util.tree_leaves(st.outer)]
    return out + ([np.asarray(st.key)] if st.key is not None else [])


def _from_arrays(like: GroupState, arrays: list[np.ndarray]) -> GroupState:
    """The state :func:`_state_arrays` made, in the dtypes and structure of ``like``."""
    leaves, tree = jax.tree_util.tree_flatten(like.outer)
    n = len(leaves)
    outer = zip(arrays[2 : 2 + n], leaves, strict=True)
    cast = [np.asarray(a, np.asarray(b).dtype) for a, b in outer]
    return GroupState(
        anchor=np.asarray(arrays[0], np.asarray(like.anchor).dtype),
        outer=jax.tree_util.tree_unflatten(tree, cast),
        residual=np.asarray(arrays[1], np.asarray(like.residual).dtype),
        key=None if like.key is None else np.asarray(arrays[2 + n], np.asarray(like.key).dtype),
    )


def _put_like(host: Any, like: Any) -> Any:
    """Host arrays ``host`` on the devices and in the dtypes of ``like``."""
    return jax.tree_util.tree_map(
        lambda h, a: jax.device_put(np.asarray(h, a.dtype).reshape(a.shape), a.sharding),
        host,
        like,
    )


# A pending exchange in a group's process other than its first: the first process (the
# leader) runs the exchange and hands its outcome to the others at the merge.
REMOTE = "remote"

HEADER_BYTES = 8 * len(FIELDS)  # a group's header: one int64 per field


def exchange_seconds(payload: int, groups: int, network: Any) -> float:
    """Seconds of one exchange of a ``payload``-byte fragment between ``groups`` groups on
    ``network`` (the link each group has): torchft's quorum (a round trip to the
    lighthouse) and two ring all-gathers (the 80-byte headers, then the payloads: ``groups
    - 1`` rounds of one block each). The software's own fixed cost per exchange (tens of ms with
    torchft on a CPU, ``exchange_alpha_s`` in a run's summary) is not in it."""
    lat, rate = network.latency_s, network.bandwidth_bps
    rounds = 2 + 2 * (groups - 1)
    return rounds * lat + (groups - 1) * (payload + HEADER_BYTES) * 8 / rate


def link_utilisation(step_s: float, comm: list[float], period: int, schedule: Any,
                     overlap: int) -> tuple[float, float]:  # fmt: skip
    """Compute utilisation and the seconds of a period in the steady state (the third of
    three) when each step computes ``step_s`` and fragment ``p``'s exchange takes
    ``comm[p]`` on the link, merged ``overlap`` steps after it starts
    (:func:`train.diloco.link_step`, the clock of a one-program Streaming DiLoCo)."""
    from .diloco import link_step

    steps = jaxcomm.schedules.diloco_steps(period, schedule=schedule, overlap=overlap)
    wire: dict[str, Any] = {"t": 0.0, "free": 0.0, "arrive": {}}
    seconds = []
    for s in range(3 * period):
        kind = steps[s % period]
        seconds.append(link_step(wire, step_s, comm[kind[0]] if kind[0] >= 0 else 0.0, kind,
                                 s, overlap))  # fmt: skip
    round_s = float(sum(seconds[2 * period :]))
    return period * step_s / round_s, round_s


class ReplicaGroups(EveryStep):
    """One replica group of several (see the module docstring)."""

    reads_state = True

    def __init__(self, cfg: Config):
        # A group of several processes (one jax.distributed job): its first process alone
        # talks to the other groups; at each merge it hands the outcome (and the states it
        # changed) to the others with a broadcast inside the group.
        self._procs = jax.process_count()
        self._leader = jax.process_index() == 0
        self.cfg, self.sync, self.groups = cfg, cfg.sync, cfg.groups
        self.transport: Transport | None = None
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "jaxcomm-groups")
        self._pending: list[tuple[int, int, concurrent.futures.Future | str | None]] = []
        self._heal: dict[str, Any] | None = None  # received from a peer (exchange thread)
        self._healed_state: dict[str, Any] | None = None  # to apply on the main thread
        self._snap: dict[str, Any] | None = None
        self._last_sync: dict[int, int] = {}
        self._committed = 0  # restored from a checkpoint
        self._healed_fragment = 0  # the fragment of the exchange that healed this group
        self._clean: list[float] = []  # step times with no exchange in flight
        self._inflight = False
        self._steps_run = 0
        self._id = int.from_bytes(os.urandom(8), "little") >> 2  # this process, in headers
        self._sent_before = 0
        self._row: dict[str, Any] = {}
        self.stats = {
            "exchanges": 0, "failed": 0, "heals": 0, "left_out": 0, "sent_bytes": 0,
            "wait_s": 0.0, "busy_s": 0.0, "wall_s": 0.0, "tries": 0, "samples_in": 0,
            "exchange_alpha_s": None, "heal_served_ids": [], "heal_taken_ids": [],
        }  # fmt: skip
        self._wall0: float | None = None
        self._ctx: Context | None = None
        s = cfg.sync
        outer = optax.sgd(s.outer_lr)
        if s.outer_momentum:
            outer = optax.sgd(s.outer_lr, momentum=s.outer_momentum, nesterov=True)
        self._outer_tx = outer
        self._codec = None if s.compress is None else s.compress.error_fed_codec()
        self.alpha = s.alpha if s.alpha is not None else (0.5 if s.overlap else 0.0)
        self.fp = fingerprint_id(
            {
                "model": cfg.model.to_dict(),
                "dataset": cfg.dataset,
                "seed": cfg.seed,
                "optimizer": cfg.optimizer.to_dict(),
                "sync": s.to_dict(),
                "global_batch": cfg.global_batch,
                "count": cfg.groups.count,
                # The layout: a heal installs the peer's arrays, whose shapes it sets.
                "layout": [cfg.workers, cfg.stages],
            }
        )

    def fingerprint(self) -> dict[str, Any]:
        return {"sync": self.sync.to_dict(), "groups": [self.groups.slot, self.groups.count]}

    # ------------------------------------------------------------------ the fragments

    def start(self, ctx: Context) -> None:
        s = self.sync
        self._ctx = ctx
        # A pipeline inside the group: its parameters are staged ([replicas, stages, ...]);
        # the outer step runs on the model's own layout (replica 0, stages joined), the
        # one a data-parallel group holds, and writes back to every replica and stage.
        # Its stages may sit on several processes of the group: what is read on the host
        # is gathered whole first (a collective of the group, see :meth:`_plain`).
        self._staged = ctx.cfg.stages > 1
        self._layout = ctx.layout
        params = ctx.params
        if self._staged:
            if ctx.abstract:  # shapes only (placement aside: a stage's slice is not one)
                bare = jax.tree_util.tree_map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params
                )
                params = jax.eval_shape(lambda q: ctx.layout.model_params(ctx, q), bare)
            else:
                params = self._plain(params)
        if self._staged and not ctx.abstract:
            whole = _gathered(ctx.params) if self._procs > 1 else ctx.params
            for k, a in jax.tree_util.tree_leaves_with_path(whole):
                rows = np.asarray(a)
                if not all(np.array_equal(rows[0], r) for r in rows[1:]):
                    raise ValueError(
                        f"replica groups: the pipeline's replicas start apart at "
                        f"{jax.tree_util.keystr(k)}; the outer step reads replica 0 and "
                        "writes every replica"
                    )
        leaves = jax.tree_util.tree_leaves_with_path(params)
        if not self._staged and any(has_rows(a) for _, a in leaves):
            raise ValueError("replica groups need parameters held once (data parallel)")
        names = layer_groups(params)
        if s.fragments > len(names):
            raise ValueError(
                f"sync.fragments={s.fragments} exceeds the model's {len(names)} layers "
                f"({', '.join(names)}); choose fragments in 1..{len(names)}"
            )
        schedule = jaxcomm.schedules.streaming_schedule(
            len(names), s.period, s.fragments, pattern=s.pattern
        )
        self._schedule = schedule
        self._steps = jaxcomm.schedules.diloco_steps(s.period, schedule=schedule, overlap=0)
        frags = [sorted(g) for g in schedule.groups if g]
        top = [getattr(path[0], "key", None) for path, _ in leaves]
        self._index = [[i for i, t in enumerate(top) if t in {names[j] for j in f}] for f in frags]
        codec, decay = self._codec if self._codec is not None else (None, 1.0)
        self.outer = []
        self.state: list[GroupState] = []
        host = [np.asarray(a) for _, a in leaves] if not ctx.abstract else None
        self._sizes = [sum(int(np.prod(leaves[i][1].shape)) for i in idx) for idx in self._index]
        for idx in self._index:
            sizes = [int(np.prod(leaves[i][1].shape)) for i in idx]
            go = GroupOuter(
                self._outer_tx, codec=codec, decay=decay, sizes=sizes, seed=ctx.cfg.seed
            )
            self.outer.append(go)
            if host is not None:
                flat = np.concatenate([host[i].astype(np.float32).reshape(-1) for i in idx])
                self.state.append(go.init(flat, slot=self.groups.slot))

    def _plain(self, params: Any) -> Any:
        """A pipeline's ``params`` in the model's own layout, on the host (replica 0). With
        its stages on several processes a collective of the group: every process calls it
        at the same point (the launch of an exchange, a merge, an evaluation)."""
        whole = _gathered(params) if self._procs > 1 else params
        host = jax.tree_util.tree_map(np.asarray, whole)
        return self._layout.model_params(self._ctx, host)

    def _flat(self, params: Any, p: int) -> np.ndarray:
        leaves = jax.tree_util.tree_leaves(self._plain(params) if self._staged else params)
        parts = [np.asarray(leaves[i], np.float32).reshape(-1) for i in self._index[p]]
        return np.concatenate(parts)

    def _with(self, params: Any, p: int, flat: np.ndarray) -> Any:
        """``params`` with fragment ``p``'s leaves set from ``flat``."""
        if self._staged:
            return self._with_staged(params, p, flat)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        at = 0
        for i in self._index[p]:
            a = leaves[i]
            size = int(np.prod(a.shape))
            host = flat[at : at + size].astype(a.dtype).reshape(a.shape)
            leaves[i] = jax.device_put(host, a.sharding)
            at += size
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _with_staged(self, params: Any, p: int, flat: np.ndarray) -> Any:
        """A pipeline's ``params`` with fragment ``p`` set from ``flat``: the model's own
        layout restaged, on every replica (they hold the same values: the group's
        aggregator averages them every step) and every stage's copy of the embedding and
        head (the stage that uses each is the one read back)."""
        from .pipeline import stage_params

        leaves, treedef = jax.tree_util.tree_flatten(self._plain(params))
        at = 0
        for i in self._index[p]:
            size = int(np.size(leaves[i]))
            leaves[i] = flat[at : at + size].astype(leaves[i].dtype).reshape(leaves[i].shape)
            at += size
        plain = jax.tree_util.tree_unflatten(treedef, leaves)
        staged = stage_params(plain, self._layout.gpt_cfg, self.cfg.stages)

        def put(h: np.ndarray, a: jax.Array) -> jax.Array:
            return jax.device_put(np.broadcast_to(np.asarray(h, a.dtype), a.shape), a.sharding)

        return jax.tree_util.tree_map(put, staged, params)

    # ------------------------------------------------------------------ the transport

    def _connect(self) -> Transport:
        g = self.groups
        if self.transport is None:
            try:
                self.transport = Transport(
                    g.lighthouse,
                    g.slot,
                    state_dict=self._state_dict,
                    on_heal=self._on_heal,
                    timeout_s=g.timeout_s,
                    quorum_timeout_s=g.quorum_timeout_s,
                    connect_timeout_s=g.connect_timeout_s,
                    retries=g.retries,
                    host=g.host,
                )
            except (RuntimeError, OSError) as e:  # torchft's and the socket's
                first = str(e).split(";")[0]
                if "failed to connect" not in first:  # e.g. the store's port is taken
                    raise ConnectionError(
                        f"group {g.slot}: its transport could not start on groups.host="
                        f"{g.host!r} ({first})"
                    ) from None
                raise ConnectionError(
                    f"group {g.slot}: no lighthouse at groups.lighthouse={g.lighthouse!r} "
                    f"within groups.connect_timeout_s={g.connect_timeout_s:g} ({first}); start "
                    "it first (python -m train.groups starts one) or fix the address"
                ) from None
        return self.transport

    def _snapshot(self, ctx: Context) -> None:
        """What a peer healed from this group receives, as of now (device copies; held by
        the leader). In a group of several processes every process calls it at the same
        point: the leaves sharded across them are gathered whole (into every process's
        host memory: a collective, which the others join and then drop)."""
        params, opt_state = ctx.params, ctx.opt_state
        if self._procs > 1:  # a pipeline's stages are sharded across them, too
            params, opt_state = _gathered(params), _gathered(opt_state)
        if not self._leader:
            return
        with self._lock:
            self._snap = {
                "params": _copy(params),
                "opt_state": _copy(opt_state),
                "step": ctx.step,
                "position": ctx.loader.position,
                "last_sync": dict(self._last_sync),
            }

    def _state_dict(self) -> dict[str, Any]:
        """The live state a healing peer receives (called on the exchange thread)."""
        with self._lock:
            snap = dict(self._snap)
            anchors = [s.anchor for s in self.state]
            outers = [s.outer for s in self.state]
        snap["params"] = _local(snap["params"])
        snap["opt_state"] = _local(snap["opt_state"])
        served = _heal_id(snap["params"], snap["opt_state"], snap["step"], snap["position"])
        with self._lock:
            self.stats["heal_served_ids"].append(served)
        return {**snap, "anchors": anchors, "outers": outers, "fingerprint": self.fp}

    def _on_heal(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fp:
            # Raised inside torchft's quorum: this try fails and nothing is installed.
            raise ValueError(
                f"group {self.groups.slot}: the live state offered by a peer is another run's "
                "(its settings differ); nothing was taken"
            )
        self._heal = state

    def _take_heal(self) -> None:
        """Install a peer's fragments' states (exchange thread): its ``theta_sync`` and
        outer states, this group's own error feedback started afresh."""
        state, self._heal = self._heal, None
        with self._lock:
            self.state = [
                go.init(a, slot=self.groups.slot)._replace(outer=o)
                for go, a, o in zip(self.outer, state["anchors"], state["outers"], strict=True)
            ]
            self._healed_state = state
        self.stats["heals"] += 1

    def _apply_heal(self, ctx: Context) -> None:
        """Take a peer's parameters, optimizer state, step and data position (main thread)."""
        with self._lock:
            state, self._healed_state = self._healed_state, None
        if state is None:
            return
        params = _put_like(state["params"], ctx.params)
        ctx.layout.set_state(ctx, params, _put_like(state["opt_state"], ctx.opt_state))
        ctx.step = int(state["step"])
        ctx.loader.position = int(state["position"])
        self._last_sync = {int(k): int(v) for k, v in state["last_sync"].items()}
        if self._procs == 1:  # what was installed, read back (the server's id is beside it)
            taken = _heal_id(
                _local(ctx.params), _local(ctx.opt_state), ctx.step, ctx.loader.position
            )
            self.stats["heal_taken_ids"].append(taken)

    def _header(self, p: int, tokens: int, nbytes: int, finite: bool, step: int):
        with self._lock:
            anchors = np.concatenate([np.asarray(s.anchor).reshape(-1) for s in self.state])
        anchor = array_id(anchors)  # every fragment's: a split is seen at the next exchange

        def make(healed: bool) -> np.ndarray:
            values = {
                "slot": self.groups.slot, "tokens": 0 if healed else tokens, "nbytes": nbytes,
                "fingerprint": self.fp, "finite": int(finite), "step": step,
                "healed": int(healed), "fragment": p, "anchor": anchor, "id": self._id,
            }  # fmt: skip
            return np.asarray([values[f] for f in FIELDS], np.int64)

        return make

    def _mine(self, headers: np.ndarray) -> int:
        return int(np.flatnonzero(headers[:, FIELDS.index("id")] == self._id)[0])

    def _kept(self, ex: Any, p: int) -> tuple[list[int], list[np.ndarray], dict[int, str]]:
        """The members whose payloads enter fragment ``p``'s mean, their decoded payloads,
        and why each other member is out. Beyond :func:`train.replica.left_out`, every
        member drops alike a payload of another size than the fragment's, and one whose
        decoded values are not finite (whatever its header claims)."""
        go, d = self.outer[p], int(np.size(self.state[p].anchor))
        out = dict(ex.out)
        kept, values = [], []
        for i in ex.kept():
            if ex.payloads[i].size != go.nbytes(d):
                out[i] = f"a payload of {ex.payloads[i].size} bytes, not {go.nbytes(d)}"
                continue
            x = go.decode(go.from_wire(ex.payloads[i], d))
            if not np.all(np.isfinite(x)):
                out[i] = "non-finite values"
                continue
            kept.append(i)
            values.append(x)
        return kept, values, out

    def _outer_step(self, ex: Any, chosen: tuple, p: int, base: GroupState) -> GroupState:
        """``base`` stepped by the mean of the exchange's kept members (``chosen``: what
        :meth:`_kept` returned for it; unchanged if none)."""
        kept, payloads, _ = chosen
        if not kept:
            return base
        tokens = ex.field("tokens")
        mean = self.outer[p].mean(payloads, [tokens[i] for i in kept], decoded=True)
        return self.outer[p].step(base, mean)

    def _exchange(self, p: int, local: np.ndarray, tokens: int, step: int) -> dict[str, Any]:
        """Fragment ``p``'s exchange (on the host thread); returns what the row reports
        (``failed``: no exchange committed, so nothing is merged)."""
        from .replica import left_out

        transport = self.transport
        with self._lock:
            st = self.state[p]
        go = self.outer[p]
        t0 = time.perf_counter()
        finite = bool(np.all(np.isfinite(local)))
        payload, sent, unsent = go.send(st, local)
        wire = go.to_wire(payload)
        finite = finite and bool(np.all(np.isfinite(st.residual)))
        header = self._header(p, tokens, wire.size, finite, step)
        encode_s = time.perf_counter() - t0

        def commit(headers: np.ndarray, healed: bool) -> bool:
            why = left_out(headers).get(self._mine(headers))
            live = bool(np.any(headers[:, FIELDS.index("tokens")] > 0))
            # Out for another fragment or theta_sync (this group diverged), or for a
            # non-finite pseudo-gradient of its own (its error feedback would stay
            # non-finite and leave it out of every later exchange): commit nothing and fall
            # behind by one exchange, to be healed at the next.
            return live and (healed or why in (None, "no tokens"))

        errors_before = len(transport.errors)
        self._heal = None  # only a heal of this exchange counts
        ex = transport.exchange(header, lambda healed: wire, commit=commit)
        if ex is None:
            healed = self._heal is not None
            if healed:
                # Healed in one try, then every later try failed: torchft moved this
                # group's count to the peer's, so it takes the peer's state (with no outer
                # step: none was committed) to hold what its count says it holds.
                self._take_heal()
                self._healed_fragment = -1
            else:
                with self._lock:
                    self.state[p] = unsent
            self.stats["failed"] += 1
            last = transport.errors[-1] if len(transport.errors) > errors_before else "?"
            self._say(
                f"the exchange of fragment {p} at step {step} failed in every try "
                f"({1 + transport.retries}; last: {last}); nothing was merged"
                + ("; the heal it brought is taken" if healed else "")
                + f" (payload {wire.size:,} B; groups.timeout_s={self.groups.timeout_s:g} "
                "bounds each all-gather)"
            )
            return {"members": 0, "kept": 0, "failed": True, **({"healed": True} if healed else {})}
        self.stats["tries"] += ex.tries
        t1 = time.perf_counter()
        timing = {"encode_s": encode_s, **ex.seconds}
        why = ex.out.get(self._mine(ex.headers), "")
        if why.startswith("slot") or why == "another run's settings":
            raise ValueError(
                f"group {self.groups.slot} is left out of every exchange: {why} (another "
                "group was started with this slot, or the groups' configs differ); give each "
                "group its own groups.slot and the same config"
            )
        if ex.healed:
            self._take_heal()
            # The exchange the peers made: its fragment (the majority's), not this group's.
            frags = [f for i, f in enumerate(ex.field("fragment")) if i not in ex.out]
            q = max(set(frags), key=frags.count) if frags else p
            self._healed_fragment = q
            with self._lock:
                base = self.state[q]
            chosen = self._kept(ex, q)
            new = self._outer_step(ex, chosen, q, base)
            with self._lock:
                self.state[q] = new
            self._log_exchange(ex, chosen, q, step)
            self.stats["exchanges"] += 1
            timing["outer_s"] = time.perf_counter() - t1
            return {"members": ex.members, "kept": len(ex.kept()), "healed": True, **timing}
        if not ex.committed:  # another fragment or theta_sync: healed at the next one
            with self._lock:
                self.state[p] = unsent
            self.stats["left_out"] += 1
            self._say(
                f"left out of the exchange of fragment {p} at step {step} ({why or '?'}): "
                "nothing was committed; the next exchange heals this group from a peer"
            )
            return {"members": ex.members, "kept": len(ex.kept()), "failed": True}
        chosen = self._kept(ex, p)  # decoded once: the mean, the log and the counts
        kept = chosen[0]
        mine_kept = self._mine(ex.headers) in kept
        # Samples this group trained on that entered theta_sync (the goodput's count).
        self.stats["samples_in"] += tokens if mine_kept else 0
        new = self._outer_step(ex, chosen, p, sent if mine_kept else unsent)
        with self._lock:
            self.state[p] = new
        self._log_exchange(ex, chosen, p, step)
        self.stats["exchanges"] += 1
        self.stats["left_out"] += int(not mine_kept)
        timing["outer_s"] = time.perf_counter() - t1
        return {"members": ex.members, "kept": len(kept), **timing}

    def _say(self, what: str) -> None:
        """One line on stderr about this group's exchanges (the rows record it too)."""
        print(f"[group {self.groups.slot}] {what}", file=sys.stderr, flush=True)

    def _log_exchange(self, ex: Any, chosen: tuple, p: int, step: int) -> None:
        """One line of ``exchanges.jsonl`` (appended, never rewritten: a restarted group's
        earlier lines stay): the exchange's count, fragment, members and the samples that
        entered theta_sync."""
        tokens, slots = ex.field("tokens"), ex.field("slot")
        kept, _, out = chosen
        line = {
            "exchange": self.transport.committed,
            "fragment": p,
            "step": step,
            "members": ex.members,
            "kept": [slots[i] for i in kept],
            "left_out": {str(slots[i]): why for i, why in sorted(out.items())},
            "samples_in": int(sum(tokens[i] for i in kept)),
            "healed": ex.healed,
            "time": time.time(),
        }
        with open(self.cfg.run_dir / "exchanges.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def _handshake(self, ctx: Context) -> int | None:
        """Wait for the other groups at the start; a group behind them is healed here. With
        ``groups.rejoin`` (a restart into a running run) only a heal ends the wait: if no
        live group heals it within ``groups.start_timeout_s`` it stops with an error
        instead of training alone from where it was. Returns None if not healed, else the
        fragment of the peers' exchange that healed it (its merge is then due), or -1."""
        transport = self._connect()
        g = self.groups
        deadline = time.monotonic() + g.start_timeout_s
        header = self._header(-1, 0, 0, True, ctx.step)

        def commit(headers: np.ndarray, healed: bool) -> bool:
            # A group that joins a running exchange commits only once healed by it (else it
            # would count an exchange whose state it does not hold).
            return healed and bool(np.any(headers[:, FIELDS.index("tokens")] > 0))

        while True:
            if g.rejoin and time.monotonic() > deadline:
                raise ConnectionError(
                    f"group {g.slot}: groups.rejoin is set, but no live group healed this one "
                    f"within groups.start_timeout_s={g.start_timeout_s:g} (the run ended, or "
                    "every group is down); resume the whole run without groups.rejoin"
                )

            self._heal = None  # only a heal of this exchange counts
            ex = transport.exchange(header, lambda healed: np.zeros(0, np.uint8), commit=commit)
            if ex is None:
                if self._heal is not None:
                    # Healed in one try, then every later try failed: torchft moved this
                    # group's count to the peer's, so it takes the peer's state.
                    self._take_heal()
                    return -1
                if time.monotonic() > deadline + g.quorum_timeout_s:
                    raise ConnectionError(
                        f"group {g.slot}: no exchange with the other groups "
                        f"succeeded ({'; '.join(transport.errors[-3:])})"
                    )
                continue
            if ex.healed:
                self._take_heal()
                frags = [f for f in ex.field("fragment") if f >= 0]
                if frags:  # the peers' exchange of fragment p: take its outer step too
                    p = max(set(frags), key=frags.count)
                    with self._lock:
                        base = self.state[p]
                    chosen = self._kept(ex, p)
                    new = self._outer_step(ex, chosen, p, base)
                    with self._lock:
                        self.state[p] = new
                    self._log_exchange(ex, chosen, p, ctx.step)
                    self._healed_fragment = p
                    return p
                return -1
            if g.rejoin:
                continue
            if ex.members >= g.count:
                # Every group is here and meets at once: one more exchange of headers alone
                # times an exchange's fixed cost (quorum, two all-gathers, the commit), the
                # alpha of the link model (train.estimate's and benchmarks/groups_link.py's).
                t0 = time.perf_counter()
                transport.exchange(header, lambda healed: np.zeros(0, np.uint8), commit=commit)
                self.stats["exchange_alpha_s"] = time.perf_counter() - t0
                return None
            if time.monotonic() > deadline:
                return None

    # ------------------------------------------------------------------ the hooks

    def begin(self, ctx: Context, resumed: bool) -> None:
        self._ctx = ctx  # the trainer's state, for a heal handed over at a settle
        if self._leader:
            transport = self._connect()
            if resumed:
                transport.set_committed(self._committed)
        self._snapshot(ctx)
        self._warm_up()
        healed = self._handshake(ctx) if self._leader else None
        if self._procs > 1:  # the leader's outcome, in every process of the group
            flags = self._broadcast(np.asarray([healed is not None, healed or 0], np.int32))
            healed = int(flags[1]) if flags[0] else None
            if healed is not None:
                self._share_heal(ctx)
        if healed is not None:
            self._apply_heal(ctx)
            self._pending = [(healed, ctx.step + self.sync.overlap, None)] if healed >= 0 else []
            self._snapshot(ctx)
        self._row = {}
        self._merge_due(ctx)
        self._wall0 = None

    # ------------------------------------------------------------------ the estimate

    def estimate(self, ctx, mode, branches, network=None):
        """``train.estimate`` of a group: its inner step (``mode``: the group's own program,
        its in-group collectives included) and each fragment's exchange between the
        ``groups.count`` groups laid on the link clock (:func:`exchange_seconds`,
        :func:`link_utilisation`). Top-level figures are a period's per-step means
        (``sent_bytes_per_device``: the busiest step's, ``samples_per_s``: every group's);
        ``groups`` has the payloads, each exchange's seconds, the bytes a group sends a
        period and the compute utilisation (compute over the period's wall time)."""
        m = mode(None, branches)
        network = network if network is not None else ctx.schedule.at(0)
        sizes = [int(np.size(s.anchor)) for s in self.state] or self._sizes
        payload = [go.nbytes(d) for go, d in zip(self.outer, sizes, strict=True)]
        g, period = self.groups.count, self.sync.period
        comm = [exchange_seconds(b, g, network) for b in payload]
        # The group's own step (its in-group collectives included) on the clock; the
        # utilisation counts its compute alone.
        _, round_s = link_utilisation(m["step_s"], comm, period, self._schedule, self.sync.overlap)
        util = period * m["compute_s"] / round_s
        ring = (g - 1) * (max(payload) + HEADER_BYTES)
        return {
            **m,
            "step_s": round_s / period,
            "comm_s": m["comm_s"] + sum(comm) / period,  # each fragment once a period
            # Every group's samples: the run's rate.
            "samples_per_s": g * ctx.cfg.global_batch * period / round_s,
            # The busiest step's: an exchange of the largest fragment on top of the step's.
            "sent_bytes_per_device": m["sent_bytes_per_device"] + ring,
            "groups": {
                "count": g,
                "period": period,
                "overlap": self.sync.overlap,
                "payload_bytes": payload,
                "exchange_s": comm,
                "round_s": round_s,
                "compute_utilisation": util,
                # Each fragment once a period: G - 1 blocks of its header and payload.
                "sent_bytes_per_period": int(sum((g - 1) * (b + HEADER_BYTES) for b in payload)),
            },
        }

    def _warm_up(self) -> None:
        """Compile each fragment's encode, decode and outer step before the loop, on a
        copy of its state (what they return is dropped): the first exchanges would
        otherwise compile on the exchange thread, against the steps' compute."""
        if len(self.state) != len(self.outer):  # nothing to compile with (abstract)
            return
        for go, st in zip(self.outer, list(self.state), strict=True):
            payload, _, _ = go.send(st, np.asarray(st.anchor, np.float32))
            go.step(st, go.mean([go.decode(payload)], [1], decoded=True))

    def after_step(self, ctx: Context) -> None:
        t0 = time.perf_counter()
        if self._wall0 is None:
            # The loop's clock starts at the end of its first step: that step's first
            # execution (buffers, thread pools) is start-up, not the steady state.
            self._wall0 = t0
        else:
            self.stats["busy_s"] += float(ctx.last_compute_s)
            # A step run with no exchange in flight: its time is the devices' own, not
            # slowed by the exchange thread (the utilisation's baseline).
            if not self._inflight:
                self._clean.append(float(ctx.last_compute_s))
            self._steps_run += 1
        s = ctx.step - 1
        sync = self._steps[s % self.sync.period][0]
        # The wall clock of the step, to set a group's loss against time (a chaos run's).
        self._row = {"sync_fragment": sync, "group_time": time.time()}
        # Merges due first (a heal they bring moves the state before anything is read),
        # then this step's exchange, then its merge if it is due at once (overlap 0).
        self._merge_due(ctx)
        if sync >= 0 and ctx.step - 1 == s:
            self._launch(ctx, sync)
            self._merge_due(ctx)
        if ctx.step >= self.cfg.steps:
            # The loop's steady state ends here; the last exchange, which no step can
            # overlap, is its tail (reported apart).
            self.stats["steady_s"] = time.perf_counter() - self._wall0
            self.stats["steady_wait_s"] = self.stats["wait_s"]
            self._settle()  # theta_sync complete for the evaluation and the export
            if self._procs > 1:
                self._agree(ctx)
        self._row["group_wait_s"] = time.perf_counter() - t0
        if self.transport is not None:
            self._row["group_sent_bytes"] = self.transport.sent_bytes - self._sent_before
            self._sent_before = self.transport.sent_bytes
        if self._wall0 is not None:
            self.stats["wall_s"] = time.perf_counter() - self._wall0
        self._inflight = any(
            isinstance(fut, concurrent.futures.Future) and not fut.done()
            for _, _, fut in self._pending
        )

    def _launch(self, ctx: Context, p: int) -> None:
        since = self._last_sync.get(p, 0)
        tokens = max(ctx.step - since, 1) * self.cfg.global_batch
        self._last_sync[p] = ctx.step
        self._snapshot(ctx)
        # A pipeline's stages on several processes: reading them is a collective of the group.
        local = self._flat(ctx.params, p) if self._leader or self._staged else None
        if not self._leader:  # the leader exchanges; its outcome comes at the merge
            self._pending.append((p, ctx.step + self.sync.overlap, REMOTE))
            return
        for q, _, fut in self._pending:  # one exchange at a time on the transport
            if fut is not None and q != p:
                fut.result()
        fut = self._pool.submit(self._exchange, p, local, tokens, ctx.step)
        self._pending.append((p, ctx.step + self.sync.overlap, fut))

    def _wait(self, fut: concurrent.futures.Future | str | None) -> bool:
        """Wait for an exchange (its row entries go into this step's row); whether it
        failed (nothing committed)."""
        if not isinstance(fut, concurrent.futures.Future):
            return False
        t0 = time.perf_counter()
        info = fut.result()
        self.stats["wait_s"] += time.perf_counter() - t0
        self._row.update({f"group_{k}": v for k, v in info.items()})
        return bool(info.get("failed"))

    def _settle(self) -> None:
        """Wait for every exchange in flight (its outer step is then in ``theta_sync``);
        the merges stay due at their steps."""
        settled = []
        for p, due, fut in self._pending:
            failed = self._resolve(p, fut)
            # A failed exchange has nothing to merge, unless it healed the group: its merge
            # step then takes the heal.
            if not failed or self._healed_state is not None:
                settled.append((p, due, None))
        self._pending = settled

    def _resolve(self, p: int, fut: Any) -> bool:
        """Wait for fragment ``p``'s exchange; whether it failed. In a group of several
        processes every process calls this at the same point: the leader's outcome, its
        state of fragment ``p`` (or, if the exchange healed it, everything the heal
        brought) go to the others."""
        failed = self._wait(fut)
        if self._procs == 1 or fut is None:
            return failed
        flags = np.asarray([failed, self._healed_state is not None, self._healed_fragment])
        flags = self._broadcast(flags.astype(np.int32))
        if flags[1]:
            self._healed_fragment = int(flags[2])
            self._share_heal(self._ctx)
        else:
            with self._lock:
                st = self.state[p]
            got = self._broadcast(_state_arrays(st))
            if not self._leader:
                with self._lock:
                    self.state[p] = _from_arrays(st, got)
        return bool(flags[0])

    def _agree(self, ctx: Context) -> None:
        """(A group of several processes, at the end) check that every process holds the
        leader's ``theta_sync`` and the same parameters; their ids go in the summary."""
        from jax.experimental import multihost_utils

        with self._lock:
            anchors = np.concatenate([np.asarray(s.anchor).reshape(-1) for s in self.state])
        leaves = jax.tree_util.tree_leaves(_local(_gathered(ctx.params)))
        params = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in leaves])
        mine = np.asarray([array_id(anchors) % 2**31, array_id(params) % 2**31], np.int32)
        ids = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
        self.stats["process_ids"] = ids.tolist()
        if len({tuple(r) for r in ids.tolist()}) != 1:
            raise RuntimeError(
                f"group {self.groups.slot}: its processes hold different theta_sync or "
                f"parameters at the end (ids {ids.tolist()}); the run's outputs are not "
                "to be trusted"
            )

    def _broadcast(self, tree: Any) -> Any:
        """``tree`` as the group's leader holds it, in every process of the group (host
        arrays; every process calls this at the same point with the same shapes)."""
        from jax.experimental import multihost_utils

        # As unsigned integers of the same width: the broadcast is a sum with zeros, which
        # would turn -0.0 into +0.0 and is not bit-exact for every float.
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        leaves = [np.asarray(a) for a in leaves]
        bits = [a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a for a in leaves]
        out = jax.tree_util.tree_leaves(
            multihost_utils.broadcast_one_to_all(bits, is_source=self._leader)
        )
        back = [np.asarray(o).astype(b.dtype).view(a.dtype) if a.dtype.kind == "f"
                else np.asarray(o) for o, a, b in zip(out, leaves, bits, strict=True)]  # fmt: skip
        return jax.tree_util.tree_unflatten(treedef, back)

    def _share_heal(self, ctx: Context) -> None:
        """The state a heal brought the leader (the peer's parameters, optimizer state,
        step, data position, and every fragment's state), to every process of the group."""
        frags = len(self.state)
        with self._lock:
            heal, states = self._healed_state, list(self.state)
        if self._leader:
            last = [heal["last_sync"].get(q, heal["last_sync"].get(str(q), -1))
                    for q in range(frags)]  # fmt: skip
            ints = np.asarray([heal["step"], heal["position"], *last], np.int32)
            tree = {"params": heal["params"], "opt_state": heal["opt_state"], "ints": ints}
        else:
            zeros = lambda a: np.zeros(a.shape, a.dtype)  # noqa: E731
            tree = {"params": jax.tree_util.tree_map(zeros, ctx.params),
                    "opt_state": jax.tree_util.tree_map(zeros, ctx.opt_state),
                    "ints": np.zeros(2 + frags, np.int32)}  # fmt: skip
        tree["states"] = [_state_arrays(st) for st in states]
        got = self._broadcast(tree)
        if self._leader:
            return
        ints = [int(v) for v in got["ints"]]
        with self._lock:
            self.state = [_from_arrays(st, a) for st, a in zip(states, got["states"], strict=True)]
            self._healed_state = {
                "params": got["params"], "opt_state": got["opt_state"], "step": ints[0],
                "position": ints[1],
                "last_sync": {q: v for q, v in enumerate(ints[2:]) if v >= 0},
            }  # fmt: skip
        self.stats["heals"] += 1

    def _merge_due(self, ctx: Context) -> None:
        """Merge every fragment whose exchange is due at this step."""
        keep = []
        for p, due, fut in self._pending:
            if ctx.step < due:
                keep.append((p, due, fut))
                continue
            failed = self._resolve(p, fut)
            if self._healed_state is not None:  # healed in this exchange: take the state
                self._apply_heal(ctx)
                if self._healed_fragment >= 0:  # (-1: the exchange failed after the heal)
                    keep.append((self._healed_fragment, ctx.step + self.sync.overlap, None))
                continue
            if failed:  # nothing committed: theta_sync did not move, keep the local model
                continue
            with self._lock:
                anchor = self.state[p].anchor
            local = self._flat(ctx.params, p)
            ctx.params = self._with(ctx.params, p, GroupOuter.merge(local, anchor, self.alpha))
        self._pending = keep
        if any(due <= ctx.step for _, due, _ in keep):
            self._merge_due(ctx)

    def end(self, ctx: Context) -> None:
        for _, _, fut in self._pending:
            if isinstance(fut, concurrent.futures.Future):
                try:
                    fut.result(timeout=self.groups.timeout_s)
                except Exception:
                    pass
        if self.transport is not None:
            self.transport.shutdown()
        self._pool.shutdown(wait=False)

    def step_extras(self, ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
        return dict(self._row)

    def eval_params(self, ctx: Context, params: Any) -> Any:
        """``theta_sync`` of every fragment, in the parameters' dtypes and placement."""
        if self._procs > 1:
            # An exchange in flight has moved the leader's theta_sync only: settle (and
            # hand its outcome to every process) so all evaluate one model.
            self._settle()
        with self._lock:
            anchors = [s.anchor for s in self.state]
        for p, a in enumerate(anchors):
            params = self._with(params, p, a)
        return params

    # ------------------------------------------------------------------ state

    def checkpoint_extras(self) -> dict[str, Any]:
        self._settle()
        ctx = self._ctx
        if self._healed_state is not None and ctx is not None and ctx.step < self.cfg.steps:
            # The exchange this checkpoint waited for healed the group: take the peer's
            # state now, as the merge would, so the checkpoint holds it (its step, data
            # position and parameters) beside the peer's theta_sync it already holds.
            self._apply_heal(ctx)
            q = self._healed_fragment
            self._pending = [(q, ctx.step + self.sync.overlap, None)] if q >= 0 else []
        committed = self.transport.committed if self.transport is not None else self._committed
        pending = [[p, due] for p, due, _ in self._pending]
        return {
            "groups": {"committed": committed, "last_sync": self._last_sync, "pending": pending}
        }

    def restore_extras(self, ctx: Context, extras: dict[str, Any]) -> None:
        g = extras.get("groups", {})
        self._committed = int(g.get("committed", 0))
        self._last_sync = {int(k): int(v) for k, v in g.get("last_sync", {}).items()}
        self._pending = [(int(p), int(due), None) for p, due in g.get("pending", [])]

    def saved_arrays(self) -> dict[str, Any]:
        self._settle()
        out = {}
        with self._lock:
            for p, s in enumerate(self.state):
                out[f"f{p}_anchor"] = np.asarray(s.anchor)
                out[f"f{p}_residual"] = np.asarray(s.residual)
                for i, leaf in enumerate(jax.tree_util.tree_leaves(s.outer)):
                    out[f"f{p}_outer{i}"] = np.asarray(leaf)
                if s.key is not None:
                    out[f"f{p}_key"] = np.asarray(s.key)
        return out

    def load_arrays(self, ctx: Context, arrays: dict[str, Any]) -> None:
        with self._lock:
            for p, s in enumerate(self.state):
                leaves, tree = jax.tree_util.tree_flatten(s.outer)
                outer = [np.asarray(arrays[f"f{p}_outer{i}"]) for i in range(len(leaves))]
                self.state[p] = GroupState(
                    anchor=np.asarray(arrays[f"f{p}_anchor"]),
                    outer=jax.tree_util.tree_unflatten(tree, outer),
                    residual=np.asarray(arrays[f"f{p}_residual"]),
                    key=None if s.key is None else np.asarray(arrays[f"f{p}_key"]),
                )

    def summary_extras(self) -> dict[str, Any]:
        st = dict(self.stats)
        st["sent_bytes"] = self.transport.sent_bytes if self.transport else 0
        # The live state this group served to healing peers (torchft's HTTP transport).
        st["heal_sent_bytes"] = self.transport.heal_sent_bytes if self.transport else 0
        st["heals_served"] = self.transport.heals_served if self.transport else 0
        # Compute utilisation: the steps at the devices' own pace (the median step with no
        # exchange in flight) over the loop's steady wall time, from the end of its first
        # step to the end of its last (``utilisation_with_tail`` adds the wait for the last
        # exchange, ``tail_s``); ``busy_utilisation`` counts every step's measured time,
        # also the slowdown the exchange thread causes.
        clean = float(np.median(self._clean)) if self._clean else None
        wall, steady = st["wall_s"], st.get("steady_s") or st["wall_s"]
        st["utilisation"] = self._steps_run * clean / steady if steady and clean else None
        st["utilisation_with_tail"] = self._steps_run * clean / wall if wall and clean else None
        st["tail_s"] = wall - steady if wall else None
        st["busy_utilisation"] = st["busy_s"] / steady if steady else None
        st["clean_step_s"] = clean
        if steady and clean:
            # Where the steady window's time beyond the steps at their own pace went: steps
            # slowed (the exchange thread's work on the same cores, and steps' own spread
            # above the median), waits for exchanges at merges, and the loop's host work
            # (launches, merges, metrics).
            waited = st.get("steady_wait_s", st["wait_s"])
            st["lost_s"] = {
                "slowed": st["busy_s"] - self._steps_run * clean,
                "waited": waited,
                "host": steady - st["busy_s"] - waited,
            }
        sizes = [int(np.size(s.anchor)) for s in self.state]
        payload = [go.nbytes(d) for go, d in zip(self.outer, sizes, strict=True)]
        return {
            "groups": {
                "slot": self.groups.slot,
                "count": self.groups.count,
                "committed": self.transport.committed if self.transport else self._committed,
                "payload_bytes": payload,
                **st,
            }
        }
