"""DiLoCo as a trainer's synchronisation (``sync: {method: diloco, ...}`` in a config).

Each data replica runs the configured optimizer (the inner one) on its own gradients, with
``aggregator: none`` in front of it; :func:`jaxcomm.diloco` forms the pseudo-gradients and
the outer step (Nesterov SGD, ``outer_lr`` 0.7, ``outer_momentum`` 0.9 by default; plain
SGD with ``outer_momentum: 0``). Settings:

* ``fragments`` (``F``), ``pattern``: Streaming DiLoCo's fragments of the model's layers
  (``models.layer_groups``: for the GPT ``embed``, ``block_0``, ..., ``head``), fragment
  ``p`` synchronised at local step ``(p + 1) period // F - 1``. On a pipeline the
  fragments are its parameter groups (``embed``, the stages' ``blocks``, ``head``), each
  with its own wrapper on its own steps (the DiLoCoX shape: pipeline inside a replica,
  DiLoCo across replicas).
* ``overlap`` (``tau``) and ``alpha``: the merge ``tau`` steps after the synchronisation.
* ``warmup_steps`` (``N``): a data-parallel warm start. The first ``N`` steps average
  every step's gradients with a float32 all-reduce (``reduce``, a ring by default) before
  the inner optimizer, as synchronous data parallelism; DiLoCo's periods count from step
  ``N`` and start from the model reached, which is the outer optimizer's anchor
  (``theta_sync``); the outer state and any codec's error feedback start fresh there; the
  inner optimizer (and its learning-rate schedule) keeps going.
* ``compress``: how the pseudo-gradients travel: ``none`` (a float32 all-reduce by
  ``reduce``), ``int8`` / ``int4`` (:func:`jaxcomm.ec_quantized_all_reduce`, error-fed,
  as INTELLECT-1 / Streaming DiLoCo), ``sparseloco`` (:func:`jaxcomm.chunk_topk`: top-64
  of every 4,096 entries, 2-bit values, error buffer decay 0.95; SparseLoCo pairs it with
  ``outer_lr: 1.0, outer_momentum: 0``), ``ar_topk`` (AR-Topk's shared root indices and
  a ring all-reduce of values, ratio 0.01, error-fed) or ``statistical``
  (:func:`jaxcomm.statistical_quantized`: MuLoCo's 2-bit statistical quantization of each
  tensor, error buffer decay 0.9, an all-gather; with ``optimizer: muon`` as the inner
  optimizer that is MuLoCo); a mapping ``{method: ..., <the codec's arguments>}``
  overrides the defaults (e.g. ``{method: sparseloco, average: senders}``: each entry
  averaged over the workers that sent it instead of all ``N``, see
  :func:`jaxcomm.chunk_topk`).

**Clock** (data parallel). Each step computes (its program on the roofline with the taken
branch's outer-step arithmetic, or the host's measured time). A synchronising step's
transfer starts when its compute ends and the link is free, and takes the logged
traffic's time on the step's network; the merge ``tau`` steps later waits for it. With
``tau = 0`` that is a blocking all-reduce; with ``tau > 0`` up to ``tau`` steps of compute
hide it. A warm-start step's all-reduce blocks (it starts when the compute ends and the link
is free; the step ends when it lands). A pipeline keeps GPipe's timeline with the logged
traffic added to the synchronising step (no overlap credit).

Evaluation, the exported ``params.msgpack`` and the summary use ``theta_sync`` (the
synchronised model of the outer optimizer); each metrics row records the workers'
divergence and the fragment synchronised (-1: none; -2: a warm-start step), the summary
the peak and total bytes a worker sent in a step and over the run (on a pipeline, with its
boundary messages). A non-finite ``theta_sync`` stops the run at the synchronisation that
made it, not at the merge ``overlap`` steps later.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm
from jaxcomm._src.diloco import DILOCO_SCOPE, DILOCO_WARMUP_SCOPE, DiLoCoState
from jaxcomm._src.network import Network
from jaxcomm._src.sparse import ROOT_SCOPE

from .clock import wire_time
from .config import Config, DiLoCoSync
from .localsgd import divergence
from .models import layer_groups
from .pipeline_programs import OWNED
from .programs import AXIS
from .sync import Sync, build_context, make_optimizer

if TYPE_CHECKING:
    from .context import Context

__all__ = ["DiLoCo", "link_step"]


def _states(opt_state: Any) -> list[DiLoCoState]:
    """The :class:`jaxcomm.DiLoCoState` s in an optimizer state (one per parameter group)."""
    leaves = jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState))
    return [s for s in leaves if isinstance(s, DiLoCoState)]


@jax.jit
def _finite(tree: Any) -> jax.Array:
    """``bool[]``: every leaf finite (not a max reduction, which may drop a NaN on CPU)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree_util.tree_leaves(tree)]))


