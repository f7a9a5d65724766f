"""The transport between replica groups: torchft's lighthouse, ``Manager`` and Gloo.

Each replica group (one JAX program) holds one :class:`Transport`: a ``TCPStore`` of its
own (the ``Manager`` expects one per group, which ``torchrun`` would start), a torchft
``Manager`` that asks the lighthouse for a quorum of the live groups at each exchange, and
a reconfigurable ``ProcessGroupGloo`` over TCP between the groups of that quorum. One
exchange is two all-gathers: a fixed 80-byte header per group (:data:`FIELDS`), then every
group's packed payload, padded to the largest one named in the headers (groups at the same
point of the schedule send the same size, so nothing is padded in a healthy run). What
each group decides from the headers (:func:`left_out`) is a function of the gathered
headers alone, so every group of a quorum leaves out the same members.

A group whose committed exchange count is behind the quorum's (it restarted, or missed
exchanges) is healed by torchft during the quorum: its ``Manager`` fetches the live state
of a healthy peer over torchft's HTTP checkpoint transport (:meth:`Transport.exchange`
calls ``on_heal`` with it), and takes part in the exchange with no tokens, so the others
leave it out while it takes the same outer step they take. Each array of that state goes
as its raw bytes in a torch tensor (torch streams tensors as they are; a pickled NumPy
array's bytes would grow by about half), and the server counts what it sends
(:attr:`Transport.heal_sent_bytes`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np

__all__ = [
    "FIELDS",
    "Transport",
    "Exchange",
    "fingerprint_id",
    "left_out",
    "lighthouse",
    "payload_width",
]

#: The header each group all-gathers before its payload (int64 each).
FIELDS = (
    "slot",  # the group's slot (its share of the data)
    "tokens",  # samples processed since the fragment's last exchange (0: nothing to give)
    "nbytes",  # the payload's bytes
    "fingerprint",  # the run's settings (groups of another run are left out)
    "finite",  # 1 when the pseudo-gradient is finite
    "step",  # the group's training step
    "healed",  # 1 when this group was healed in this exchange
    "fragment",  # the fragment exchanged (-1: none, a handshake)
    "anchor",  # a hash of every fragment's theta_sync before the exchange
    "id",  # a random id of this group's process (two groups given one slot are told apart)
)


def fingerprint_id(settings: dict[str, Any]) -> int:
    """A 62-bit id of a run's settings (what every group must share)."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def array_id(a: np.ndarray) -> int:
    """A 62-bit hash of an array's bytes."""
    return (
        int.from_bytes(hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest()[:8], "little")
        >> 2
    )


def _majority(values: list[int], slots: list[int]) -> int:
    """The value most members hold; ties go to the value of the smallest slot."""
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    best = max(counts.values())
    return min((s, v) for s, v in zip(slots, values, strict=True) if counts[v] == best)[1]


def left_out(headers: np.ndarray) -> dict[int, str]:
    """Members (row index of the gathered ``[G, len(FIELDS)]`` headers) left out of the
    mean, each with the reason: another run's settings, the same slot twice, no tokens,
    a non-finite pseudo-gradient, another fragment, another ``theta_sync`` (a group
    that diverged, e.g. one that stepped alone while cut off; it heals at its next
    exchange), or a payload of another size. The majority decides among settings,
    fragments, ``theta_sync`` and payload sizes, so the members gather payloads of the
    kept members' size (:func:`payload_width`) whatever one header claims."""
    h = {name: [int(v) for v in headers[:, i]] for i, name in enumerate(FIELDS)}
    slots = h["slot"]
    out: dict[int, str] = {}
    fp = _majority(h["fingerprint"], slots)
    seen: set[int] = set()
    for i, s in enumerate(slots):
        if h["fingerprint"][i] != fp:
            out[i] = "another run's settings"
        elif s in seen:
            out[i] = f"slot {s} twice"
        seen.add(s)
    live = [i for i in range(len(slots)) if i not in out and h["tokens"][i] > 0]
    if live:
        frag = _majority([h["fragment"][i] for i in live], [slots[i] for i in live])
        same = [i for i in live if h["fragment"][i] == frag]
        anchor = _majority([h["anchor"][i] for i in same], [slots[i] for i in same])
        same = [i for i in same if h["anchor"][i] == anchor]
        size = _majority([h["nbytes"][i] for i in same], [slots[i] for i in same])
    for i in range(len(slots)):
        if i in out:
            continue
        if h["tokens"][i] <= 0:
            out[i] = "no tokens"
        elif not h["finite"][i]:
            out[i] = "non-finite pseudo-gradient"
        elif h["fragment"][i] != frag:
            out[i] = f"fragment {h['fragment'][i]}, not {frag}"
        elif h["anchor"][i] != anchor:
            out[i] = "another theta_sync"
        elif h["nbytes"][i] != size:
            out[i] = f"a payload of {h['nbytes'][i]} bytes, not {size}"
    return out


