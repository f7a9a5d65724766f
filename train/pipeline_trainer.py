"""Pipeline-parallel (and data-parallel) GPT training with AQ-SGD message buffers.

The mesh is ``workers x stages`` (axes ``data`` and ``stage``). Every per-device state leaf
has two leading axes ``[D, S, ...]``: stage ``s`` holds its blocks (and copies of the
embedding and head, used only by the first and last stage). Each step:

1. the batch's previous messages are read from the :class:`jaxcomm.MessageBuffer` of every
   boundary (issued asynchronously one step ahead, so the read overlaps the previous step);
2. the jitted step runs the GPipe pipeline (:func:`jaxcomm.gpipe`) with the configured
   boundary codec, then the configured aggregator averages each stage's gradients over
   ``data`` (dense or error-compensated quantized) and the optimizer applies them;
3. the new previous messages of every boundary are written back (asynchronously).

Communication is modelled per step as the pipeline's point-to-point transfers (``2 M``
messages per boundary: activations or deltas forward, activation gradients back, with their
measured bytes) plus the aggregator's collectives, added without overlap: an upper bound.
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.network import empty_log, log_collective
from jaxcomm.pipeline import BoundaryState
from models import GPTConfig
from train.config import Config
from train.data import Loader
from train.pipeline import gpt_pipeline_loss, stage_params, unstage_params
from train.trainer import AXIS, Trainer, _all_finite

__all__ = ["PipelineTrainer"]

STAGE = "stage"


def _sq(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a[0, 0], tree)


def _ex(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a[None, None], tree)


def make_boundary(cfg: Config) -> jaxcomm.Boundary:
    """The boundary codec named by ``cfg.boundary`` with its bit widths."""
    bw = cfg.bw_bits or None
    if cfg.boundary == "fp32":
        return jaxcomm.fp32_boundary(bw)
    if cfg.boundary == "directq":
        return jaxcomm.directq_boundary(cfg.fw_bits, bw)
    return jaxcomm.aqsgd_boundary(cfg.fw_bits, bw)


class PipelineTrainer(Trainer):
    """:class:`~train.trainer.Trainer` over a ``data x stage`` mesh with boundary codecs."""

    def __init__(self, cfg: Config):
        self.stages = cfg.stages
        if cfg.workers * cfg.stages > jax.device_count():
            raise ValueError(
                f"workers * stages = {cfg.workers * cfg.stages} devices needed, JAX sees "
                f"{jax.device_count()}"
            )
        super().__init__(cfg)

    # The data loader shards over data replicas only; stages share a replica's batch.
    def _setup_mesh(self) -> None:
        n, s = self.cfg.workers, self.stages
        self.mesh = jax.make_mesh((n, s), (AXIS, STAGE), devices=jax.devices()[: n * s])
        self.sharded = NamedSharding(self.mesh, P(AXIS, STAGE))
        self.by_data = NamedSharding(self.mesh, P(AXIS))
        self.replicated = NamedSharding(self.mesh, P())

    def _init_state(self) -> tuple[Any, Any]:
        self._setup_mesh()
        cfg = self.cfg
        self.gpt_cfg: GPTConfig = self.task.module.cfg
        self.micro = cfg.global_batch // (cfg.workers * cfg.microbatches)
        params = self._initial_params()
        staged = stage_params(params, self.gpt_cfg, self.stages)
        stacked = jax.tree_util.tree_map(
            lambda a: jax.device_put(
                jnp.broadcast_to(a[None], (cfg.workers, *a.shape)), self.sharded
            ),
            staged,
        )
        init = jax.shard_map(
            lambda p: _ex(self.tx.init(_sq(p))),
            mesh=self.mesh,
            in_specs=P(AXIS, STAGE),
            out_specs=P(AXIS, STAGE),
            check_vma=False,
        )
        opt_state = jax.jit(init)(stacked)
        act = (self.gpt_cfg.seq_len, self.gpt_cfg.width)
        # Only AQ-SGD needs previous messages; the other boundaries ignore them.
        self.buffers = [
            jaxcomm.MessageBuffer(
                len(self.train_data),
                act,
                storage_bits=cfg.buffer_bits or None,
                path=(f"{cfg.buffer_dir}/boundary{b}" if cfg.buffer_dir else None),
            )
            for b in range(self.stages - 1 if cfg.boundary == "aqsgd" else 0)
        ]
        self._pending_reads: dict[int, list] = {}
        self._io: dict[str, float] = {}
        self._zero_state: BoundaryState | None = None
        self._last_ids: np.ndarray | None = None
        self._last_state: Any = None
        return stacked, opt_state

    def _build_step(self) -> Callable:
        loss_fn = gpt_pipeline_loss(self.gpt_cfg, boundary=make_boundary(self.cfg))
        tx = self.tx
        m = self.cfg.microbatches

        def per_device(params, opt_state, batch, bstate, key):
            p, s, b, st = _sq(params), _sq(opt_state), _sq(batch), _sq(bstate)
            k = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
            (loss, (st, fw, bw)), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, b, st, k)
            updates, s = tx.update(grads, s, p)
            p = optax.apply_updates(p, updates)
            finite = jax.lax.pmin(_all_finite((loss, grads, p)).astype(jnp.int32), (AXIS, STAGE))
            metrics = {"loss": jax.lax.pmean(loss, AXIS)}
            sent = jax.lax.pmax(fw + bw, (AXIS, STAGE))
            log = log_collective(
                empty_log(), "p2p", sent, sent, rounds=2 * m, path_bytes=sent, calls=2 * m
            )
            return _ex(p), _ex(s), metrics, finite, _ex(st), log

        step = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(P(AXIS, STAGE), P(AXIS, STAGE), P(AXIS), P(AXIS, STAGE), P()),
            out_specs=(P(AXIS, STAGE), P(AXIS, STAGE), P(), P(), P(AXIS, STAGE), P()),
            check_vma=False,
        )
        return jax.jit(step, donate_argnums=(0, 1))

    def _build_eval(self) -> Callable:
        loss_fn = gpt_pipeline_loss(self.gpt_cfg)

        def per_device(params, batch, bstate):
            loss, _ = loss_fn(_sq(params), _sq(batch), _sq(bstate), jax.random.key(0))
            return {"loss": jax.lax.pmean(loss, AXIS)}

        f = jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(P(AXIS, STAGE), P(AXIS), P(AXIS, STAGE)),
            out_specs=P(),
            check_vma=False,
        )
        return jax.jit(f)

    # ------------------------------------------------------------------ batches and buffers

    def _micro(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        d, m = self.cfg.workers, self.cfg.microbatches
        tokens = batch["tokens"].reshape(d, 1, m, self.micro, -1)
        return {"tokens": jax.device_put(tokens, self.by_data)}

    def _boundary_state(self, ids: np.ndarray, reads: list | None) -> BoundaryState:
        """Previous messages of the batch for every device: ``[D, S, M, mb, T, W]``.

        Adds to ``self._io``: seconds blocked on the buffer reads (``buffer_read_wait_s``)
        and spent building the host arrays and putting them on the devices (``buffer_copy_s``).
        """
        if not self.buffers and self._zero_state is not None:
            return self._zero_state  # boundaries without previous messages
        d, s, m = self.cfg.workers, self.stages, self.cfg.microbatches
        t, w = self.gpt_cfg.seq_len, self.gpt_cfg.width
        t0 = time.perf_counter()
        values = np.zeros((d, s, m, self.micro, t, w), np.float32)
        seen = np.zeros((d, s, m, self.micro), bool)
        prev_in, prev_out = values.copy(), values
        seen_in, seen_out = seen.copy(), seen
        wait = 0.0
        for b, buf in enumerate(self.buffers):
            handle = reads[b] if reads else buf.read_async(ids)
            t1 = time.perf_counter()
            v, f = handle.result(), handle.seen()
            wait += time.perf_counter() - t1
            v = v.reshape(d, m, self.micro, t, w)
            f = f.reshape(d, m, self.micro)
            prev_out[:, b], seen_out[:, b] = v, f
            prev_in[:, b + 1], seen_in[:, b + 1] = v, f
        state = jax.device_put(BoundaryState(prev_in, prev_out, seen_in, seen_out), self.sharded)
        jax.block_until_ready(state)
        if not self.buffers:
            self._zero_state = state
        self._io["buffer_read_wait_s"] = self._io.get("buffer_read_wait_s", 0.0) + wait
        self._io["buffer_copy_s"] = (
            self._io.get("buffer_copy_s", 0.0) + time.perf_counter() - t0 - wait
        )
        return state

    def _compile(self) -> Callable:
        ids = self.loader.batch_ids(self.loader.position)
        batch = self._micro(self.train_data.get(ids))
        state = self._boundary_state(ids, None)
        key = jax.random.key(self.cfg.seed)
        return self._train_step.lower(self.params, self.opt_state, batch, state, key).compile()

    def _step_once(self, compiled: Callable) -> tuple:
        position = self.loader.position
        ids = self.loader.batch_ids(position)
        batch = self._micro(self.train_data.get(ids))
        reads = self._pending_reads.pop(position, None)
        self._io = {}
        state = self._boundary_state(ids, reads)
        self.loader.position = position + 1
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), position)
        t0 = time.perf_counter()
        params, opt_state, metrics, finite, new_state, log = compiled(
            self.params, self.opt_state, batch, state, key
        )
        jax.block_until_ready((params, opt_state, new_state))
        compute_s = time.perf_counter() - t0
        self._last_ids, self._last_state = ids, new_state
        return params, opt_state, metrics, finite, compute_s, [log]

    def _after_step(self) -> None:
        """Write the new messages back and prefetch the next batch's (same ids never race:
        a buffer read waits for pending writes of its ids)."""
        if self.buffers:
            t0 = time.perf_counter()
            prev_out = np.asarray(self._last_state.prev_out)  # [D, S, M, mb, T, W]
            t1 = time.perf_counter()
            t, w = self.gpt_cfg.seq_len, self.gpt_cfg.width
            for b, buf in enumerate(self.buffers):
                buf.write_async(self._last_ids, prev_out[:, b].reshape(-1, t, w))
            nxt = self.loader.position
            if self.step < self.cfg.steps:
                ids = self.loader.batch_ids(nxt)
                self._pending_reads[nxt] = [buf.read_async(ids) for buf in self.buffers]
            self._io["buffer_copy_s"] = self._io.get("buffer_copy_s", 0.0) + t1 - t0
            self._io["buffer_issue_s"] = time.perf_counter() - t1

    def _step_extras(self) -> dict[str, float]:
        """Message-buffer time on the step's critical path, in seconds: blocked on the
        prefetched reads (``buffer_read_wait_s``), issuing the writes and the next reads
        (``buffer_issue_s``), and the host/device copies of the messages (``buffer_copy_s``)."""
        return dict(self._io)

    def _summary_extras(self) -> dict[str, Any]:
        """Message-buffer footprint: bytes per boundary and in all."""
        per = [buf.nbytes for buf in self.buffers]
        return {"buffer_bytes_per_boundary": per[0] if per else 0, "buffer_bytes": sum(per)}

    def evaluate(self) -> dict[str, float]:
        """Validation loss through the pipeline (FP32 boundaries, no buffer)."""
        d, m = self.cfg.workers, self.cfg.microbatches
        size = d * m * self.micro
        loader = Loader(self.valid_data, size, seed=0, num_shards=d, shuffle=False)
        count = min(self.cfg.eval_batches, loader.batches_per_epoch)
        t, w = self.gpt_cfg.seq_len, self.gpt_cfg.width
        zeros = np.zeros((d, self.stages, m, self.micro, t, w), np.float32)
        unseen = np.zeros((d, self.stages, m, self.micro), bool)
        state = jax.device_put(BoundaryState(zeros, zeros, unseen, unseen), self.sharded)
        total = 0.0
        for _ in range(count):
            total += float(self._eval_step(self.params, self._micro(loader.next()), state)["loss"])
        return {"loss": total / max(count, 1)}

    def fingerprint(self) -> dict[str, Any]:
        """Checkpoint identity: the data-parallel one plus the pipeline layout."""
        fp = super().fingerprint()
        fp.update(
            stages=self.stages,
            microbatches=self.cfg.microbatches,
            boundary=self.cfg.boundary,
            fw_bits=self.cfg.fw_bits,
            bw_bits=self.cfg.bw_bits,
        )
        return fp

    def save(self, manager) -> None:
        """Checkpoint the training state and snapshot every message buffer with it."""
        for buf in self.buffers:
            buf.flush()
        super().save(manager)
        if not self.buffers:
            return
        root = self.cfg.run_dir / "buffers" / str(self.step)
        for b, buf in enumerate(self.buffers):
            buf.save(root / f"boundary{b}", overwrite=True)
        # Keep the snapshots of the checkpoints Orbax keeps, and only those.
        kept = {str(step) for step in manager.all_steps()}
        for old in root.parent.iterdir():
            if old.name not in kept:
                shutil.rmtree(old, ignore_errors=True)

    def restore(self, manager) -> bool:
        """Restore the newest checkpoint and the buffer snapshots saved with it."""
        if not super().restore(manager):
            return False
        root = self.cfg.run_dir / "buffers" / str(self.step)
        self.buffers = [
            jaxcomm.MessageBuffer.restore(root / f"boundary{b}") for b in range(len(self.buffers))
        ]
        self._pending_reads.clear()
        return True

    def num_params(self) -> int:
        """Parameters of the model: every stage's blocks, one embedding and one head."""

        def count(tree, lead):
            return sum(math.prod(a.shape[lead:]) for a in jax.tree_util.tree_leaves(tree))

        p = self.params
        return count(p["blocks"], 1) + count(p["embed"], 2) + count(p["head"], 2)

    def worker_params(self, worker: int = 0) -> Any:
        """Stage-stacked parameters of one data replica as host numpy arrays."""
        return jax.tree_util.tree_map(lambda a: np.asarray(a)[worker], self.params)

    def model_params(self) -> Any:
        """Data replica 0's parameters in the GPT's own layout (stages joined)."""
        return unstage_params(self.worker_params(0), self.gpt_cfg)