# The kind of a warm-start step for :func:`link_step`: a blocking all-reduce.
WARM = (-2, ())


def link_step(
    wire: dict[str, Any],
    compute: float,
    comm: float,
    kind: tuple[int, tuple[int, ...]],
    step: int,
    overlap: int,
) -> float:
    """Advance the link clock ``wire`` (``t``: now, ``free``: when the link frees,
    ``arrive``: when each fragment's transfer lands) by 0-based step ``step`` of ``kind``
    (:func:`jaxcomm.schedules.diloco_steps`: fragment synchronised, fragments merged; ``step``
    counted from the first period) and return its seconds: the step computes; a
    synchronisation's transfer starts when that compute ends and the link is free and
    takes ``comm``; a merge (once ``step >= overlap``) waits for its fragment's transfer.
    A warm-start step (:data:`WARM`) sends its all-reduce the same way and waits for it."""
    sync, merges = kind
    start = wire["t"]
    end = start + compute
    if kind == WARM:
        wire["free"] = end = max(end, wire["free"]) + comm
        wire["t"] = end
        return end - start
    if sync >= 0:
        send = max(end, wire["free"])
        wire["free"] = send + comm
        wire["arrive"][str(sync)] = wire["free"]
    if step >= overlap:
        for p in merges:
            end = max(end, wire["arrive"].get(str(p), end))
    wire["t"] = end
    return end - start


