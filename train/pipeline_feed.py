"""What a pipeline step is fed: its batch in microbatches, and at every AQ-SGD boundary
the previous messages of its samples from a :class:`jaxcomm.pipeline.MessageBuffer` (and, with
``boundary.memory``, their gradient memory from a second one).

A step's inputs are prepared while the step before it runs (batch read, buffer reads
waited on, host-to-device copies issued); its new messages are written back after it
(asynchronously: a later read of the same ids waits for these writes). The buffers are
snapshotted beside every checkpoint and restored with it. Each process of a multi-process
run keeps the buffers of the boundaries it holds a side of.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

import jaxcomm
from jaxcomm._src.pipeline import BoundaryState

from .distributed import is_primary

if TYPE_CHECKING:
    from .context import Context
    from .pipeline_layout import Pipeline

__all__ = ["Prepared", "Feed", "as_global"]


class Prepared(NamedTuple):
    """A step's inputs on the devices: batch, boundary state and boundary mode."""

    position: int
    ids: np.ndarray
    batch: dict[str, jax.Array]
    state: BoundaryState
    seen: bool
    seconds: float  # host time spent preparing it (reads waited on, copies issued)


def as_global(full: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array as a global array of ``sharding``: each process copies only the slices
    of its own devices (every process passes the same shape)."""
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


class Feed:
    """Batches and message buffers of pipeline layout ``p`` of the run ``ctx``."""

    def __init__(self, p: Pipeline, ctx: Context):
        self.p, self.ctx, cfg = p, ctx, p.cfg
        self.buffer_dir = getattr(cfg.boundary, "buffer_dir", "")
        act = (p.gpt_cfg.seq_len, p.gpt_cfg.width)
        # Only AQ-SGD needs previous messages; the other boundaries ignore them.
        aqsgd = cfg.boundary.key == "aqsgd"
        count = p.stages - 1 if aqsgd and not p.abstract else 0
        paths = [self.path(b) for b in range(count)] if self.buffer_dir else []
        # Buffers found on disk belong to an earlier run: only a resume may keep them.
        # The gradient memory of a boundary keeping one (``bw_memory``): a second buffer
        # of the same rows, written and saved with the messages.
        # (An abstract layout keeps no buffers, but its states have the memory's shape.)
        self.memory = p.boundary.bw_memory
        if self.memory and count and self.buffer_dir:
            paths += [self.path(b, "gradient") for b in range(count)]
        self.stale = [q for q in paths if Path(q).exists() and any(Path(q).iterdir())]

        def buffer(b: int, kind: str) -> jaxcomm.pipeline.MessageBuffer:
            return jaxcomm.pipeline.MessageBuffer(
                len(ctx.train_data),
                act,
                storage_bits=getattr(cfg.boundary, "buffer_bits", 0) or None,
                path=self.path(b, kind),
            )

        self.buffers = [buffer(b, "boundary") for b in range(count)]
        self.memories = [buffer(b, "gradient") for b in range(count)] if self.memory else []
        self._zero_state: BoundaryState | None = None
        if self.buffers and jax.process_count() > 1:
            devices = p.mesh.devices
            split = [
                st for st in range(p.stages)
                if len({devices[d, st].process_index for d in range(cfg.workers)}) > 1
            ]  # fmt: skip
            if split and is_primary():
                print(
                    f"note: stages {split} have data replicas on several processes; each "
                    "process keeps the AQ-SGD messages of the samples its replicas trained, so "
                    "a sample that a later epoch gives to a replica on another process is "
                    "sent in float32 again (use a process count that keeps each stage's "
                    "replicas together to send deltas)",
                    flush=True,
                )

    def path(self, b: int, kind: str = "boundary") -> str | None:
        """Where boundary ``b``'s buffer (``kind``: ``boundary`` for the messages,
        ``gradient`` for the gradient memory) lives on disk (None: in memory); each process
        of a multi-process run keeps its own, for the replicas whose stages it holds."""
        if not self.buffer_dir:
            return None
        sub = f"/process{jax.process_index()}" if jax.process_count() > 1 else ""
        return f"{self.buffer_dir}{sub}/{kind}{b}"

    def _named(self) -> list[tuple[str, int, jaxcomm.pipeline.MessageBuffer]]:
        """Every open buffer as ``(kind, boundary, buffer)``, ``kind`` ``boundary`` (the
        messages) or ``gradient`` (the gradient memory); ``kind + str(boundary)`` names it."""
        return [("boundary", b, buf) for b, buf in enumerate(self.buffers)] + [
            ("gradient", b, buf) for b, buf in enumerate(self.memories)
        ]

    def check_stale(self) -> None:
        """Refuse buffers on disk that no resumed checkpoint owns."""
        if self.stale:
            raise ValueError(
                f"boundary.buffer_dir={self.buffer_dir!r} already holds message buffers "
                f"({', '.join(self.stale)}) and this run does not resume a checkpoint that "
                "owns them; empty it, choose another boundary.buffer_dir, or pass --resume"
            )

    # ------------------------------------------------------------------ inputs

    def replica_ids(self, ids: np.ndarray) -> np.ndarray:
        """A step's sample ids ``[B]`` as ``[D, M * mb]``: the rows of each data replica."""
        return ids.reshape(self.p.cfg.workers, -1)

    def micro(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host tokens ``[B, T + 1]`` as ``[D, 1, M, mb, T + 1]`` device microbatches."""
        p = self.p
        d, m = p.cfg.workers, p.cfg.microbatches
        tokens = batch["tokens"].reshape(d, 1, m, p.micro, -1)
        return {"tokens": as_global(tokens, p.by_data)}

    def local_batch(self, ids: np.ndarray) -> dict[str, jax.Array]:
        """The step's tokens, loading only the replicas this process holds (the others'
        rows stay zero on the host and are never copied to a device)."""
        rows = self.replica_ids(ids)
        mine = self.p.local_replicas
        local = self.ctx.train_data.get(rows[mine].reshape(-1))["tokens"]
        tokens = np.zeros((rows.shape[0], rows.shape[1], local.shape[-1]), local.dtype)
        tokens[mine] = local.reshape(len(mine), rows.shape[1], -1)
        return self.micro({"tokens": tokens.reshape(-1, local.shape[-1])})

    def _shape(self) -> tuple[int, ...]:
        p = self.p
        return (
            p.cfg.workers,
            p.stages,
            p.cfg.microbatches,
            p.micro,
            p.gpt_cfg.seq_len,
            p.gpt_cfg.width,
        )

    def zeros_state(self) -> BoundaryState:
        """A boundary state of zeros (no previous messages), made once."""
        if self._zero_state is None:
            zeros = as_global(np.zeros(self._shape(), np.float32), self.p.sharded)
            self._zero_state = BoundaryState(zeros, zeros, *(zeros, zeros) * self.memory)
        return self._zero_state

    def prepare(self, position: int) -> Prepared:
        """Everything step ``position`` needs on the devices: its batch, the previous messages
        of its samples at every boundary (``[D, S, M, mb, T, W]``) and its boundary mode.

        The buffer reads and the host-to-device copies are issued here without waiting for
        the devices, so called while a step runs they overlap its compute.
        """
        t0 = time.perf_counter()
        ids = self.ctx.loader.batch_ids(position)
        batch = self.local_batch(ids)
        if not self.buffers:
            return Prepared(position, ids, batch, self.zeros_state(), False, 0.0)
        d, _, m, mb, t, w = self._shape()
        # [outgoing, incoming] sides of the messages and (with bw_memory) of the memory.
        sides = [[np.zeros(self._shape(), np.float32) for _ in range(2)] for _ in range(2)]
        seen = True
        # Each process reads boundary b's messages of the replicas d where it holds the
        # sender (d, b) or the receiver (d, b + 1): those it wrote after earlier steps.
        cells = set(self.p.local_cells)
        reads = []
        for kind, bufs in enumerate((self.buffers, self.memories)):
            for b, buf in enumerate(bufs):
                mine = [r for r in range(d) if (r, b) in cells or (r, b + 1) in cells]
                if mine:
                    rows = self.replica_ids(ids)[mine].reshape(-1)
                    reads.append((kind, b, mine, buf.read_async(rows)))
        for kind, b, mine, handle in reads:
            v = handle.result().reshape(len(mine), m, mb, t, w)
            seen = seen and bool(handle.seen().all())
            sides[kind][0][mine, b], sides[kind][1][mine, b + 1] = v, v
        if jax.process_count() > 1:  # every process must run the same program
            from jax.experimental import multihost_utils

            seen = bool(np.all(multihost_utils.process_allgather(np.array([seen]))))
        if not seen:  # first visits (or a mix): no deltas, nothing remembered
            for side in sides:
                side[0][:], side[1][:] = 0.0, 0.0
        sharded = self.p.sharded
        (prev, prev_in), (grad_out, grad_in) = sides
        memory = (as_global(grad_in, sharded), as_global(grad_out, sharded)) * self.memory
        state = BoundaryState(as_global(prev_in, sharded), as_global(prev, sharded), *memory)
        return Prepared(position, ids, batch, state, seen, time.perf_counter() - t0)

    def prepare_abstract(self, seen: bool) -> Prepared:
        """Shapes of a step's inputs in boundary mode ``seen`` (nothing allocated)."""
        p = self.p
        d, _, m, mb, t, _ = self._shape()
        tokens = jax.ShapeDtypeStruct((d, 1, m, mb, t + 1), jnp.int32, sharding=p.by_data)
        prev = jax.ShapeDtypeStruct(self._shape(), jnp.float32, sharding=p.sharded)
        ids = np.arange(d * m * mb)
        state = BoundaryState(prev, prev, *(prev, prev) * self.memory)
        return Prepared(0, ids, {"tokens": tokens}, state, seen, 0.0)

    # ------------------------------------------------------------------ write-back

    def write_back(self, ids: np.ndarray, state: BoundaryState) -> float:
        """Write a step's new messages (``state``, of samples ``ids``) to the buffers,
        asynchronously; returns the host seconds spent copying and issuing."""
        if not self.buffers:
            return 0.0
        t0 = time.perf_counter()
        _, _, _, _, t, w = self._shape()
        rows = self.replica_ids(ids)
        # Boundary b's new messages of replica d sit on the sender, device (d, b), as
        # prev_out and on the receiver, device (d, b + 1), as prev_in (equal bit for
        # bit); its gradient memory likewise as grad_out and grad_in. A process writes
        # every (b, d) it holds either side of; with both sides local, once.
        kinds = [(self.buffers, state.prev_out, state.prev_in)]
        if self.memory:
            kinds.append((self.memories, state.grad_out, state.grad_in))
        for bufs, out_side, in_side in kinds:
            cells: dict[tuple[int, int], np.ndarray] = {}
            for side, shift in ((out_side, 0), (in_side, 1)):
                for shard in side.addressable_shards:
                    d, st = shard.index[0].start or 0, shard.index[1].start or 0
                    key = (st - shift, d)
                    # Copied to the host only when the other side has not given it already.
                    if 0 <= key[0] < len(bufs) and key not in cells:
                        cells[key] = np.asarray(shard.data)
            for b, buf in enumerate(bufs):
                parts = sorted((d, v) for (bb, d), v in cells.items() if bb == b)
                if not parts:
                    continue
                row_ids = np.concatenate([rows[d] for d, _ in parts])
                data = np.concatenate([v.reshape(-1, t, w) for _, v in parts])
                buf.write_async(row_ids, data)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ snapshots

    def _snapshot_root(self, step: int) -> Path:
        """Where the message buffers of checkpoint ``step`` are saved (this process's)."""
        root = self.p.cfg.run_dir / "buffers" / str(step)
        return root / f"process{jax.process_index()}" if jax.process_count() > 1 else root

    def save(self, step: int) -> None:
        """Snapshot every buffer for checkpoint ``step``. They go before the Orbax commit,
        which is what makes the step a checkpoint, so a crash in between leaves the
        previous checkpoint the newest (and a snapshot without a checkpoint, removed by
        the next :meth:`prune`)."""
        named = self._named()
        for *_, buf in named:
            buf.flush()
        root = self._snapshot_root(step)
        for kind, b, buf in named:
            buf.save(root / f"{kind}{b}", overwrite=True)

    def prune(self, kept_steps: list[int]) -> None:
        """Keep the snapshots of the checkpoints Orbax keeps, and only those."""
        if self.buffers and is_primary():
            kept = {str(step) for step in kept_steps}
            for old in (self.p.cfg.run_dir / "buffers").iterdir():
                if old.name not in kept:
                    shutil.rmtree(old, ignore_errors=True)

    def restore(self, step: int) -> None:
        """Replace the open buffers by the snapshots of checkpoint ``step``."""
        root = self._snapshot_root(step)
        for kind, b, _ in self._named():
            snapshot = root / f"{kind}{b}"
            if not snapshot.is_dir():
                step_dir = self.p.cfg.run_dir / "buffers" / str(step)
                saved = sorted(q.name for q in step_dir.glob("process*"))
                other = (saved and len(saved) != jax.process_count()) or (
                    not saved and jax.process_count() > 1 and (step_dir / "boundary0").is_dir()
                )
                hint = (
                    f"; its buffers were saved by {len(saved) or 1} process(es), this run has "
                    f"{jax.process_count()}: resume AQ-SGD with the same process count"
                    if other
                    else ""
                )
                raise FileNotFoundError(
                    f"checkpoint step {step} has no message-buffer snapshot {snapshot}{hint}"
                )
        # The open buffers are closed only once every snapshot is known to exist.
        restored = []
        for kind, b, old in self._named():
            old.close()
            restored.append(
                jaxcomm.pipeline.MessageBuffer.restore(root / f"{kind}{b}", self.path(b, kind))
            )
        count = len(self.buffers)
        self.buffers, self.memories = restored[:count], restored[count:]
        self.stale = []

    def summary(self) -> dict[str, Any]:
        """Message-buffer footprint: bytes per boundary and in all."""
        per = [buf.nbytes for buf in self.buffers]
        out = {"buffer_bytes_per_boundary": per[0] if per else 0, "buffer_bytes": sum(per)}
        if self.memory:
            out["gradient_memory_bytes"] = sum(buf.nbytes for buf in self.memories)
        return out
