"""The pipeline layout: GPT over a ``data x stage`` mesh with boundary codecs.

Every parameter leaf has two leading axes ``[D, S, ...]``: stage ``s`` holds its blocks, and
the layout keeps a slot for the embedding and head on every stage, although only stage 0's
embedding and the last stage's head are used, updated and averaged (the other slots keep
their initial values and cost memory, never bytes). Each step:

1. the jitted step runs the GPipe pipeline (:func:`jaxcomm.pipeline.gpipe`) with the configured
   boundary codec, then the blocks' transform (the synchronisation's: an aggregator and the
   optimizer, or a local SGD wrapper) runs on each stage's block gradients over ``data``;
2. two small programs on the stage-0 and last-stage devices only (``data``-axis sub-meshes
   whose arrays share the step's buffers, no copy) run the embedding's and the head's
   transforms, so no other stage sends their bytes; the optimizer state is
   ``{"blocks", "embed", "head"}`` accordingly;
3. while they run, the next step's batch and the previous messages of its samples are read
   (:class:`train.pipeline_feed.Feed`) and copied to the devices;
4. the step's new messages are written back (asynchronously).

There are two compiled steps: while any sample of a step is on its first visit, AQ-SGD
sends float32 (and resets the buffer rows); once all were seen, it sends deltas. The host
knows which from the buffers' ``seen`` flags, so the payloads are exactly the wire. A
controller (the adaptive ratio) multiplies these by its programs: the key of a step's
programs is ``(seen, controller key)``.

Aggregators that scale by statistics of the whole gradient (EC-quantized buckets, SSDM's and
EF-signSGD's norms) compute them per group here: the blocks of a stage, the embedding, the
head. Each group's aggregator state draws its own random keys (folded with the stage and the
group), so no two groups share rounding noise.

Separate programs, rather than the averaging inside a ``lax.cond`` on the stage index: XLA's
CPU runtime requires every device of a program to join every collective, so a collective
that only some stages run deadlocks there.

Communication is each device's logged traffic: the pipeline's point-to-point messages (one
round per tick that carries any) plus the data axis's collectives. With a ``compute``
device the simulated step follows GPipe's timeline (:mod:`train.pipeline_clock`); with
``compute: measured`` the measured step and the communication are added (or overlapped).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.network import find_logs

from .config import Config
from .data import Loader
from .distributed import to_host
from .layout import Flight, Layout
from .models import GPTConfig
from .pipeline import stage_params, unstage_params
from .pipeline_clock import GPipeClock
from .pipeline_feed import Feed, Prepared, as_global
from .pipeline_programs import OWNED, STAGE, OwnedGroups, build_eval, build_step
from .programs import AXIS, checked, host_finite, ready_at, state_report, structs

if TYPE_CHECKING:
    from .context import Context

__all__ = ["Pipeline", "make_boundary"]

GROUPS = ("embed", "blocks", "head")


def make_boundary(cfg: Config) -> jaxcomm.pipeline.Boundary:
    """The boundary of ``cfg.boundary`` with its codecs."""
    return cfg.boundary.build()


class Pipeline(Layout):
    """``D`` data replicas of an ``S``-stage GPipe pipeline (see the module docstring)."""

    def __init__(self, cfg: Config, *, abstract: bool = False):
        super().__init__(cfg, abstract=abstract)
        n, s = cfg.workers, cfg.stages
        if n * s > jax.device_count():
            raise ValueError(
                f"workers * stages = {n * s} devices needed, JAX sees {jax.device_count()}"
            )
        self.n, self.stages = n, s
        # Stage-major: device (replica d, stage s) is device s * n + d, so that the devices
        # of a process hold whole stages (every replica of them) where the counts allow.
        # A sample's AQ-SGD messages then stay on the processes that sent them whichever
        # replica trains it in a later epoch, and each stage's data-axis averaging stays
        # inside a host; what crosses hosts is the pipeline's (compressed) messages.
        grid = np.array(jax.devices()[: n * s], dtype=object).reshape(s, n).T
        axis_types = (jax.sharding.AxisType.Explicit,) * 2
        self.mesh = jax.sharding.Mesh(grid, (AXIS, STAGE), axis_types=axis_types)
        me = jax.process_index()
        # (replica, stage) of every device this process owns, in mesh order.
        self.local_cells = [
            (d, st)
            for d in range(n)
            for st in range(s)
            if self.mesh.devices[d, st].process_index == me
        ]
        self.local_replicas = sorted({d for d, _ in self.local_cells})
        self.sharded = NamedSharding(self.mesh, P(AXIS, STAGE))
        self.by_data = NamedSharding(self.mesh, P(AXIS))
        self.replicated = NamedSharding(self.mesh, P())
        self.owned = OwnedGroups(self)
        self.micro = cfg.global_batch // (cfg.workers * cfg.microbatches)
        self.boundary = make_boundary(cfg)
        self.clock = GPipeClock(self)
        self.io: dict[str, float] = {}
        self._next: Prepared | None = None
        self._last: tuple[np.ndarray, Any] | None = None
        self._last_seen = False
        self._variants: dict[Any, tuple] = {}

    # ------------------------------------------------------------------ state

    def _check_codec_sizes(self) -> None:
        """Refuse a boundary codec's chunk or rank that one sample ``[seq_len, width]``
        cannot hold (a typo would otherwise pad every row to a huge chunk, or fail while
        tracing with a message that does not name the key)."""
        t, w = self.gpt_cfg.seq_len, self.gpt_cfg.width
        for side in ("forward", "backward", "first"):
            codec = getattr(self.cfg.boundary, side, None)
            for key, most in (("chunk", t * w), ("rank", min(t, w))):
                value = getattr(codec, key, None)
                if value is not None and value > most:
                    raise ValueError(
                        f"boundary.{side}.{key}={value} is larger than one sample of {t} x "
                        f"{w} activations allows (at most {most})"
                    )

    def init_state(self, ctx: Context) -> tuple[Any, Any]:
        cfg = self.cfg
        self.gpt_cfg: GPTConfig = ctx.task.module.cfg
        self._check_codec_sizes()
        params = ctx.initial_params()
        if self.abstract:
            staged = jax.eval_shape(lambda p: stage_params(p, self.gpt_cfg, self.stages), params)
            stacked = structs(staged, self.sharded, lead=(cfg.workers,))
        else:
            staged = stage_params(params, self.gpt_cfg, self.stages)
            stacked = jax.tree_util.tree_map(
                lambda a: as_global(
                    np.broadcast_to(np.asarray(a)[None], (cfg.workers, *a.shape)), self.sharded
                ),
                staged,
            )
        # One device's shapes of each parameter group, for the groups' transforms.
        self.units = {
            name: jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), staged[name]
            )
            for name in GROUPS
        }
        self._ckey = self.control_key(ctx)
        group_tx = self._group_txs(ctx, self._ckey)
        opt_state = self.owned.init_state(stacked, group_tx)
        self.feed = Feed(self, ctx)
        return stacked, opt_state

    def _group_txs(self, ctx: Context, ckey: Any) -> dict[str, optax.GradientTransformation]:
        """One transform per parameter group: the synchronisation's (the same for every
        group when the replicas aggregate every step; each group on its own schedule with
        local SGD), or the controller's program ``ckey`` for every group."""
        if ctx.control is None:
            return ctx.sync.group_txs(ctx, self.units, self.stages)
        tx = ctx.control.make_tx(ctx, ckey)
        return {name: tx for name in GROUPS}

    def build(self, ctx: Context) -> None:
        self._ckey = self.control_key(ctx)
        self._variants.clear()
        self._set_variant(self._variant(ctx, self._ckey))
        self._eval_step = build_eval(self)
        self.clock.clear()
        self._modelled.clear()

    _FIELDS = ("group_tx", "_step", "_owned_step", "_compiled", "_owned_compiled")

    def _variant(self, ctx: Context, ckey: Any) -> tuple:
        group_tx = self._group_txs(ctx, ckey)
        owned = {name: self.owned.build_step(group_tx[name], name) for name in OWNED}
        return group_tx, build_step(self, group_tx["blocks"]), owned, {}, {}

    def _set_variant(self, values: tuple) -> None:
        for f, v in zip(self._FIELDS, values, strict=True):
            setattr(self, f, v)

    def _use(self, ctx: Context, ckey: Any) -> None:
        """Make the programs of the controller's key ``ckey`` current: the groups'
        transforms, the steps and their compiled programs (built on first use)."""
        if ckey == self._ckey:
            return
        self._variants[self._ckey] = tuple(getattr(self, f) for f in self._FIELDS)
        values = self._variants[ckey] if ckey in self._variants else self._variant(ctx, ckey)
        self._set_variant(values)
        self._ckey = ckey

    # ------------------------------------------------------------------ steps

    def compile(self, ctx: Context) -> None:
        self.feed.check_stale()
        self._next = self.feed.prepare(ctx.loader.position)

    def _program(self, ctx: Context, prep: Prepared) -> Any:
        """The compiled step for ``prep``'s boundary mode (compiled on first use)."""
        if prep.seen not in self._compiled:
            lowered = self._step[prep.seen].lower(
                ctx.params["blocks"],
                {name: ctx.params[name] for name in OWNED},
                ctx.opt_state["blocks"],
                prep.batch,
                prep.state,
                jax.random.key(0),
            )
            self._compiled[prep.seen] = checked(lowered.compile(), "the pipeline step")
        for name in OWNED:  # gradients have the parameters' shapes and shardings
            if name not in self._owned_compiled:
                view = self.owned.view(ctx.params[name], name)
                lowered = self._owned_step[name].lower(view, ctx.opt_state[name], view)
                self._owned_compiled[name] = checked(lowered.compile(), f"the {name} update")
        return self._compiled[prep.seen]

    def _apply_owned(self, owned: Any, grads: Any, opt_state: Any) -> tuple[dict, dict, list]:
        """Run the embedding's and head's programs on their stages: ``(params, opt_state,
        finite flags)`` of those groups."""
        params, new_state, finites = {}, {}, []
        for name in OWNED:
            args = (
                self.owned.view(owned[name], name),
                opt_state[name],
                self.owned.view(grads[name], name),
            )
            new_p, new_state[name], ok = self._owned_compiled[name](*args)
            params[name] = self.owned.merged(owned[name], new_p)
            finites.append(ok)
        return params, new_state, finites

    def launch(self, ctx: Context, step: int, lagging: bool) -> Flight:
        """Run step ``step`` synchronously: the step already overlaps the next step's host
        work (batch, buffer reads) with its own devices, and its new messages are written
        to the host buffer after it."""
        cur = self._next
        self.io = {"buffer_exposed_s": 0.0, "buffer_prefetch_s": 0.0}
        if cur is None or cur.position != ctx.loader.position:
            cur = self.feed.prepare(ctx.loader.position)
            self.io["buffer_exposed_s"] = cur.seconds
        self._use(ctx, self.control_key(ctx))
        program = self._program(ctx, cur)
        self._last_seen = cur.seen
        key = jax.random.fold_in(jax.random.key(self.cfg.seed), cur.position)
        t0 = time.perf_counter()
        owned = {name: ctx.params[name] for name in OWNED}
        blocks, opt_blocks, owned_grads, metrics, finite, new_state, log = program(
            ctx.params["blocks"], owned, ctx.opt_state["blocks"], cur.batch, cur.state, key
        )
        # Stamp the moment the devices finish from a waiting thread, so that neither the
        # step time nor the exposed buffer time depends on how long the prefetch took.
        main_done = ctx.waiter().submit(ready_at, (blocks, opt_blocks, owned_grads, new_state))
        # Step t + 1's batch, buffer reads and host-to-device copies go out while step t
        # runs, unless they would read rows step t is about to write (an epoch boundary):
        # then they are prepared after its writes, and the time is exposed. This comes
        # before the embedding's and head's programs, whose dispatch can wait for the step
        # (their collectives need its devices).
        self._next = None
        nxt = cur.position + 1
        buffers = self.feed.buffers
        if step < self.cfg.steps and not (
            buffers and np.intersect1d(ctx.loader.batch_ids(nxt), cur.ids).size
        ):
            self._next = self.feed.prepare(nxt)
        prefetch_end = time.perf_counter()
        params, opt_state, finites = self._apply_owned(owned, owned_grads, ctx.opt_state)
        params["blocks"], opt_state["blocks"] = blocks, opt_blocks
        finites.append(finite)
        done = ctx.waiter().submit(ready_at, (params, opt_state, finites))
        main_end, device_end = main_done.result(), done.result()
        # Device time: the step program, then the embedding's and head's programs, which
        # start once both it and the prefetch (dispatched before them) are done.
        compute_s = (main_end - t0) + (device_end - max(main_end, prefetch_end))
        if self._next is not None:
            self.io["buffer_prefetch_s"] = self._next.seconds
            # Host work past the step program's end is on the critical path.
            self.io["buffer_exposed_s"] += max(0.0, prefetch_end - main_end)
        ctx.loader.position = nxt
        self._last = (cur.ids, new_state)
        ctx.params, ctx.opt_state = params, opt_state
        report = {
            **state_report(opt_state),
            **ctx.parts_report(params, opt_state),
            "logs": self.state_logs(ctx, opt_state),
        }
        ok = host_finite(*to_host(finites))
        return Flight(step, metrics, ok, report, [log], t0, compute_s)

    def trial_step(self, ctx: Context, key: Any, params: Any, opt_state: Any) -> tuple:
        """The buffered messages of the trial's batch are read, never written."""
        prev = self._ckey
        self._use(ctx, key)
        try:
            prep = self.feed.prepare(ctx.loader.position)
            ctx.loader.position += 1
            program = self._program(ctx, prep)
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
            ok = host_finite(*to_host([finite, *finites]))
            logs = [*self.state_logs(ctx, new_s), log]
            return new_p, new_s, ok, logs, measured, (prep.seen, key)
        finally:
            self._use(ctx, prev)

    def after_step(self, ctx: Context) -> None:
        """Write the step's new messages back (asynchronously; a later read of the same
        ids waits for these writes)."""
        if self._last is not None and self.feed.buffers:
            self.io["buffer_writeback_s"] = self.feed.write_back(*self._last)

    def state_logs(self, ctx: Context, opt_state: Any) -> list[Any]:
        """The aggregator logs in ``opt_state``, each as ``[D, S, ...]`` per device."""
        logs = find_logs(opt_state["blocks"])
        for name in OWNED:
            logs += [self.owned.place(log, name) for log in find_logs(opt_state[name])]
        return logs

    # ------------------------------------------------------------------ programs and time

    def control_key(self, ctx: Context) -> Any:
        """The controller's choice of program (None without a controller)."""
        return None if ctx.control is None else ctx.control.program_key(ctx)

    def program_key(self, ctx: Context) -> Any:
        """The boundary mode of the last step (one compiled step per mode), with the
        controller's key when there is one: ``(seen, key)``."""
        return self._last_seen if ctx.control is None else (self._last_seen, self._ckey)

    def split_key(self, key: Any) -> tuple[bool, Any]:
        """``(seen, controller key)`` of a program key (``seen`` alone: the current one)."""
        return tuple(key) if isinstance(key, tuple) else (bool(key), self._ckey)

    def step_programs(self, ctx: Context, key: Any) -> list[tuple[Any, np.ndarray]]:
        """The pipeline step of boundary mode ``key`` (default ``False``; every device: its
        ticks run in lockstep, so each stage's program spans the GPipe schedule, bubbles
        included) and the embedding's and head's programs with the devices of their
        stages. ``key`` may also be ``(seen, controller key)``."""
        seen, ckey = self.split_key(False if key is None else key)
        prev = self._ckey
        self._use(ctx, ckey)
        try:
            if seen not in self._compiled:
                if not self.abstract:
                    raise ValueError(
                        f"no step with boundary mode seen={seen} has been compiled yet"
                    )
                self._program(ctx, self.feed.prepare_abstract(seen))
            out = [(self._compiled[seen], np.arange(self.cfg.workers * self.stages))]
            for name in OWNED:
                index = np.arange(self.cfg.workers) * self.stages + self.owned.owner(name)
                out.append((self._owned_compiled[name], index))
        finally:
            self._use(ctx, prev)
        return out

    def simulate_step(
        self, ctx, key, traffic, network, step, *, measured_s, overlap, branches, stream
    ):
        """GPipe's timeline (:class:`~train.pipeline_clock.GPipeClock`) with a ``compute``
        device; with ``compute: measured`` the host's step time has no per-tick breakdown,
        so the step is costed as every device's compute, then the logged traffic."""
        if ctx.compute_model is None:
            kw = {"measured_s": measured_s, "branches": branches, "stream": stream}
            return self.synchronous_seconds(ctx, key, traffic, network, step, overlap=overlap, **kw)
        return self.clock.step_seconds(
            ctx, key, traffic, network, step, overlap=overlap, branches=branches, stream=stream
        )

    # ------------------------------------------------------------------ parts' hooks

    def fingerprint(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "stages": self.stages,
            "microbatches": cfg.microbatches,
            "boundary": cfg.boundary.to_dict(),
            # Optimizer state per group: blocks on every stage, embed and head on their own.
            "state_layout": "blocks+embed+head, saved [D, S] (owner stage)",
        }

    def step_extras(self, ctx: Context, report: dict[str, Any]) -> dict[str, float]:
        """Message-buffer host time, in seconds: ``buffer_prefetch_s`` preparing the next
        step (reads waited on, host arrays built, copies issued) while this one ran,
        ``buffer_exposed_s`` the part of the buffer work the devices waited for (a prefetch
        that outlasted the step, or a step prepared after the previous one ended), and
        ``buffer_writeback_s`` copying the new messages to the host and issuing the
        writes."""
        return dict(self.io)

    def summary_extras(self) -> dict[str, Any]:
        return self.feed.summary()

    # ------------------------------------------------------------------ model and files

    def evaluate(self, ctx: Context, data: Any) -> dict[str, float]:
        """Validation loss through the pipeline (FP32 boundaries, no buffer)."""
        d, m = self.cfg.workers, self.cfg.microbatches
        loader = Loader(data, d * m * self.micro, seed=0, num_shards=d, shuffle=False)
        count = min(self.cfg.eval_batches, loader.batches_per_epoch)
        state, params = self.feed.zeros_state(), ctx.eval_params()
        total = 0.0
        for _ in range(count):
            out = self._eval_step(params, self.feed.micro(loader.next()), state)
            total += float(to_host(out)["loss"])
        return {"loss": total / max(count, 1)}

    def state_tree(self, ctx: Context) -> dict[str, Any]:
        # The embedding's and head's optimizer states live on their owner stage's devices
        # only ([D, 1, ...] on a sub-mesh); saved as [D, S, ...] over the whole mesh, zeros
        # off the owner stage, so every process writes its part of global arrays.
        opt = dict(ctx.opt_state)
        for name in OWNED:
            opt[name] = self.owned.spread(opt[name], name)
        return {"params": ctx.params, "opt_state": opt}

    def set_state(self, ctx: Context, params: Any, opt_state: Any) -> None:
        opt = dict(opt_state)
        for name in OWNED:
            opt[name] = self.owned.view(opt[name], name)
        ctx.params, ctx.opt_state = params, opt

    def before_save(self, ctx: Context, store: Any) -> None:
        self.feed.save(ctx.step)

    def after_save(self, ctx: Context, store: Any) -> None:
        self.feed.prune(store.all_steps())

    def after_restore(self, ctx: Context) -> None:
        self.feed.restore(ctx.step)
        self._next = None

    def num_params(self, ctx: Context) -> int:
        """Every stage's blocks, one embedding and one head."""

        def count(tree, lead):
            return sum(math.prod(a.shape[lead:]) for a in jax.tree_util.tree_leaves(tree))

        p = ctx.params
        return count(p["blocks"], 1) + count(p["embed"], 2) + count(p["head"], 2)

    def model_params(self, ctx: Context, params: Any) -> Any:
        """Replica 0's parameters in the GPT's own layout (stages joined)."""
        return unstage_params(jax.tree_util.tree_map(lambda a: a[0], params), self.gpt_cfg)

    def synced_bytes(self, ctx: Context) -> int:
        """A stage's blocks with the embedding (stage 0) or the head (the last)."""

        def count(name):
            return sum(math.prod(a.shape[2:]) for a in jax.tree_util.tree_leaves(ctx.params[name]))

        return 4 * (count("blocks") + max(count("embed"), count("head")))

    def smallest_group(self, ctx: Context) -> int:
        return min(
            sum(math.prod(a.shape[2:]) for a in jax.tree_util.tree_leaves(ctx.params[name]))
            for name in GROUPS
        )
