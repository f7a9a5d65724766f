"""Pipeline-parallel (and data-parallel) GPT training with AQ-SGD message buffers.

The mesh is ``workers x stages`` (axes ``data`` and ``stage``). Every parameter leaf has
two leading axes ``[D, S, ...]``: stage ``s`` holds its blocks, and the layout keeps a slot
for the embedding and head on every stage, although only stage 0's embedding and the last
stage's head are used, updated and averaged (the other slots keep their initial values and
cost memory, never bytes). Each step:

1. the jitted step runs the GPipe pipeline (:func:`jaxcomm.gpipe`) with the configured
   boundary codec, then the configured aggregator averages each stage's block gradients over
   ``data`` (dense or error-compensated quantized) and the optimizer applies them;
2. two small programs on the stage-0 and last-stage devices only (``data``-axis sub-meshes
   whose arrays share the step's buffers, no copy) average and apply the embedding's and the
   head's gradients with the same aggregator and optimizer, so no other stage sends their
   bytes; the optimizer state is ``{"blocks", "embed", "head"}`` accordingly;
3. while they run, the next step's batch and the previous messages of its samples are read
   from the :class:`jaxcomm.MessageBuffer` of every boundary and copied to the devices;
4. the step's new messages are written back (asynchronously).

There are two compiled steps: while any sample of a step is on its first visit, AQ-SGD
sends float32 (and resets the buffer rows); once all were seen, it sends deltas. The host
knows which from the buffers' ``seen`` flags, so the payloads are exactly the wire.

Aggregators that scale by statistics of the whole gradient (EC-quantized buckets, SSDM's and
EF-signSGD's norms) compute them per group here: the blocks of a stage, the embedding, the
head. Each group's aggregator state draws its own random keys (folded with the stage and the
group), so no two groups share rounding noise.

Separate programs, rather than the averaging inside a ``lax.cond`` on the stage index: XLA's
CPU runtime requires every device of a program to join every collective, so a collective
that only some stages run deadlocks there.

Communication is each device's logged traffic: the pipeline's point-to-point messages (one
round per tick that carries any) plus the aggregator's collectives. With a ``compute``
device the simulated step follows GPipe's timeline (:meth:`PipelineTrainer.simulate_step`);
with ``compute: measured`` the measured step and the communication are added (or overlapped).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.network import find_logs
from jaxcomm.pipeline import FIRST_SCOPE, LAST_SCOPE, BoundaryState
from models import GPTConfig
from train.config import Config
from train.data import Loader
from train.distributed import is_primary, to_host
from train.pipeline import gpt_pipeline_loss, stage_params, unstage_params
from train.trainer import AXIS, Trainer, _all_finite, checked, costed, host_finite, structs

__all__ = ["PipelineTrainer"]

STAGE = "stage"
OWNED = ("embed", "head")  # parameters used by one stage only: stage 0 and the last
_COST_FIELDS = ("flops", "matmul_flops", "transcendentals", "hbm_bytes")


class _Prepared(NamedTuple):
    """A step's inputs on the devices: batch, boundary state and boundary mode."""

    position: int
    ids: np.ndarray
    batch: dict[str, jax.Array]
    state: BoundaryState
    seen: bool
    seconds: float  # host time spent preparing it (reads waited on, copies issued)


def _ready_at(tree: Any) -> float:
    """Wait for ``tree``'s arrays and return the time they were ready (``perf_counter``)."""
    jax.block_until_ready(tree)
    return time.perf_counter()


def _is_keyed(node: Any) -> bool:
    return hasattr(node, "_replace") and hasattr(node, "key")


def _salted(state: Any, salt: Any) -> Any:
    """``state`` with the PRNG key of every keyed aggregator state folded with ``salt``, so
    that parameter groups and stages (each its own data-parallel group) draw independent
    rounding noise from one seed."""

    def fix(node):
        if not _is_keyed(node):
            return node
        key = jax.random.fold_in(jax.random.wrap_key_data(node.key), salt)
        return node._replace(key=jax.random.key_data(key))

    return jax.tree_util.tree_map(fix, state, is_leaf=_is_keyed)


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