class DiLoCo(Sync):
    """DiLoCo / Streaming DiLoCo around the optimizer (see module)."""

    reads_state = False
    runs = (DiLoCoSync,)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.sync = cfg.sync
        self.schedule: jaxcomm.schedules.Schedule | None = None
        self._steps: list[tuple[int, tuple[int, ...]]] = []
        # The clock's link: when it frees, when each fragment's transfer arrives.
        self._wire: dict[str, Any] = {"t": 0.0, "free": 0.0, "arrive": {}}

    def fingerprint(self) -> dict[str, Any]:
        return {"sync": self.sync.to_dict()}

    @property
    def warmup(self) -> int:
        """Data-parallel steps before the first period (``sync.warmup_steps``)."""
        return self.sync.warmup_steps

    def kind(self, step: int) -> tuple[int, tuple[int, ...]]:
        """What 0-based step ``step`` does (:func:`link_step`'s ``kind``)."""
        if step < self.warmup:
            return WARM
        return self._steps[(step - self.warmup) % self.sync.period]

    # ------------------------------------------------------------------ transforms

    def _aggregate(self) -> optax.GradientTransformation | None:
        comp = self.sync.compress
        if comp is None:
            return None
        return _named_errors(comp.build(build_context(self.cfg)), f"sync.compress {comp.key!r}")

    def _outer(self) -> optax.GradientTransformation:
        lr, mu = self.sync.outer_lr, self.sync.outer_momentum
        if mu == 0:
            return optax.sgd(lr)
        return optax.sgd(lr, momentum=mu, nesterov=True)

    def _wrapper(self, layers: Any, schedule: Any) -> optax.GradientTransformation:
        s = self.sync
        aggregate = self._aggregate()
        wrapper = jaxcomm.diloco(
            make_optimizer(self.cfg),
            AXIS,
            period=s.period,
            outer=self._outer(),
            layers=layers,
            schedule=schedule,
            overlap=s.overlap,
            alpha=s.alpha,
            aggregate=aggregate,
            reduce=s.reduce if aggregate is None else None,
            warmup=s.warmup_steps,
        )
        return optax.chain(optax.identity(), wrapper)

    def _plan(self, num_layers: int) -> None:
        s = self.sync
        self.schedule = jaxcomm.schedules.streaming_schedule(
            num_layers, s.period, s.fragments, pattern=s.pattern
        )
        self._steps = jaxcomm.schedules.diloco_steps(
            s.period, schedule=self.schedule, overlap=s.overlap
        )

    def make_tx(self, ctx: Context) -> optax.GradientTransformation:
        n, data = ctx.n, ctx.train_data
        sample = data.get(np.arange(self.cfg.global_batch // n))
        params = jax.eval_shape(lambda k: ctx.task.init(k, sample), jax.random.key(0))
        names = layer_groups(params)
        if self.sync.fragments > len(names):
            raise ValueError(
                f"sync.fragments={self.sync.fragments} exceeds the model's {len(names)} "
                f"layers ({', '.join(names)}); choose fragments in 1..{len(names)}"
            )
        self._plan(len(names))
        one = self.sync.fragments == 1  # the whole model as one message
        return self._wrapper(None if one else names, None if one else self.schedule)

    def group_txs(
        self, ctx: Context, units: dict[str, Any], stages: int
    ) -> dict[str, optax.GradientTransformation]:
        """A pipeline's transforms: one wrapper per parameter group (``embed``, ``blocks``,
        ``head``), each synchronising its whole group over the ``data`` axis at the step
        the schedule gives it (fragments are the groups)."""
        order = {"embed": 0, "blocks": 1, "head": 2}  # input to output
        names = sorted(units, key=lambda name: order.get(name, 1))
        if self.sync.fragments > len(names):
            raise ValueError(
                f"sync.fragments={self.sync.fragments} with stages={stages}: a pipeline's "
                f"fragments are its {len(names)} parameter groups ({', '.join(names)}); "
                f"choose fragments in 1..{len(names)}"
            )
        self._plan(len(names))
        out = {}
        for u, name in enumerate(names):
            own = [(0,) if u in g else () for g in self.schedule.groups]
            out[name] = self._wrapper(None, jaxcomm.schedules.as_schedule(own, 1))
        return out

    # ------------------------------------------------------------------ clock

    def step_seconds(self, ctx, traffic, network, step, measured_s):
        """``(step, compute, comm)`` seconds of step ``step`` on the link model of the
        module docstring (data parallel; None on a pipeline: GPipe's timeline)."""
        if ctx.cfg.stages > 1:
            return None
        total = jaxcomm.audit.Traffic(
            sent=traffic.sent,
            rounds=traffic.rounds.sum(1),
            path_bytes=traffic.path_bytes.sum(1),
        )
        branches = None
        if len(set(self._steps)) > 1 or self.warmup:  # else no conditional
            branches = jaxcomm.schedules.diloco_branches(
                self.sync.period,
                step,
                schedule=self.schedule,
                overlap=self.sync.overlap,
                warmup=self.warmup,
            )
        _, compute, comm = ctx.simulate_step(
            ctx.program_key(),
            total,
            network,
            step,
            measured_s=measured_s,
            overlap=False,
            branches=branches,
        )
        seconds = link_step(
            self._wire, compute, comm, self.kind(step), step - self.warmup, self.sync.overlap
        )
        return seconds, compute, comm

    def estimate(self, ctx, mode, branches, network=None):
        """Each kind of step (inner only, synchronising a fragment, merging one) estimated
        apart by ``mode``, then laid on the link clock (:func:`link_step`, as the trainer's
        clock lays them) for three periods; the last period is the steady state. Top-level
        figures are its per-step means (``sent_bytes_per_device``: the busiest step's),
        ``diloco`` the details: compute utilisation (compute over wall time), peak and
        per-period bytes; with ``warmup_steps`` also a warm-start step's figures
        (``warmup_step_s``, ``warmup_comm_s``, ``warmup_sent_bytes_per_device``: a
        data-parallel step, its all-reduce blocking), which the periods' figures leave out."""
        if ctx.cfg.stages > 1:
            raise ValueError(
                "train.estimate of sync.method=diloco on a pipeline (stages > 1) is not "
                "modelled: each parameter group synchronises on its own steps inside GPipe's "
                "timeline; estimate the data-parallel shape (stages=1), or run it"
            )
        period, tau, batch = self.sync.period, self.sync.overlap, ctx.cfg.global_batch
        kinds = list(dict.fromkeys(self._steps))
        per_kind = {}
        for b, kind in enumerate(kinds):
            mine = dict(branches or {})
            # AR-Topk's root inside a synchronising step: every root sends the same busiest
            # device's bytes; the first is taken unless given.
            if self.sync.compress is not None and self.sync.compress.key == "ar_topk":
                mine.setdefault(ROOT_SCOPE, 0)
            if len(kinds) > 1 or self.warmup:
                mine[DILOCO_SCOPE] = b
            if self.warmup:
                mine[DILOCO_WARMUP_SCOPE] = 0
            per_kind[kind] = mode(None, mine)
        wire: dict[str, Any] = {"t": 0.0, "free": 0.0, "arrive": {}}
        seconds, compute = [], []
        for step in range(3 * period):
            kind = self._steps[step % period]
            m = per_kind[kind]
            seconds.append(link_step(wire, m["compute_s"], m["comm_s"], kind, step, tau))
            compute.append(m["compute_s"])
        last = slice(2 * period, 3 * period)
        sent = [per_kind[k]["sent_bytes_per_device"] for k in self._steps]
        round_s = float(sum(seconds[last]))
        busiest = max(per_kind.values(), key=lambda m: m["sent_bytes_per_device"])
        warm = {}
        if self.warmup:
            m = mode(None, {**(branches or {}), DILOCO_SCOPE: len(kinds), DILOCO_WARMUP_SCOPE: 1})
            fresh = {"t": 0.0, "free": 0.0, "arrive": {}}
            warm = {
                "warmup_steps": self.warmup,
                "warmup_step_s": link_step(fresh, m["compute_s"], m["comm_s"], WARM, 0, tau),
                "warmup_comm_s": m["comm_s"],
                "warmup_sent_bytes_per_device": m["sent_bytes_per_device"],
            }
        return {
            **busiest,
            "step_s": round_s / period,
            "compute_s": float(np.mean(compute[last])),
            "comm_s": float(np.mean([per_kind[k]["comm_s"] for k in self._steps])),
            "samples_per_s": batch * period / round_s,
            "diloco": {
                "period": period,
                "overlap": tau,
                "round_s": round_s,
                "compute_utilisation": float(sum(compute[last]) / round_s),
                "peak_sent_bytes_per_device": int(max(sent)),
                "sent_bytes_per_period": int(sum(sent)),
                "sync_comm_s": float(max(per_kind[k]["comm_s"] for k in kinds)),
                "inner_step_s": float(min(per_kind[k]["compute_s"] for k in kinds)),
                **warm,
            },
        }

    def replay(self, rows: list[dict[str, Any]], network: Network) -> np.ndarray:
        """Seconds of every step of a finished data-parallel run (its metrics rows, from
        step 1) on another ``network``: the same link model, each row's compute and its
        logged collectives' alpha-beta time there."""
        wire: dict[str, Any] = {"t": 0.0, "free": 0.0, "arrive": {}}
        out = []
        for r in rows:
            step = r["step"] - 1
            comm = wire_time(r["wire"], network)
            out.append(
                link_step(
                    wire,
                    r["sim_compute_s"],
                    comm,
                    self.kind(step),
                    step - self.warmup,
                    self.sync.overlap,
                )
            )
        return np.asarray(out)

    # ------------------------------------------------------------------ state

    def checkpoint_extras(self) -> dict[str, Any]:
        return {"diloco_wire": dict(self._wire)}

    def restore_extras(self, ctx: Context, extras: dict[str, Any]) -> None:
        if "diloco_wire" in extras:
            w = extras["diloco_wire"]
            self._wire = {"t": w["t"], "free": w["free"], "arrive": dict(w["arrive"])}

    # ------------------------------------------------------------------ the synchronised model

    def report(self, ctx: Context, params: Any, opt_state: Any) -> dict[str, Any]:
        # One flag per parameter group (a pipeline's live on different devices).
        finite = [_finite(s.anchor) for s in _states(opt_state)]
        return {"divergence": divergence(params), "anchor_finite": finite}

    def step_extras(self, ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
        if not bool(np.all(report["anchor_finite"])):
            # Caught at the synchronisation, not overlap steps later at the merge.
            raise FloatingPointError(
                f"step {ctx.step}: theta_sync became non-finite (a worker's "
                f"pseudo-gradient held NaN or Inf); {ctx.checkpoint_note()}"
            )
        # -1: no fragment synchronised (-2 on a warm-start step, which averages gradients).
        fragment = self.kind(ctx.step - 1)[0]
        return {"divergence": float(report["divergence"]), "sync_fragment": fragment}

    def eval_params(self, ctx: Context, params: Any) -> Any:
        """``theta_sync`` in the parameters' dtypes and placement."""

        def anchor(opt_state: Any) -> Any:
            return _states(opt_state)[0].anchor

        def place(a: Any, p: Any) -> Any:
            a = a.astype(p.dtype)
            if a.ndim < p.ndim:  # held once: every worker's row of the parameters
                return _spread(p.shape, p.sharding)(a)
            return jax.device_put(a, p.sharding)

        opt = ctx.opt_state
        if ctx.cfg.stages == 1:
            return jax.tree_util.tree_map(place, anchor(opt), params)
        out = {}
        for name in params:
            a = anchor(opt[name])
            if name in OWNED:  # [D, 1, ...] on the owner stage's devices
                cast = jax.tree_util.tree_map(lambda x, p: x.astype(p.dtype), a, params[name])
                out[name] = ctx.layout.owned.merged(params[name], cast)
            else:
                out[name] = jax.tree_util.tree_map(place, a, params[name])
        return out

    def summary_extras(self) -> dict[str, Any]:
        return {
            "schedule": str(self.schedule),
        }


@functools.cache
def _spread(shape: tuple[int, ...], sharding: Any) -> Any:
    """A compiled broadcast of one row to ``shape``, laid out as ``sharding`` (one per leaf
    kind: each evaluation reuses it)."""
    return jax.jit(lambda x: jnp.broadcast_to(x, shape), out_shardings=sharding)


def _named_errors(tx: optax.GradientTransformation, name: str) -> optax.GradientTransformation:
    """``tx`` whose ``ValueError`` at trace time (e.g. a top-k ratio that keeps nothing of a
    small fragment) names the setting that made it."""

    def init(params):
        try:
            return tx.init(params)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e

    def update(updates, state, params=None):
        try:
            return tx.update(updates, state, params)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e

    return optax.GradientTransformation(init, update)