def payload_width(headers: np.ndarray, out: dict[int, str]) -> int:
    """The bytes every member sends in the payload all-gather: the kept members' payload
    size (one size, by :func:`left_out`), 0 if none is kept. Decided from the gathered
    headers, so every member pads or cuts its payload alike and no header's claim sets
    what the others allocate."""
    sizes = headers[:, FIELDS.index("nbytes")]
    return max((int(sizes[i]) for i in range(len(headers)) if i not in out), default=0)


class Exchange:
    """What one committed exchange gathered: ``headers`` (``int64[G, len(FIELDS)]``, in
    the quorum's member order), ``payloads`` (``uint8`` arrays, each cut to its own
    ``nbytes`` or the gather's width, :func:`payload_width`, if that is smaller), ``out``
    (:func:`left_out`), ``healed`` (this group was healed in it), ``committed`` (it
    counts: a handshake of groups with nothing to give does not), ``members`` (groups in
    the quorum), ``sent_bytes`` (what this group sent over every try of it), ``tries`` and
    ``seconds`` (wall seconds of the last try's quorum, header and payload all-gathers and
    commit vote)."""

    def __init__(self, headers, payloads, out, *, healed, committed, sent_bytes, tries,
                 seconds=None):  # fmt: skip
        self.headers, self.payloads, self.out = headers, payloads, out
        self.healed, self.committed = healed, committed
        self.sent_bytes, self.tries = sent_bytes, tries
        self.seconds: dict[str, float] = seconds or {}

    @property
    def members(self) -> int:
        return len(self.headers)

    def field(self, name: str) -> list[int]:
        """One header field of every member."""
        return [int(v) for v in self.headers[:, FIELDS.index(name)]]

    def kept(self) -> list[int]:
        """Members in the mean, in member order."""
        return [i for i in range(self.members) if i not in self.out]


def lighthouse(bind: str, min_groups: int, *, grace_ms: int, heartbeat_ms: int) -> Any:
    """A torchft lighthouse on ``bind`` (``host:port``). A quorum forms at once when every
    member of the previous one asks; otherwise once at least ``min_groups`` and more than
    half of the groups heartbeating have asked, and either all of those have or
    ``grace_ms`` passed since the first did. A group silent for ``heartbeat_ms`` is dropped.
    Raises OSError naming ``bind`` when it cannot listen there (a port in use)."""
    from torchft._torchft import LighthouseServer

    try:
        return LighthouseServer(
            bind=bind,
            min_replicas=min_groups,
            join_timeout_ms=grace_ms,
            quorum_tick_ms=10,
            heartbeat_timeout_ms=heartbeat_ms,
        )
    except RuntimeError as e:
        hint = "; choose another port" if "in use" in str(e) else ""
        raise OSError(f"the lighthouse cannot listen on {bind} ({e}){hint}") from None


class _Raw:
    """A host array as torch streams it: its bytes in a ``uint8`` tensor (written as they
    are; pickled, a NumPy array's bytes would grow by about half), its dtype and shape."""

    def __init__(self, a: np.ndarray):
        import torch

        self.dtype, self.shape = a.dtype, a.shape  # the dtype itself: bfloat16's str is "<V2"
        a = np.ascontiguousarray(a)
        if not a.flags.writeable:  # a device array's host view: torch wants its own copy
            a = a.copy()
        self.data = torch.from_numpy(a.reshape(-1).view(np.uint8))

    def array(self) -> np.ndarray:
        """The array (a writable copy: torch loads a streamed tensor over a read-only buffer)."""
        return self.data.numpy().view(self.dtype).reshape(self.shape).copy()


def _to_torch(tree: Any) -> Any:
    import jax

    return jax.tree_util.tree_map(
        lambda a: _Raw(np.asarray(a)) if isinstance(a, (np.ndarray, jax.Array)) else a, tree
    )