def _global(full: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array as a global array of ``sharding``: each process copies only the slices
    of its own devices (every process passes the same shape)."""
    return jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])


class PipelineTrainer(Trainer):
    """:class:`~train.trainer.Trainer` over a ``data x stage`` mesh with boundary codecs."""

    def __init__(self, cfg: Config, *, abstract: bool = False):
        self.stages = cfg.stages
        if cfg.workers * cfg.stages > jax.device_count():
            raise ValueError(
                f"workers * stages = {cfg.workers * cfg.stages} devices needed, JAX sees "
                f"{jax.device_count()}"
            )
        self._ticks: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._busy: dict[Any, np.ndarray] = {}
        super().__init__(cfg, abstract=abstract)

    # The data loader shards over data replicas only; stages share a replica's batch.
    def _setup_mesh(self) -> None:
        n, s = self.cfg.workers, self.stages
        if jax.process_count() > 1 and n * s != jax.device_count():
            raise ValueError(
                f"workers * stages = {n * s} must use every device of a multi-process run "
                f"({jax.process_count()} processes, {jax.device_count()} devices)"
            )
        self.mesh = jax.make_mesh((n, s), (AXIS, STAGE), devices=jax.devices()[: n * s])
        me = jax.process_index()
        # (replica, stage) of every device this process owns, in mesh order.
        self._local_cells = [
            (d, st)
            for d in range(n)
            for st in range(s)
            if self.mesh.devices[d, st].process_index == me
        ]
        self._local_replicas = sorted({d for d, _ in self._local_cells})
        self.sharded = NamedSharding(self.mesh, P(AXIS, STAGE))
        self.by_data = NamedSharding(self.mesh, P(AXIS))
        self.replicated = NamedSharding(self.mesh, P())
        self.sub_mesh = {
            name: jax.sharding.Mesh(
                self.mesh.devices[:, self._owner(name)], (AXIS,), self.mesh.axis_types[:1]
            )
            for name in OWNED
        }

    def _owner(self, name: str) -> int:
        """The stage that uses parameter group ``name`` (``embed``: 0, ``head``: the last)."""
        return 0 if name == "embed" else self.stages - 1

    def _owned_view(self, tree: Any, name: str) -> Any:
        """``[D, S, ...]`` arrays as ``[D, 1, ...]`` arrays on ``name``'s owner sub-mesh,
        made of the owner stage's shards (the same device buffers, nothing copied)."""
        devices = list(self.mesh.devices[:, self._owner(name)])
        sharding = NamedSharding(self.sub_mesh[name], P(AXIS))
        if self.abstract:
            return jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(
                    (a.shape[0], 1, *a.shape[2:]), a.dtype, sharding=sharding
                ),
                tree,
            )

        def one(a):
            shards = {sh.device: sh.data for sh in a.addressable_shards}
            return jax.make_array_from_single_device_arrays(
                (a.shape[0], 1, *a.shape[2:]),
                sharding,
                [shards[d] for d in devices if d in shards],
                dtype=a.dtype,
            )

        return jax.tree_util.tree_map(one, tree)

    def _merged(self, full: Any, owned: Any) -> Any:
        """``full`` (``[D, S, ...]``) with its owner-stage shards replaced by ``owned``'s."""

        def one(a, b):
            new = {sh.device: sh.data for sh in b.addressable_shards}
            arrays = [new.get(sh.device, sh.data) for sh in a.addressable_shards]
            return jax.make_array_from_single_device_arrays(
                a.shape, a.sharding, arrays, dtype=a.dtype
            )

        return jax.tree_util.tree_map(one, full, owned)

    def _place(self, log: Any, name: str) -> Any:
        """A ``[D, 1, ...]`` log of ``name``'s sub-mesh as a ``[D, S, ...]`` host log."""
        s = self._owner(name)

        def one(a):
            a = to_host(a)
            out = np.zeros((a.shape[0], self.stages, *a.shape[2:]), a.dtype)
            out[:, s] = a[:, 0]
            return out

        return jax.tree_util.tree_map(one, log)

    def _init_state(self) -> tuple[Any, Any]:
        self._setup_mesh()
        cfg = self.cfg
        self.gpt_cfg: GPTConfig = self.task.module.cfg
        self.micro = cfg.global_batch // (cfg.workers * cfg.microbatches)
        params = self._initial_params()
        if self.abstract:
            staged = jax.eval_shape(lambda p: stage_params(p, self.gpt_cfg, self.stages), params)
            stacked = structs(staged, self.sharded, lead=(cfg.workers,))
        else:
            staged = stage_params(params, self.gpt_cfg, self.stages)
            stacked = jax.tree_util.tree_map(
                lambda a: _global(np.broadcast_to(np.asarray(a)[None], (cfg.workers, *a.shape)),
                                  self.sharded),
                staged,
            )  # fmt: skip

        # One transform per parameter group: the same for every group when the data
        # replicas aggregate every step; each group on its own schedule with local SGD.
        units = {
            name: jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), staged[name]
            )
            for name in ("embed", "blocks", "head")
        }
        if self.control is None:
            self.group_tx = self.sync.group_txs(self, units, self.stages)
        else:  # the controller's first program, for every group
            tx = self.control.make_tx(self, self.control.program_key(self))
            self.group_tx = {name: tx for name in units}
        self._ckey = self._control_key()
        self._variants: dict[Any, tuple] = {}

        def init(mesh, spec, tree, salt, tx):
            f = jax.shard_map(
                lambda p: _ex(_salted(tx.init(_sq(p)), salt())),
                mesh=mesh,
                in_specs=spec,
                out_specs=spec,
                check_vma=False,
            )
            if self.abstract:
                return structs(jax.eval_shape(jax.jit(f), tree), NamedSharding(mesh, spec))
            return jax.jit(f)(tree)

        s = self.stages
        stage = lambda: jax.lax.axis_index(STAGE)  # noqa: E731
        blocks = stacked["blocks"]
        opt_state = {
            "blocks": init(self.mesh, P(AXIS, STAGE), blocks, stage, self.group_tx["blocks"])
        }
        for i, name in enumerate(OWNED):
            view = self._owned_view(stacked[name], name)
            opt_state[name] = init(
                self.sub_mesh[name], P(AXIS), view, lambda i=i: s + i, self.group_tx[name]
            )
        act = (self.gpt_cfg.seq_len, self.gpt_cfg.width)
        # Only AQ-SGD needs previous messages; the other boundaries ignore them.
        count = self.stages - 1 if cfg.boundary == "aqsgd" and not self.abstract else 0
        paths = [self._buffer_path(b) for b in range(count)] if cfg.buffer_dir else []
        # Buffers found on disk belong to an earlier run: only a resume may keep them.
        self._stale = [p for p in paths if Path(p).exists() and any(Path(p).iterdir())]
        self.buffers = [
            jaxcomm.MessageBuffer(
                len(self.train_data),
                act,
                storage_bits=cfg.buffer_bits or None,
                path=self._buffer_path(b),
            )
            for b in range(count)
        ]
        self._io: dict[str, float] = {}
        self._waiter = concurrent.futures.ThreadPoolExecutor(1, "jaxcomm-step-wait")
        self._zero_state: BoundaryState | None = None
        self._next: _Prepared | None = None
        self._compiled: dict[bool, Any] = {}
        self._owned_compiled: dict[str, Any] = {}
        self._owned_step = {name: self._build_owned_step(name) for name in OWNED}
        self._last_ids: np.ndarray | None = None
        self._last_state: Any = None
        return stacked, opt_state

    def _build_step(self) -> dict[bool, Callable]:
        """One jitted step per boundary mode: ``seen=False`` (some sample of the step is on
        its first visit: AQ-SGD sends float32) and ``seen=True`` (deltas)."""
        boundary = make_boundary(self.cfg)
        loss_fn = gpt_pipeline_loss(self.gpt_cfg, boundary=boundary)
        tx = self.group_tx["blocks"]

        def per_device(blocks, owned, opt_state, batch, bstate, key, seen):
            p = {"blocks": _sq(blocks), **_sq(owned)}
            s, b, st = _sq(opt_state), _sq(batch), _sq(bstate)
            k = jax.random.fold_in(key, jax.lax.axis_index(AXIS))
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, (st, log)), grads = grad_fn(p, b, st, k, seen)
            # Only the blocks are averaged and updated here; the embedding's and head's
            # gradients go to the programs of their own stages (see the module docstring).
            updates, new_s = tx.update(grads["blocks"], s, p["blocks"])
            new_blocks = optax.apply_updates(p["blocks"], updates)
            ok = _all_finite((loss, grads, new_blocks)).astype(jnp.int32)
            # The loss (the same on every stage of a replica) and the finite flag of each
            # device go to the host, which averages them: no collective in the step for them.
            metrics, finite = {"loss": _ex(loss)}, _ex(ok)
            owned_grads = {name: grads[name] for name in OWNED}
            return (_ex(new_blocks), _ex(new_s), _ex(owned_grads), metrics, finite) + (
                _ex(st),
                _ex(log),
            )

        def build(seen: bool) -> Callable:
            sharded = P(AXIS, STAGE)
            step = jax.shard_map(
                functools.partial(per_device, seen=seen),
                mesh=self.mesh,
                in_specs=(sharded, sharded, sharded, P(AXIS), sharded, P()),
                out_specs=(sharded,) * 7,
                check_vma=False,
            )
            return jax.jit(step, donate_argnums=(0, 2))

        return (
            {False: build(False), True: build(True)}
            if boundary.uses_buffer
            else {False: build(False)}
        )

    def _build_owned_step(self, name: str) -> Callable:
        """Average and apply ``name``'s gradients over ``data`` on its owner stage's devices:
        ``(params, opt_state, grads) -> (params, opt_state, finite)``, ``[D, 1, ...]``."""
        tx = self.group_tx[name]

        def per_device(params, opt_state, grads):
            p, s, g = _sq(params), _sq(opt_state), _sq(grads)
            updates, s = tx.update(g, s, p)
            p = optax.apply_updates(p, updates)
            ok = _all_finite(p).astype(jnp.int32)
            return _ex(p), _ex(s), _ex(ok)

        step = jax.shard_map(
            per_device,
            mesh=self.sub_mesh[name],
            in_specs=(P(AXIS), P(AXIS), P(AXIS)),
            out_specs=(P(AXIS), P(AXIS), P(AXIS)),
            check_vma=False,
        )
        return jax.jit(step)

    def _build_eval(self) -> Callable:
        loss_fn = gpt_pipeline_loss(self.gpt_cfg)

        def per_device(params, batch, bstate):
            loss, _ = loss_fn(
                _sq(params), _sq(batch), _sq(bstate), jax.random.key(0), backward=False
            )
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

    def _buffer_path(self, b: int) -> str | None:
        """Where boundary ``b``'s buffer lives on disk (None: in memory); each process of
        a multi-process run keeps its own, for the replicas whose stages it holds."""
        if not self.cfg.buffer_dir:
            return None
        sub = f"/process{jax.process_index()}" if jax.process_count() > 1 else ""
        return f"{self.cfg.buffer_dir}{sub}/boundary{b}"

    def _replica_ids(self, ids: np.ndarray) -> np.ndarray:
        """A step's sample ids ``[B]`` as ``[D, M * mb]``: the rows of each data replica."""
        return ids.reshape(self.cfg.workers, -1)

    def _micro(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        d, m = self.cfg.workers, self.cfg.microbatches
        tokens = batch["tokens"].reshape(d, 1, m, self.micro, -1)
        return {"tokens": _global(tokens, self.by_data)}

    def _local_batch(self, ids: np.ndarray) -> dict[str, jax.Array]:
        """The step's tokens, loading only the replicas this process holds (the others'
        rows stay zero on the host and are never copied to a device)."""
        rows = self._replica_ids(ids)
        mine = self._local_replicas
        local = self.train_data.get(rows[mine].reshape(-1))["tokens"]
        tokens = np.zeros((rows.shape[0], rows.shape[1], local.shape[-1]), local.dtype)
        tokens[mine] = local.reshape(len(mine), rows.shape[1], -1)
        return self._micro({"tokens": tokens.reshape(-1, local.shape[-1])})

    def _zeros_state(self) -> BoundaryState:
        if self._zero_state is None:
            d, s, m = self.cfg.workers, self.stages, self.cfg.microbatches
            t, w = self.gpt_cfg.seq_len, self.gpt_cfg.width
            zeros = np.zeros((d, s, m, self.micro, t, w), np.float32)
            self._zero_state = BoundaryState(
                _global(zeros, self.sharded), _global(zeros, self.sharded)
            )
        return self._zero_state

    def _prepare(self, position: int) -> _Prepared:
        """Everything step ``position`` needs on the devices: its batch, the previous messages
        of its samples at every boundary (``[D, S, M, mb, T, W]``) and its boundary mode.

        The buffer reads and the host-to-device copies are issued here without waiting for
        the devices, so called while a step runs they overlap its compute.
        """
        t0 = time.perf_counter()
        ids = self.loader.batch_ids(position)
        batch = self._local_batch(ids)
        if not self.buffers:
            return _Prepared(position, ids, batch, self._zeros_state(), False, 0.0)
        d, s, m = self.cfg.workers, self.stages, self.cfg.microbatches
        t, w = self.gpt_cfg.seq_len, self.gpt_cfg.width
        prev = np.zeros((d, s, m, self.micro, t, w), np.float32)
        prev_in = np.zeros_like(prev)
        seen = True
        # Each process reads boundary b's messages of the replicas d where it holds the
        # sender (d, b) or the receiver (d, b + 1): those it wrote after earlier steps.
        cells = set(self._local_cells)
        reads = []
        for b, buf in enumerate(self.buffers):
            mine = [r for r in range(d) if (r, b) in cells or (r, b + 1) in cells]
            if mine:
                rows = self._replica_ids(ids)[mine].reshape(-1)
                reads.append((b, mine, buf.read_async(rows)))
        for b, mine, handle in reads:
            v = handle.result().reshape(len(mine), m, self.micro, t, w)
            seen = seen and bool(handle.seen().all())
            prev[mine, b], prev_in[mine, b + 1] = v, v
        if jax.process_count() > 1:  # every process must run the same program
            from jax.experimental import multihost_utils

            seen = bool(np.all(multihost_utils.process_allgather(np.array([seen]))))
        if not seen:  # first visits (or a mix): everything crosses in float32
            prev[:], prev_in[:] = 0.0, 0.0
        state = BoundaryState(_global(prev_in, self.sharded), _global(prev, self.sharded))
        return _Prepared(position, ids, batch, state, seen, time.perf_counter() - t0)

    def _prepare_abstract(self, seen: bool) -> _Prepared:
        """Shapes of a step's inputs in boundary mode ``seen`` (nothing allocated)."""
        d, s, m = self.cfg.workers, self.stages, self.cfg.microbatches
        t, w = self.gpt_cfg.seq_len, self.gpt_cfg.width
        tokens = jax.ShapeDtypeStruct(
            (d, 1, m, self.micro, t + 1), jnp.int32, sharding=self.by_data
        )
        prev = jax.ShapeDtypeStruct((d, s, m, self.micro, t, w), jnp.float32, sharding=self.sharded)
        ids = np.arange(d * m * self.micro)
        return _Prepared(0, ids, {"tokens": tokens}, BoundaryState(prev, prev), seen, 0.0)

    def _compile(self) -> dict[bool, Any]:
        if self._stale:
            raise ValueError(
                f"buffer_dir={self.cfg.buffer_dir!r} already holds message buffers "
                f"({', '.join(self._stale)}) and this run does not resume a checkpoint that "
                "owns them; empty it, choose another buffer_dir, or pass --resume"
            )
        self._next = self._prepare(self.loader.position)
        self._compiled: dict[bool, Any] = {}
        return self._compiled

    def _program(self, prep: _Prepared) -> Any:
        """The compiled step for ``prep``'s boundary mode (compiled on first use)."""
        if prep.seen not in self._compiled:
            self._compiled[prep.seen] = checked(
                self._train_step[prep.seen]
                .lower(
                    self.params["blocks"],
                    {name: self.params[name] for name in OWNED},
                    self.opt_state["blocks"],
                    prep.batch,
                    prep.state,
                    jax.random.key(0),
                )
                .compile(),
                "the pipeline step",
            )
        for name in OWNED:  # gradients have the parameters' shapes and shardings
            if name not in self._owned_compiled:
                view = self._owned_view(self.params[name], name)
                lowered = self._owned_step[name].lower(view, self.opt_state[name], view)
                self._owned_compiled[name] = checked(lowered.compile(), f"the {name} update")
        return self._compiled[prep.seen]

    def _step_once(self, compiled: Any) -> tuple:
        cur = self._next
        self._io = {"buffer_exposed_s": 0.0, "buffer_prefetch_s": 0.0}
        if cur is None or cur.position != self.loader.position:
            cur = self._prepare(self.loader.position)
            self._io["buffer_exposed_s"] = cur.seconds
        self._use(self._control_key())
        program = self._program(cur)
        self._last_seen = cur.seen
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), cur.position)
        t0 = time.perf_counter()
        owned = {name: self.params[name] for name in OWNED}
        blocks, opt_blocks, owned_grads, metrics, finite, new_state, log = program(
            self.params["blocks"], owned, self.opt_state["blocks"], cur.batch, cur.state, key
        )
        # Stamp the moment the devices finish from a waiting thread, so that neither the
        # step time nor the exposed buffer time depends on how long the prefetch took.
        main_done = self._waiter.submit(_ready_at, (blocks, opt_blocks, owned_grads, new_state))
        # Step t + 1's batch, buffer reads and host-to-device copies go out while step t
        # runs, unless they would read rows step t is about to write (an epoch boundary):
        # then they are prepared after its writes, and the time is exposed. This comes
        # before the embedding's and head's programs, whose dispatch can wait for the step
        # (their collectives need its devices).
        self._next = None
        nxt = cur.position + 1
        if self.step + 1 < self.cfg.steps and not (
            self.buffers and np.intersect1d(self.loader.batch_ids(nxt), cur.ids).size
        ):
            self._next = self._prepare(nxt)
        prefetch_end = time.perf_counter()
        params, opt_state, finites = self._apply_owned(owned, owned_grads, self.opt_state)
        params["blocks"], opt_state["blocks"] = blocks, opt_blocks
        finites.append(finite)
        done = self._waiter.submit(_ready_at, (params, opt_state, finites))
        main_end, device_end = main_done.result(), done.result()
        # Device time: the step program, then the embedding's and head's programs, which
        # start once both it and the prefetch (dispatched before them) are done.
        compute_s = (main_end - t0) + (device_end - max(main_end, prefetch_end))
        if self._next is not None:
            self._io["buffer_prefetch_s"] = self._next.seconds
            # Host work past the step program's end is on the critical path.
            self._io["buffer_exposed_s"] += max(0.0, prefetch_end - main_end)
        self.loader.position = nxt
        self._last_ids, self._last_state = cur.ids, new_state
        return params, opt_state, metrics, host_finite(*to_host(finites)), compute_s, [log]

    def _apply_owned(self, owned: Any, grads: Any, opt_state: Any) -> tuple[dict, dict, list]:
        """Run the embedding's and head's programs on their stages: ``(params, opt_state,
        finite flags)`` of those groups."""
        params, new_state, finites = {}, {}, []
        for name in OWNED:
            args = (
                self._owned_view(owned[name], name),
                opt_state[name],
                self._owned_view(grads[name], name),
            )
            new_p, new_state[name], ok = self._owned_compiled[name](*args)
            params[name] = self._merged(owned[name], new_p)
            finites.append(ok)
        return params, new_state, finites

    def trial_step(self, key: Any, params: Any, opt_state: Any) -> tuple:
        """One step of the controller's program ``key`` from ``(params, opt_state)`` on
        the loader's next batch and its buffered messages (read, never written): ``(params,
        opt_state, finite, logs, measured_s, program key)``. The blocks' arrays passed in
        are donated."""
        prev = self._ckey
        self._use(key)
        try:
            prep = self._prepare(self.loader.position)
            self.loader.position += 1
            program = self._program(prep)
            rng = jax.random.fold_in(jax.random.key(self.cfg.seed), prep.position)
            owned = {name: params[name] for name in OWNED}
            t0 = time.perf_counter()
            blocks, opt_blocks, grads, _, finite, _, log = program(
                params["blocks"], owned, opt_state["blocks"], prep.batch, prep.state, rng
            )
            new_p, new_s, finites = self._apply_owned(owned, grads, opt_state)
            new_p["blocks"], new_s["blocks"] = blocks, opt_blocks
            jax.block_until_ready((new_p, new_s, finites))
            measured = time.perf_counter() - t0
            ok = host_finite(finite, *to_host(finites))
            logs = [*self._state_logs(new_s), log]
            return new_p, new_s, ok, logs, measured, (prep.seen, key)
        finally:
            self._use(prev)

    def _use(self, ckey: Any) -> None:
        """Make the programs of the controller's key ``ckey`` current: the groups'
        transforms, the steps and their compiled programs (built on first use)."""
        if ckey == self._ckey:
            return
        fields = ("group_tx", "_train_step", "_owned_step", "_compiled", "_owned_compiled")
        self._variants[self._ckey] = tuple(getattr(self, f) for f in fields)
        if ckey in self._variants:
            values = self._variants[ckey]
        else:
            self.group_tx = {name: self.control.make_tx(self, ckey) for name in self.group_tx}
            values = (
                self.group_tx,
                self._build_step(),
                {name: self._build_owned_step(name) for name in OWNED},
                {},
                {},
            )
        for f, v in zip(fields, values, strict=True):
            setattr(self, f, v)
        self._ckey = ckey

    def synced_bytes(self) -> int:
        """Float32 bytes of the gradients the busiest device averages over ``data`` each
        step: a stage's blocks with the embedding (stage 0) or the head (the last)."""

        def count(name, lead):
            return sum(
                math.prod(a.shape[lead:]) for a in jax.tree_util.tree_leaves(self.params[name])
            )

        blocks = count("blocks", 2)
        return 4 * (blocks + max(count("embed", 2), count("head", 2)))

    def smallest_group(self) -> int:
        """Elements of the smallest gradient group a device aggregates by itself."""
        return min(
            sum(math.prod(a.shape[2:]) for a in jax.tree_util.tree_leaves(self.params[name]))
            for name in ("embed", "blocks", "head")
        )

    def _after_step(self) -> None:
        """Write the step's new messages back (asynchronously; a later read of the same ids
        waits for these writes), then the parts' hooks (e.g. a controller reading the
        step's gain)."""
        self._write_back()
        super()._after_step()

    def _write_back(self) -> None:
        if self.buffers:
            t0 = time.perf_counter()
            t, w = self.gpt_cfg.seq_len, self.gpt_cfg.width
            rows = self._replica_ids(self._last_ids)
            # Boundary b's new messages of replica d sit on the sender, device (d, b), as
            # prev_out and on the receiver, device (d, b + 1), as prev_in (equal bit for
            # bit). A process writes every (b, d) it holds either side of; with both sides
            # local, once.
            cells: dict[tuple[int, int], np.ndarray] = {}
            state = self._last_state
            for side, shift in ((state.prev_out, 0), (state.prev_in, 1)):
                for shard in side.addressable_shards:
                    d, st = shard.index[0].start or 0, shard.index[1].start or 0
                    key = (st - shift, d)
                    # Copied to the host only when the other side has not given it already.
                    if 0 <= key[0] < len(self.buffers) and key not in cells:
                        cells[key] = np.asarray(shard.data)
            for b in range(len(self.buffers)):
                parts = sorted((d, v) for (bb, d), v in cells.items() if bb == b)
                if not parts:
                    continue
                ids = np.concatenate([rows[d] for d, _ in parts])
                data = np.concatenate([v.reshape(-1, t, w) for _, v in parts])
                self.buffers[b].write_async(ids, data)
            self._io["buffer_writeback_s"] = time.perf_counter() - t0

    def _state_logs(self, opt_state: Any = None) -> list[Any]:
        """The aggregator logs in the optimizer state (default: the trainer's), each as
        ``[D, S, ...]`` per device."""
        opt_state = self.opt_state if opt_state is None else opt_state
        logs = find_logs(opt_state["blocks"])
        for name in OWNED:
            logs += [self._place(log, name) for log in find_logs(opt_state[name])]
        return logs

    def step_audit(self, seen: bool = False, branches: Any = None) -> Any:
        """Per-device traffic of a step of boundary mode ``seen``, read from its compiled
        programs: the pipeline step plus the embedding's and head's programs on their
        stages (device ``d * S + s`` is data replica ``d``, stage ``s``); see
        :meth:`Trainer.step_audit`."""
        return super().step_audit(seen, branches)

    def _control_key(self) -> Any:
        """The controller's choice of program (None without a controller)."""
        return None if self.control is None else self.control.program_key(self)

    def _program_key(self) -> Any:
        """The boundary mode of the last step (one compiled step per mode), with the
        controller's key when there is one: ``(seen, key)``."""
        return self._last_seen if self.control is None else (self._last_seen, self._ckey)

    def _split(self, key: Any) -> tuple[bool, Any]:
        """``(seen, controller key)`` of a program key (``seen`` alone: the current one)."""
        return tuple(key) if isinstance(key, tuple) else (key, self._ckey)

    def step_programs(self, key: Any = False) -> list[tuple[Any, np.ndarray]]:
        """The pipeline step of boundary mode ``key`` (every device; its ticks run in
        lockstep, so each stage's program spans the GPipe schedule, bubbles included) and
        the embedding's and head's programs with the devices of their stages. Compiled on
        first use. ``key`` may also be ``(seen, controller key)``."""
        seen, ckey = self._split(key)
        prev = self._ckey
        self._use(ckey)
        try:
            if seen not in self._compiled:
                if not self.abstract:
                    raise ValueError(
                        f"no step with boundary mode seen={seen} has been compiled yet"
                    )
                self._program(self._prepare_abstract(seen))
            out = [(self._compiled[seen], np.arange(self.cfg.workers * self.stages))]
            for name in OWNED:
                index = np.arange(self.cfg.workers) * self.stages + self._owner(name)
                out.append((self._owned_compiled[name], index))
        finally:
            self._use(prev)
        return out

    def simulate_step(
        self,
        key: Any,
        traffic: jaxcomm.Traffic,
        network: Any,
        step: int,
        *,
        measured_s: float | None = None,
        overlap: bool | None = None,
        branches: Any = None,
        stream: int = 0,
    ) -> tuple[float, float, float]:
        """Simulated seconds of one step, ``(step, compute, comm)``, on GPipe's timeline.

        With a ``compute`` device, each data replica's pipeline runs
        :func:`jaxcomm.gpipe_timeline`: stage ``s`` spends ``f_s`` and ``b_s`` per
        microbatch (its program's forward and backward ops on the roofline, divided by the
        ``M + S - 1`` ticks the program runs; see :meth:`_tick_seconds`)
        and each message takes ``latency + bytes / bandwidth``; the rest of the stage's
        compute (optimizer, embedding and head updates) follows it, and the data-parallel
        collectives (the traffic beyond the pipeline's messages) are added after it, with
        or without ``overlap`` (they share the links with the pipeline's messages, which
        with ``overlap`` proceed beside the compute). Stragglers scale each device's
        compute and jitter each message's latency (drawn per message). ``compute`` is the
        slowest device's modelled compute, ``comm`` the busiest device's communication.
        With ``compute: measured`` the host's step time has no per-tick breakdown, so the
        step is costed as in :meth:`Trainer.simulate_step`.
        """
        if self.compute_model is None:
            return super().simulate_step(
                key, traffic, network, step, measured_s=measured_s, overlap=overlap, stream=stream
            )
        overlap = self.cfg.overlap if overlap is None else bool(overlap)
        cfg, n_stages = self.cfg, self.stages
        devices = cfg.workers * n_stages
        f, b, rest = self._tick_seconds(key, branches)
        ticks = cfg.microbatches + n_stages - 1
        fw_msg, bw_msg = self._message_bytes(key)
        factors = np.ones(devices)
        p2p_rounds = 2 * (ticks - 1)
        # Each message's latency: [replica, direction, boundary, microbatch], drawn per
        # message with stragglers' jitter.
        shape = (cfg.workers, 2, max(n_stages - 1, 0), cfg.microbatches)
        # A step's own draws are streams 0 (compute, messages) and 1 (the data-parallel
        # rounds); a trial step's stream s > 0 draws from 2s and 2s + 1.
        own, rounds_stream = (0, 1) if not stream else (2 * stream, 2 * stream + 1)
        if self.stragglers is not None:
            factors = self.stragglers.compute_factors(step, devices, stream=own)
            lat = self.stragglers.message_latencies(step, shape, network, stream=own)
        else:
            lat = np.full(shape, network.latency_s)
        latency = float(lat.mean()) if lat.size else network.latency_s
        pipes = []
        for r in range(cfg.workers):
            idx = r * n_stages + np.arange(n_stages)
            line = jaxcomm.gpipe_timeline(
                n_stages,
                cfg.microbatches,
                f[idx] * factors[idx],
                b[idx] * factors[idx],
                network.wire_seconds(1, fw_msg, latency_s=lat[r, 0]),
                network.wire_seconds(1, bw_msg, latency_s=lat[r, 1]),
                overlap=overlap,
            )
            pipes.append(line.seconds + float(np.max(rest[idx] * factors[idx])))
        rounds = traffic.rounds - p2p_rounds
        path = traffic.path_bytes - (ticks - 1) * (fw_msg + bw_msg)
        if (rounds < 0).any() or (path < 0).any():
            raise ValueError(
                "the step's traffic holds fewer rounds or bytes than its pipeline messages: "
                f"rounds {traffic.rounds.tolist()}, path bytes {traffic.path_bytes.tolist()}"
            )
        busiest = int(np.argmax(network.wire_seconds(rounds, path)))
        if self.stragglers is not None:
            lat = self.stragglers.round_latency(
                step, int(rounds[busiest]), cfg.workers, network, stream=rounds_stream
            )
        else:
            lat = int(rounds[busiest]) * network.latency_s
        other = network.wire_seconds(rounds[busiest], float(path[busiest]), latency_s=lat)
        pipe = max(pipes)
        # The data-parallel collectives follow the backward, after the pipeline's own
        # messages on the same links; ``overlap`` hides messages behind compute, not behind
        # other messages.
        seconds = pipe + other
        compute = float(np.max((self._tick_busy(key, branches) + rest) * factors))
        p2p = network.wire_seconds(
            p2p_rounds, (ticks - 1) * (fw_msg + bw_msg), latency_s=p2p_rounds * latency
        )
        comm = p2p + other
        return seconds, compute, comm

    def _message_bytes(self, key: Any) -> tuple[int, int]:
        """Bytes of one forward and one backward boundary message in boundary mode ``key``."""
        g = self.gpt_cfg
        mb = self.cfg.global_batch // (self.cfg.workers * self.cfg.microbatches)
        act = jax.ShapeDtypeStruct((mb, g.seq_len, g.width), jnp.float32)
        seen = self._split(key)[0]
        return jaxcomm.boundary_message_bytes(make_boundary(self.cfg), act, bool(seen))

    def _tick_seconds(
        self, key: Any, branches: Any = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per device (mesh order), roofline seconds of one forward tick, one backward tick
        and the rest of the step.

        The pipeline program's ops are split by their JAX op names: the differentiated
        loss's forward (``jvp(...)``, the ticks with their residual writes) and backward
        (``transpose(...)``), and the rest (optimizer update, finite checks); ops without a
        name (the CPU backend's library fusions, e.g. attention's batched products) are
        shared between forward and backward in proportion to their matrix flops. Each part
        is put on the roofline by itself (a forward may be bound by compute and an update by
        memory), the ticks' parts divided by the ``M + S - 1`` ticks the program runs; the
        embedding's and head's programs join the rest. ``branches`` resolves conditionals
        (e.g. an aggregator's) as in :meth:`step_audit`. The first stage's input function
        and the last stage's loss run inside the ticks under a ``lax.cond`` on the stage,
        which the cost model counts at its costliest branch on every device; their ops
        (named :data:`~jaxcomm.pipeline.FIRST_SCOPE` and ``LAST_SCOPE``) are taken out
        again where they do not run: the input function runs on every tick of stage 0
        only, the loss on the ``M`` ticks of the last stage that carry a microbatch, so the
        last stage's ``f`` and ``b`` hold one loss per microbatch."""
        cache = (key, tuple(sorted((branches or {}).items())))
        if cache in self._ticks:
            return self._ticks[cache]
        model, n = self.compute_model, self.mesh.devices.size
        ticks = self.cfg.microbatches + self.stages - 1
        f, b, rest = np.zeros(n), np.zeros(n), np.zeros(n)
        main, *owned = self.step_programs(key)
        cost = costed(main[0])

        def mine(c):
            return {k: v for k, v in (branches or {}).items() if c._matches(k)}

        def part(select):
            return cost.per_device(mine(cost), select=select)

        def combine(*terms):
            return jaxcomm.ComputeCost(
                **{k: sum(w * getattr(c, k) for w, c in terms) for k in _COST_FIELDS}
            )

        stage = np.arange(n) % self.stages
        first = (stage == 0).astype(np.float64)  # the input function: every tick of stage 0
        last = (stage == self.stages - 1).astype(np.float64)

        def split(last_share):
            """Forward, backward and other costs with the stage conditionals' ops kept at
            ``last_share`` of its counted executions on each device (the input function at
            its own share; the program counts each at its costliest branch everywhere)."""
            total = part(None)
            fw = part(lambda op: "jvp(" in op and "transpose(" not in op)
            bw = part(lambda op: "transpose(" in op)
            for scope, share_run in ((FIRST_SCOPE, first), (LAST_SCOPE, last_share)):
                extra = 1.0 - share_run
                in_fw = part(
                    lambda op, sc=scope: sc in op and "jvp(" in op and "transpose(" not in op
                )
                in_bw = part(lambda op, sc=scope: sc in op and "transpose(" in op)
                fw = combine((1, fw), (-extra, in_fw))
                bw = combine((1, bw), (-extra, in_bw))
                total = combine((1, total), (-extra, in_fw), (-extra, in_bw))
            unnamed = part(lambda op: op == "")
            share = fw.matmul_flops / np.maximum(fw.matmul_flops + bw.matmul_flops, 1.0)
            other = combine((1, total), (-1, fw), (-1, bw), (-1, unnamed))
            fw, bw = combine((1, fw), (share, unnamed)), combine((1, bw), (1 - share, unnamed))
            return fw, bw, other

        # Per microbatch (the timeline's f and b): the loss runs once per microbatch on the
        # last stage, so it counts fully there; the program itself runs it on M of its
        # ticks only, which is what its compute time counts.
        fw, bw, other = split(last)
        f[main[1]] += model.seconds(fw) / ticks
        b[main[1]] += model.seconds(bw) / ticks
        rest[main[1]] += model.seconds(other)
        fw, bw, _ = split(last * self.cfg.microbatches / ticks)
        busy = np.zeros(n)
        busy[main[1]] += model.seconds(fw) + model.seconds(bw)
        self._busy[cache] = busy
        for program, index in owned:
            c = costed(program)
            rest[index] += model.seconds(c.per_device(mine(c)))
        self._ticks[cache] = (f, b, rest)
        return self._ticks[cache]

    def _tick_busy(self, key: Any, branches: Any = None) -> np.ndarray:
        """Per device, roofline seconds of all the ticks of the program (the loss counted
        on the ``M`` ticks that run it), the compute the step's ``compute`` reports."""
        self._tick_seconds(key, branches)
        return self._busy[(key, tuple(sorted((branches or {}).items())))]

    def _lags(self) -> bool:
        # The step already overlaps the next step's host work (batch, buffer reads) with
        # its own devices, and its new messages are written to the host buffer after it.
        return False

    def _step_extras(self, report: dict[str, Any]) -> dict[str, float]:
        """Message-buffer host time, in seconds: ``buffer_prefetch_s`` preparing the next
        step (reads waited on, host arrays built, copies issued) while this one ran,
        ``buffer_exposed_s`` the part of the buffer work the devices waited for (a prefetch
        that outlasted the step, or a step prepared after the previous one ended), and
        ``buffer_writeback_s`` copying the new messages to the host and issuing the writes;
        and the parts' columns (e.g. local SGD's divergence)."""
        return {**super()._step_extras(report), **self._io}

    def _summary_extras(self) -> dict[str, Any]:
        """Message-buffer footprint: bytes per boundary and in all."""
        per = [buf.nbytes for buf in self.buffers]
        return {
            **super()._summary_extras(),
            "buffer_bytes_per_boundary": per[0] if per else 0,
            "buffer_bytes": sum(per),
        }

    def evaluate(self) -> dict[str, float]:
        """Validation loss through the pipeline (FP32 boundaries, no buffer)."""
        d, m = self.cfg.workers, self.cfg.microbatches
        size = d * m * self.micro
        loader = Loader(self.valid_data, size, seed=0, num_shards=d, shuffle=False)
        count = min(self.cfg.eval_batches, loader.batches_per_epoch)
        state = self._zeros_state()
        total = 0.0
        for _ in range(count):
            out = self._eval_step(self.params, self._micro(loader.next()), state)
            total += float(to_host(out)["loss"])
        return {"loss": total / max(count, 1)}

    def _state_tree(self) -> dict[str, Any]:
        # The embedding's and head's optimizer states live on their owner stage's devices
        # only ([D, 1, ...] on a sub-mesh); saved as [D, S, ...] over the whole mesh, zeros
        # off the owner stage, so every process writes its part of global arrays.
        tree = super()._state_tree()
        opt = dict(tree["opt_state"])
        for name in OWNED:
            opt[name] = self._spread(opt[name], name)
        return {**tree, "opt_state": opt}

    def _set_state(self, params: Any, opt_state: Any) -> None:
        opt = dict(opt_state)
        for name in OWNED:
            opt[name] = self._owned_view(opt[name], name)
        super()._set_state(params, opt)

    def _spread(self, tree: Any, name: str) -> Any:
        """``[D, 1, ...]`` arrays of ``name``'s sub-mesh as ``[D, S, ...]`` arrays of the
        whole mesh: the owner stage's shards as they are, zeros on the other stages."""
        owner = self._owner(name)
        if self.abstract:
            return jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(
                    (a.shape[0], self.stages, *a.shape[2:]), a.dtype, sharding=self.sharded
                ),
                tree,
            )

        def one(a):
            held = {sh.device: sh.data for sh in a.addressable_shards}
            parts = []
            for d, st in self._local_cells:
                dev = self.mesh.devices[d, st]
                if st == owner:
                    parts.append(held[dev])
                else:
                    parts.append(jax.device_put(np.zeros((1, 1, *a.shape[2:]), a.dtype), dev))
            shape = (a.shape[0], self.stages, *a.shape[2:])
            return jax.make_array_from_single_device_arrays(
                shape, self.sharded, parts, dtype=a.dtype
            )

        return jax.tree_util.tree_map(one, tree)

    def fingerprint(self) -> dict[str, Any]:
        """Checkpoint identity: the data-parallel one plus the pipeline layout."""
        fp = super().fingerprint()
        fp.update(
            stages=self.stages,
            microbatches=self.cfg.microbatches,
            boundary=self.cfg.boundary,
            fw_bits=self.cfg.fw_bits,
            bw_bits=self.cfg.bw_bits,
            # Optimizer state per group: blocks on every stage, embed and head on their own.
            state_layout="blocks+embed+head, saved [D, S] (owner stage)",
        )
        return fp

    def save(self, manager) -> None:
        """Checkpoint the training state and snapshot every message buffer with it."""
        for buf in self.buffers:
            buf.flush()
        # The snapshots go first: the Orbax commit that follows is what makes the step a
        # checkpoint, so a crash in between leaves the previous checkpoint the newest
        # (and a snapshot without a checkpoint, removed by the next save).
        root = self._snapshot_root(self.step)
        for b, buf in enumerate(self.buffers):
            buf.save(root / f"boundary{b}", overwrite=True)
        super().save(manager)
        if not self.buffers:
            return
        # Keep the snapshots of the checkpoints Orbax keeps, and only those.
        if is_primary():
            kept = {str(step) for step in manager.all_steps()}
            for old in (self.cfg.run_dir / "buffers").iterdir():
                if old.name not in kept:
                    shutil.rmtree(old, ignore_errors=True)

    def _snapshot_root(self, step: int) -> Path:
        """Where the message buffers of checkpoint ``step`` are saved (this process's)."""
        root = self.cfg.run_dir / "buffers" / str(step)
        return root / f"process{jax.process_index()}" if jax.process_count() > 1 else root

    def restore(self, manager) -> bool:
        """Restore the newest checkpoint and the buffer snapshots saved with it."""
        if not super().restore(manager):
            return False
        root = self._snapshot_root(self.step)
        restored = []
        for b in range(len(self.buffers)):
            snapshot = root / f"boundary{b}"
            if not snapshot.is_dir():
                step_dir = self.cfg.run_dir / "buffers" / str(self.step)
                saved = sorted(p.name for p in step_dir.glob("process*"))
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
                    f"checkpoint step {self.step} has no message-buffer snapshot {snapshot}{hint}"
                )
        # The open buffers are closed only once every snapshot is known to exist.
        for b, old in enumerate(self.buffers):
            old.close()
            restored.append(
                jaxcomm.MessageBuffer.restore(root / f"boundary{b}", self._buffer_path(b))
            )
        self.buffers = restored
        self._stale = []
        self._next = None
        return True

    def num_params(self) -> int:
        """Parameters of the model: every stage's blocks, one embedding and one head."""

        def count(tree, lead):
            return sum(math.prod(a.shape[lead:]) for a in jax.tree_util.tree_leaves(tree))

        p = self.params
        return count(p["blocks"], 1) + count(p["embed"], 2) + count(p["head"], 2)

    def worker_params(self, worker: int = 0) -> Any:
        """Stage-stacked parameters of one data replica as host numpy arrays."""
        return jax.tree_util.tree_map(lambda a: a[worker], to_host(self.params))

    def model_params(self) -> Any:
        """Data replica 0's parameters (the replicas' mean with local SGD) in the GPT's own
        layout (stages joined)."""
        params = jax.tree_util.tree_map(lambda a: a[0], to_host(self._eval_params()))
        return unstage_params(params, self.gpt_cfg)

    def _make_tx(self) -> None:
        """None: the pipeline builds one transform per parameter group (``group_tx``) once
        its groups' shapes are known (:meth:`_init_state`)."""
        return None

    def rebuild_step(self) -> None:
        """Build the groups' transforms and the steps again (e.g. a restored schedule);
        the state's structure is unchanged."""
        shapes = {
            name: jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), self.params[name]
            )
            for name in ("embed", "blocks", "head")
        }
        self.group_tx = self.sync.group_txs(self, shapes, self.stages)
        self._train_step = self._build_step()
        self._owned_step = {name: self._build_owned_step(name) for name in OWNED}
        self._compiled.clear()
        self._owned_compiled.clear()
        self._ticks.clear()
        self._busy.clear()
        self._modelled.clear()
