"""The data-parallel layout: ``shard_map`` over a ``data`` axis, one step program.

State that differs between workers (aggregator state, and under local SGD or DiLoCo the
parameters and inner optimizer state) has a leading worker axis ``[N, ...]`` sharded over
``data``; state every worker holds bit for bit (synchronous parameters and optimizer state,
DiLoCo's anchor and outer state) is one copy (``P()``). Which is which is read from the
types ``shard_map`` gives the values (``check_vma``): a value is held once where it comes
from replicated inputs, XLA's all-reduce, or jaxcomm's collectives whose results every
device holds bit for bit (typed so by :func:`jaxcomm.collectives.replicated`, a cast).
Dense data parallelism, compressed aggregators with per-worker residuals and local SGD all
use the same step: each worker's gradient of its shard of the batch, then the per-worker
transform (an aggregator and the optimizer, or a sync wrapper around the optimizer).

The host need not wait between steps (``async_steps``): step ``t + 1`` is dispatched
before step ``t``'s outputs are read, the next batch is loaded and copied to the devices
while a step runs, and the step's report (traffic logs, a top-k aggregator's gain and root)
is an output of the program, so the next step's donation of the state leaves it intact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.network import find_logs

from .config import Config
from .data import Loader, shard
from .distributed import to_host
from .layout import Flight, Layout
from .programs import (
    AXIS,
    all_finite,
    checked,
    expand,
    host_finite,
    ready_at,
    row_specs,
    squeeze,
    state_report,
    structs,
    varying_rows,
)

if TYPE_CHECKING:
    from .context import Context

__all__ = ["DataParallel"]


class DataParallel(Layout):
    """``N`` workers on a one-axis mesh ``data``; the step is one jitted ``shard_map``."""

    lags = True

    def __init__(self, cfg: Config, *, abstract: bool = False):
        super().__init__(cfg, abstract=abstract)
        if cfg.workers > jax.device_count():
            raise ValueError(
                f"workers={cfg.workers} needs that many devices, but JAX sees "
                f"{jax.device_count()}; on CPU set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={cfg.workers} before JAX starts"
            )
        self.n = cfg.workers
        self.mesh = jax.make_mesh((self.n,), (AXIS,), devices=jax.devices()[: self.n])
        me = jax.process_index()
        # Mesh rows (workers) whose device this process owns, and those devices.
        self.local_rows = [i for i, d in enumerate(self.mesh.devices.flat) if d.process_index == me]
        self._local_devices = [self.mesh.devices.flat[i] for i in self.local_rows]
        self.sharded = NamedSharding(self.mesh, P(AXIS))
        self.replicated = NamedSharding(self.mesh, P())
        self._programs: dict[Any, Any] = {}
        self._prefetched: tuple[int, Any] | None = None

    # ------------------------------------------------------------------ state and steps

    def init_state(self, ctx: Context) -> tuple[Any, Any]:
        params = ctx.initial_params()
        tx = ctx.make_tx()
        self.rows = self._worker_rows(ctx, tx, params)
        rows_p, rows_s = self.rows
        init = jax.jit(
            jax.shard_map(
                lambda p: expand(tx.init(squeeze(p, rows_p)), rows_s),
                mesh=self.mesh,
                in_specs=(row_specs(rows_p),),
                out_specs=row_specs(rows_s),
            )
        )
        if self.abstract:
            placed = self._structs(params, rows_p)
            return placed, self._structs(jax.eval_shape(init, placed), rows_s, axis="keep")

        def spread(a: Any, row: bool) -> jax.Array:
            # Built from each process's own devices' slices (the init is the same on
            # every process), so it also works when the mesh spans several processes.
            full = np.broadcast_to(np.asarray(a), (self.n, *a.shape)) if row else np.asarray(a)
            sharding = self.sharded if row else self.replicated
            return jax.make_array_from_callback(full.shape, sharding, lambda i: full[i])

        placed = jax.tree_util.tree_map(spread, params, rows_p)
        return placed, init(placed)

    def _structs(self, tree: Any, rows: Any, axis: str = "add") -> Any:
        """``tree`` as shapes placed like the state: the leaves marked in ``rows`` one row
        per worker, the others one copy. ``axis``: whether ``tree``'s leaves lack the worker
        axis (``"add"`` it to the rows), have it on every leaf (``"drop"`` it from the
        others) or are shaped already (``"keep"``)."""

        def struct(a: Any, row: bool) -> jax.ShapeDtypeStruct:
            shape = tuple(a.shape)
            if axis == "add" and row:
                shape = (self.n, *shape)
            elif axis == "drop" and not row:
                shape = shape[1:]
            sharding = self.sharded if row else self.replicated
            return jax.ShapeDtypeStruct(shape, a.dtype, sharding=sharding)

        return jax.tree_util.tree_map(struct, tree, rows)

    def _worker_rows(self, ctx: Context, tx: optax.GradientTransformation, params: Any) -> tuple:
        """``(params rows, optimizer state rows)``: trees of bools, True for the leaves that
        differ between workers (one row per worker), False for those every worker holds bit
        for bit (one copy, ``P()``). Read from the types ``shard_map`` gives the values of
        the init and of one step (``check_vma``): a leaf is a row when either makes it
        varying with the rows found so far, repeated until nothing changes."""
        task = ctx.task
        sample = shard(ctx.train_data.get(ctx.loader.batch_ids(0)), self.n)
        batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.sharded)
                 for k, v in sample.items()}  # fmt: skip
        rows_p = jax.tree_util.tree_map(lambda _: False, params)
        rows_s = None
        found: dict[str, Any] = {}
        for _ in range(8):

            def init(p, rows_p=rows_p):
                s = tx.init(squeeze(p, rows_p))
                found["init"] = varying_rows(s)
                return expand(s)

            shapes = jax.eval_shape(
                jax.shard_map(init, mesh=self.mesh, in_specs=(row_specs(rows_p),),
                              out_specs=P(AXIS)),
                self._structs(params, rows_p),
            )  # fmt: skip
            rows_s = found["init"] if rows_s is None else _either(rows_s, found["init"])

            def step(p, s, b, rows_p=rows_p, rows_s=rows_s):
                p, s = squeeze(p, rows_p), squeeze(s, rows_s)
                p, s = self._update(task, tx, p, s, squeeze(b))[:2]
                found["step"] = (varying_rows(p), varying_rows(s))
                return expand(p), expand(s)

            jax.eval_shape(
                jax.shard_map(step, mesh=self.mesh,
                              in_specs=(row_specs(rows_p), row_specs(rows_s), P(AXIS)),
                              out_specs=(P(AXIS), P(AXIS))),
                self._structs(params, rows_p), self._structs(shapes, rows_s, axis="drop"), batch,
            )  # fmt: skip
            new_p = _either(rows_p, found["step"][0])
            new_s = _either(rows_s, found["step"][1])
            leaves = jax.tree_util.tree_leaves
            if leaves((new_p, new_s)) == leaves((rows_p, rows_s)):
                return rows_p, rows_s
            rows_p, rows_s = new_p, new_s
        raise RuntimeError("the per-worker state did not settle")  # unreachable: rows only grow

    def build(self, ctx: Context) -> None:
        self._step = self._build_step(ctx, ctx.make_tx())
        self._eval_step = self._build_eval(ctx)
        self._programs.clear()
        self._modelled.clear()

    @staticmethod
    def _update(task: Any, tx: optax.GradientTransformation, p: Any, s: Any, b: Any) -> tuple:
        """One worker's step: its gradient of its batch ``b`` (at ``p`` typed as its own, so
        that nothing sums the gradients behind the transform), then ``tx``. Returns
        ``(params, opt_state, loss, metrics, grads)``."""
        mine = jaxcomm.varying(p, AXIS)
        (loss, metrics), grads = jax.value_and_grad(task.loss, has_aux=True)(mine, b)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss, metrics, grads

    def _build_step(self, ctx: Context, tx: optax.GradientTransformation) -> Callable:
        """The jitted step of the per-worker transform ``tx``."""
        task = ctx.task
        rows_p, rows_s = self.rows

        def per_worker(params, opt_state, batch):
            # params, opt_state: this worker's rows ([1, ...]) and the shared leaves;
            # batch: [1, B / N, ...]
            p, s = squeeze(params, rows_p), squeeze(opt_state, rows_s)
            p, s, loss, metrics, grads = self._update(task, tx, p, s, squeeze(batch))
            ok = all_finite((loss, grads, p)).astype(jnp.int32)
            # Each worker's metrics and finite flag go to the host, which averages them
            # (`host_metrics`): a collective for them would cost every step 2 (N - 1)
            # latencies on the ring for a few bytes. The report is a separate output, so
            # that the host can read it after the next step has taken (donated) the state.
            report = expand(state_report(s))
            return expand(p, rows_p), expand(s, rows_s), expand(metrics), expand(ok), report

        step = jax.shard_map(
            per_worker,
            mesh=self.mesh,
            in_specs=(row_specs(rows_p), row_specs(rows_s), P(AXIS)),
            out_specs=(row_specs(rows_p), row_specs(rows_s), P(AXIS), P(AXIS), P(AXIS)),
        )
        return jax.jit(step, donate_argnums=(0, 1))

    def _build_eval(self, ctx: Context) -> Callable:
        task = ctx.task
        rows_p = self.rows[0]

        def per_worker(params, batch):
            _, metrics = task.loss(squeeze(params, rows_p), squeeze(batch))
            return jax.lax.pmean(metrics, AXIS)

        f = jax.shard_map(
            per_worker, mesh=self.mesh, in_specs=(row_specs(rows_p), P(AXIS)), out_specs=P()
        )
        return jax.jit(f)

    def compiled_step(self, ctx: Context, key: Any = None) -> Any:
        """The train step of program ``key`` (None: the parts' own; a controller's key:
        its transform's) compiled ahead of time for the loader's batch shapes, audited
        (:func:`~train.programs.checked`); compiled on first use."""
        if key not in self._programs:
            batch = self.put_batch(ctx.train_data.get(ctx.loader.batch_ids(0)))
            if self.abstract:
                batch = structs(batch, self.sharded)
            step = self._step
            if key is not None and ctx.control is not None:
                step = self._build_step(ctx, ctx.control.make_tx(ctx, key))
            lowered = step.lower(ctx.params, ctx.opt_state, batch)
            self._programs[key] = checked(lowered.compile())
        return self._programs[key]

    def compile(self, ctx: Context) -> None:
        self.compiled_step(ctx, self.program_key(ctx))
        self._prefetched = None

    def launch(self, ctx: Context, step: int, lagging: bool) -> Flight:
        program = self.compiled_step(ctx, self.program_key(ctx))
        batch = self._next_batch(ctx)
        t0 = time.perf_counter()
        params, opt_state, metrics, finite, report = program(ctx.params, ctx.opt_state, batch)
        ctx.params, ctx.opt_state = params, opt_state
        report = {**report, **ctx.parts_report(params, opt_state)}
        if not lagging:
            jax.block_until_ready((params, opt_state))
            return Flight(step, metrics, finite, report, [], t0, time.perf_counter() - t0)
        # A thread stamps when the step's outputs are ready, whatever the host loop is
        # doing then (compute_s must not count the host's own work).
        ready = ctx.waiter().submit(ready_at, (metrics, finite))
        if step < ctx.cfg.steps:
            self._prefetch(ctx)  # host work while the devices run the step
        return Flight(step, metrics, finite, report, [], t0, None, ready)

    def trial_step(self, ctx: Context, key: Any, params: Any, opt_state: Any) -> tuple:
        program = self.compiled_step(ctx, key)
        batch = self.put_batch(ctx.loader.next())
        t0 = time.perf_counter()
        p, s, _, finite, _ = program(params, opt_state, batch)
        jax.block_until_ready((p, s))
        measured = time.perf_counter() - t0
        return p, s, host_finite(to_host(finite)), find_logs(s), measured, key

    def state_logs(self, ctx: Context, opt_state: Any) -> list[Any]:
        return find_logs(opt_state)

    # ------------------------------------------------------------------ batches

    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A global batch ``[B, ...]`` as ``[N, B / N, ...]`` arrays sharded over workers;
        each process copies only its own workers' rows to its devices."""
        if jax.process_count() == 1:
            return {k: jax.device_put(v, self.sharded) for k, v in shard(batch, self.n).items()}
        rows = self.local_rows
        return self._put_local({k: v[rows] for k, v in shard(batch, self.n).items()})

    def _put_local(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows ``[local workers, B / N, ...]`` (in mesh order) as global
        ``[N, B / N, ...]`` arrays."""
        out = {}
        for k, v in local.items():
            parts = [jax.device_put(v[j : j + 1], d) for j, d in enumerate(self._local_devices)]
            shape = (self.n, *v.shape[1:])
            out[k] = jax.make_array_from_single_device_arrays(shape, self.sharded, parts)
        return out

    def batch_at(self, ctx: Context, position: int) -> dict[str, jax.Array]:
        """The device batch of loader position ``position``; each process loads only its
        own workers' samples."""
        ids = ctx.loader.batch_ids(position)
        if jax.process_count() == 1:
            return self.put_batch(ctx.train_data.get(ids))
        rows = shard({"ids": ids}, self.n)["ids"][self.local_rows]
        local = ctx.train_data.get(rows.reshape(-1))
        return self._put_local({k: v.reshape(*rows.shape, *v.shape[1:]) for k, v in local.items()})

    def _next_batch(self, ctx: Context) -> dict[str, jax.Array]:
        """The device batch at the loader's position (the prefetched one when it is that
        position's), advancing the loader."""
        pos = ctx.loader.position
        fetched, self._prefetched = self._prefetched, None
        batch = fetched[1] if fetched is not None and fetched[0] == pos else self.batch_at(ctx, pos)
        ctx.loader.position = pos + 1
        return batch

    def _prefetch(self, ctx: Context) -> None:
        """Load the next batch and start its copy to the devices (``device_put`` is
        asynchronous), keyed by its loader position."""
        self._prefetched = (ctx.loader.position, self.batch_at(ctx, ctx.loader.position))

    # ------------------------------------------------------------------ programs

    def program_key(self, ctx: Context) -> Any:
        """The controller's choice of program, or None (one program)."""
        return None if ctx.control is None else ctx.control.program_key(ctx)

    def step_programs(self, ctx: Context, key: Any) -> list[tuple[Any, np.ndarray]]:
        """The one data-parallel step of program ``key`` (default: the current one)."""
        key = self.program_key(ctx) if key is None else key
        return [(self.compiled_step(ctx, key), np.arange(self.n))]

    #: The synchronous step: the slowest device's compute, then the collectives.
    simulate_step = Layout.synchronous_seconds

    # ------------------------------------------------------------------ model and files

    def state_tree(self, ctx: Context) -> dict[str, Any]:
        return {"params": ctx.params, "opt_state": ctx.opt_state}

    def set_state(self, ctx: Context, params: Any, opt_state: Any) -> None:
        ctx.params, ctx.opt_state = params, opt_state

    def before_save(self, ctx: Context, store: Any) -> None:
        """Nothing on the host beyond the arrays."""

    def after_save(self, ctx: Context, store: Any) -> None:
        """Nothing to clean up."""

    def after_restore(self, ctx: Context) -> None:
        """Nothing on the host to restore."""

    def evaluate(self, ctx: Context, data: Any) -> dict[str, float]:
        batch_size = min(ctx.cfg.global_batch, len(data) // self.n * self.n)
        loader = Loader(data, batch_size, seed=0, num_shards=self.n, shuffle=False)
        totals: dict[str, float] = {}
        count = min(ctx.cfg.eval_batches, loader.batches_per_epoch)
        params = ctx.eval_params()
        # Every batch dispatched, then one read (a read per batch would wait for each).
        outs = [self._eval_step(params, self.put_batch(loader.next())) for _ in range(count)]
        for m in to_host(outs):
            for k, v in m.items():
                totals[k] = totals.get(k, 0.0) + float(v) / count
        return totals

    def num_params(self, ctx: Context) -> int:
        rows = jax.tree_util.tree_leaves(self.rows[0])
        shapes = [
            a.shape[1:] if r else a.shape
            for a, r in zip(jax.tree_util.tree_leaves(ctx.params), rows, strict=True)
        ]
        return sum(math.prod(s) for s in shapes)

    def model_params(self, ctx: Context, params: Any) -> Any:
        return jax.tree_util.tree_map(lambda a, r: a[0] if r else a, params, self.rows[0])

    def synced_bytes(self, ctx: Context) -> int:
        return 4 * self.num_params(ctx)

    def smallest_group(self, ctx: Context) -> int:
        return self.num_params(ctx)


def _either(a: Any, b: Any) -> Any:
    """Leafwise ``a or b`` of two trees of bools."""
    return jax.tree_util.tree_map(lambda x, y: bool(x or y), a, b)