def _from_torch(tree: Any) -> Any:
    import jax

    return jax.tree_util.tree_map(
        lambda a: a.array() if isinstance(a, _Raw) else a, tree,
        is_leaf=lambda a: isinstance(a, _Raw),
    )  # fmt: skip


class _CountedWriter:
    """A response stream that adds what it writes to ``counter.heal_sent_bytes``."""

    def __init__(self, inner: Any, counter: Any):
        self._inner, self._counter = inner, counter

    def write(self, data: Any) -> Any:
        n = self._inner.write(data)
        with self._counter.lock:
            self._counter.heal_sent_bytes += len(memoryview(data).cast("B"))
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _counted_http(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (the one its ``Manager`` makes by default), its
    server counting every byte it writes to a healing peer (``heal_sent_bytes``: the live
    state as torchft serialises it, HTTP headers included)."""
    from torchft.checkpointing import HTTPTransport

    http = HTTPTransport(timeout=timeout, num_chunks=0)
    http.heal_sent_bytes, http.heal_requests, http.lock = 0, 0, threading.Lock()
    handler = http._server.RequestHandlerClass

    class Counted(handler):
        def setup(self) -> None:
            super().setup()
            with http.lock:
                http.heal_requests += 1
            self.wfile = _CountedWriter(self.wfile, http)

    http._server.RequestHandlerClass = Counted  # read by the server at each request
    return http


class Transport:
    """One group's end of the torchft transport (see the module docstring).

    Args:
      lighthouse: the lighthouse's address (``http://host:port``).
      slot: this group's slot.
      state_dict: returns the live state a healing peer receives (host arrays).
      on_heal: takes the live state received from a peer when this group is healed.
      timeout_s: torchft's timeout of a collective, a commit and a heal.
      quorum_timeout_s: the longest wait for a quorum.
      connect_timeout_s: the longest wait to reach the lighthouse.
      retries: exchanges tried again after a failure (a member lost mid-collective).
      host: the address other groups reach this group's store and Gloo on.
    """

    def __init__(
        self,
        lighthouse: str,
        slot: int,
        *,
        state_dict: Callable[[], dict[str, Any]],
        on_heal: Callable[[dict[str, Any]], None],
        timeout_s: float = 30.0,
        quorum_timeout_s: float = 60.0,
        connect_timeout_s: float = 60.0,
        retries: int = 3,
        host: str = "127.0.0.1",
    ):
        import torch
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        from .distributed import free_port

        # torchft warns at every quorum that it cannot reset NCCL's flight recorder (there
        # is none on Gloo) and logs every quorum and commit.
        logging.getLogger("torchft").setLevel(logging.ERROR)
        self.torch = torch
        # torch's streaming load of a heal's tensors warns that their buffer is read-only;
        # :meth:`_Raw.array` copies them out.
        warnings.filterwarnings(
            "ignore", "The given buffer is not writable", UserWarning, "torch.distributed"
        )
        self.slot, self.retries = slot, retries
        self._on_heal, self._state_dict = on_heal, state_dict
        self._healed = threading.Event()
        port = free_port(host)
        self._store = TCPStore(host, port, is_master=True, wait_for_workers=False)
        self.pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        self._http = _counted_http(timedelta(seconds=timeout_s))
        self.manager = Manager(
            pg=self.pg,
            checkpoint_transport=self._http,
            load_state_dict=self._load,
            state_dict=lambda: _to_torch(self._state_dict()),
            min_replica_size=1,
            use_async_quorum=False,
            timeout=timedelta(seconds=timeout_s),
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=connect_timeout_s),
            rank=0,
            world_size=1,
            store_addr=host,
            store_port=port,
            lighthouse_addr=lighthouse,
            replica_id=f"group_{slot}",
            hostname=host,
            init_sync=False,
        )
        self.sent_bytes = 0
        self.errors: list[str] = []  # why each failed try failed

    def _load(self, state: dict[str, Any]) -> None:
        self._on_heal(_from_torch(state))
        self._healed.set()

    @property
    def heal_sent_bytes(self) -> int:
        """Bytes this group's checkpoint server sent to healing peers (the live state)."""
        with self._http.lock:
            return self._http.heal_sent_bytes

    @property
    def heals_served(self) -> int:
        """Requests this group's checkpoint server answered (one per healing peer's fetch)."""
        with self._http.lock:
            return self._http.heal_requests

    @property
    def committed(self) -> int:
        """Exchanges this group has committed (torchft's step)."""
        return self.manager.current_step()

    def set_committed(self, count: int) -> None:
        """Take back the committed count of a checkpoint."""
        self.manager.load_state_dict({"step": int(count), "batches_committed": 0})

    def _gather(self, data: np.ndarray) -> np.ndarray:
        """All-gather one equal-size array from every member (``[G, ...]``)."""
        torch = self.torch
        from torch.distributed.distributed_c10d import AllgatherOptions

        mine = torch.from_numpy(np.ascontiguousarray(data))
        size = self.pg.size()
        outs = [torch.empty_like(mine) for _ in range(size)]
        self.pg.allgather([outs], [mine], AllgatherOptions()).wait()
        # Gloo's ring all-gather: each member passes on G - 1 blocks of this size.
        self.sent_bytes += (size - 1) * mine.numel() * mine.element_size()
        return np.stack([o.numpy() for o in outs])

    def exchange(
        self,
        header: Callable[[bool], np.ndarray],
        payload: Callable[[bool], np.ndarray],
        *,
        commit: Callable[[np.ndarray, bool], bool] | None = None,
    ) -> Exchange | None:
        """One exchange, tried up to ``1 + retries`` times with a new quorum each time.

        ``header(healed)`` and ``payload(healed)`` make this group's header and packed
        bytes once the quorum is known (``healed``: this group was just healed, so it has
        nothing to give); ``commit(headers, healed)`` says whether this exchange should
        count (default: yes). Returns the :class:`Exchange` (committed, or one ``commit``
        declined), or None when every try failed (nothing was committed)."""
        before = self.sent_bytes
        # A heal is sticky: torchft moves this group's count to the peers' when it heals
        # it, so a later try of the same exchange still has nothing of its own to give.
        self._healed.clear()
        for attempt in range(1 + self.retries):
            headers = None
            marks = [time.perf_counter()]
            try:
                self.manager.start_quorum(allow_heal=True)
                healed = self._healed.is_set()
                if self.manager.errored() is not None:
                    raise RuntimeError(str(self.manager.errored().original_exception))
                mine = np.asarray(header(healed), np.int64)
                marks.append(time.perf_counter())
                headers = self._gather(mine)
                out = left_out(headers)
                width = payload_width(headers, out)
                data = np.asarray(payload(healed), np.uint8)[:width]
                padded = np.zeros(width, np.uint8)
                padded[: data.size] = data
                marks.append(time.perf_counter())
                # (No kept member: every member skips the gather alike.)
                gathered = self._gather(padded) if width else np.zeros((len(headers), 0), np.uint8)
                marks.append(time.perf_counter())
                if commit is not None and not commit(headers, healed):
                    self.manager.report_error(RuntimeError("nothing to commit"))
                ok = self.manager.should_commit()
                marks.append(time.perf_counter())
            except Exception as e:  # a member lost mid-collective, a quorum timed out
                self.errors.append(f"{type(e).__name__}: {e}")
                self._recover(e)
                continue
            wanted = commit is None or commit(headers, healed)
            if wanted and not ok:  # a member's error, or too few members: tried again
                self.errors.append("the commit vote failed (a member reported an error)")
            if ok or not wanted:
                sizes = headers[:, FIELDS.index("nbytes")]
                payloads = [gathered[i, : min(int(sizes[i]), width)] for i in range(len(headers))]
                names = ("quorum_s", "headers_s", "payloads_s", "commit_s")
                seconds = {n: b - a for n, a, b in zip(names, marks[:-1], marks[1:], strict=True)}
                return Exchange(
                    headers, payloads, out, healed=healed, committed=ok,
                    sent_bytes=self.sent_bytes - before, tries=attempt + 1, seconds=seconds,
                )  # fmt: skip
        return None

    def _recover(self, error: Exception) -> None:
        """Make the next try possible after a failed one: report the error (nothing of this
        try commits) and drop a quorum that failed (torchft's ``start_quorum`` would raise
        its error again at every later call)."""
        self.manager.report_error(error)
        self._drop_failed_quorum()
        try:
            self.manager.should_commit()
        except Exception as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            self._drop_failed_quorum()

    def _drop_failed_quorum(self) -> None:
        future = getattr(self.manager, "_quorum_future", None)
        if future is not None and future.done() and future.exception() is not None:
            self.manager._quorum_future = None

    def shutdown(self) -> None:
        """Stop the manager (its server and checkpoint transport)."""
        try:
            self.manager.shutdown(wait=False)
        except Exception:
            pass
