"""The parts a trainer composes beside its layout: how the data replicas synchronise, and
controllers that change the next step's program.

A :class:`Part` is a set of hooks the trainer calls around its steps (all optional): what it
adds to the checkpoint's fingerprint and extras, device values it reads of each step, the
columns it adds to a metrics row and to the summary, and host work before and after a
step. A :class:`Sync` also builds the per-worker transform (what happens to the gradients
and parameters across the ``data`` axis) and may replace the clock's step time with its own
timeline; a :class:`Controller` names the program each step runs and builds its transform.

* :class:`EveryStep`: an aggregator every step, then the optimizer (dense, compressed,
  sparse, or an aggregator that is the whole optimizer);
* :class:`train.localsgd.LocalSGD`: local SGD, partial local SGD and DreamDDP around the
  optimizer, with DreamDDP's layer-wise timeline in the clock;
* :class:`train.diloco.DiLoCo`: DiLoCo and Streaming DiLoCo around the optimizer;
* :class:`train.adaptive.AdaptiveRatio`: AR-Topk's adaptive compression ratio.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import optax

import jaxcomm

from .aggregators import BuildContext
from .config import Config
from .models import layer_groups
from .programs import AXIS

if TYPE_CHECKING:
    from .context import Context

__all__ = [
    "Part",
    "Sync",
    "Controller",
    "EveryStep",
    "make_optimizer",
    "make_schedule",
    "make_aggregator",
]


def make_schedule(cfg: Config) -> float | optax.Schedule:
    """The learning rate of ``cfg``: ``optimizer.lr`` (a constant, as it always was) or
    the ``optax`` schedule of ``optimizer.schedule``, a function of the optimizer's own
    update count (0 at the first step)."""
    settings = cfg.optimizer.schedule.resolved(cfg.steps)
    if settings is None:
        return cfg.lr
    # With optimizer none the schedule is a multiplier of the whole optimizer's update.
    peak = 1.0 if cfg.optimizer.name == "none" else cfg.lr
    warmup = settings["warmup_steps"]
    kind = settings["kind"]
    if kind == "constant":
        after = optax.constant_schedule(peak)
    elif kind == "cosine":
        after = optax.cosine_decay_schedule(peak, settings["decay_steps"], alpha=settings["floor"])
    else:
        after = optax.linear_schedule(peak, settings["floor"] * peak, settings["decay_steps"])
    if not warmup:
        return after
    rise = optax.linear_schedule(settings["warmup_from"] * peak, peak, warmup)
    return optax.join_schedules([rise, after], [warmup])


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The inner optimizer named by ``cfg.optimizer`` at the learning rate of
    :func:`make_schedule`, behind ``clip_norm``'s clipping and (``sgd``, ``momentum``)
    ``weight_decay``; ``adamw`` takes ``weight_decay`` as its decoupled decay. With the
    defaults it is exactly ``optax.adam(lr)`` (etc.), as before these settings. ``none``
    after a whole optimizer: the identity, or with a schedule its value (peak 1) times the
    update (:func:`jaxcomm.scheduled_step`), which scales the aggregator's step and its
    decoupled decay together (only for aggregators whose state does not hold the applied
    step: ``schedulable``)."""
    lr = make_schedule(cfg)
    wd = cfg.optimizer.weight_decay
    if cfg.optimizer.name == "muon":
        return _chain_before(cfg, muon(cfg, lr))
    adamw = (lambda: optax.adamw(lr)) if wd is None else (lambda: optax.adamw(lr, weight_decay=wd))
    base = {
        "none": lambda: optax.identity() if not callable(lr) else jaxcomm.scheduled_step(lr),
        "sgd": lambda: optax.sgd(lr),
        "momentum": lambda: optax.sgd(lr, momentum=0.9),
        "adam": lambda: optax.adam(lr),
        "adamw": adamw,
    }[cfg.optimizer.name]()
    if cfg.optimizer.name == "none":  # clipping goes before the aggregator (make_aggregator)
        return base
    return _chain_before(cfg, base)


def _chain_before(cfg: Config, base: optax.GradientTransformation) -> optax.GradientTransformation:
    """``base`` behind ``clip_norm``'s clipping and (SGD) ``weight_decay``."""
    before, opt = [], cfg.optimizer
    if opt.clip_norm:
        before.append(optax.clip_by_global_norm(opt.clip_norm))
    if opt.weight_decay is not None and opt.name in ("sgd", "momentum"):
        before.append(optax.add_decayed_weights(opt.weight_decay))
    return optax.chain(*before, base) if before else base


def muon_leaves(params: Any) -> Any:
    """``params`` with ``MuonDimensionNumbers()`` on the leaves Muon steps (2-D weight
    matrices outside the first and last layer group: not the embeddings, not the output
    head) and ``None`` on the leaves AdamW steps."""
    from optax.contrib import MuonDimensionNumbers

    groups = layer_groups(params) if isinstance(params, Mapping) else []
    ends = {groups[0], groups[-1]} if len(groups) > 1 else set()

    def rule(path: tuple, leaf: Any) -> Any:
        top = getattr(path[0], "key", None) if path else None
        hidden = top not in ends
        return MuonDimensionNumbers() if hidden and getattr(leaf, "ndim", 0) == 2 else None

    return jax.tree_util.tree_map_with_path(rule, params)


def muon(cfg: Config, lr: float | optax.Schedule) -> optax.GradientTransformation:
    """``optimizer: muon``: ``optax.contrib.muon`` with Muon at ``cfg.muon_lr`` (scaled by
    the same schedule as ``lr``; momentum 0.95, no Nesterov look-ahead, as the MuLoCo
    authors' Muon) on :func:`muon_leaves`, AdamW at ``lr`` elsewhere, and ``weight_decay``
    decoupled on both (times each part's learning rate; unset: none)."""
    from optax.contrib import muon as optax_muon

    opt = cfg.optimizer
    ratio = opt.muon_lr / opt.lr
    muon_rate = (lambda step: ratio * lr(step)) if callable(lr) else opt.muon_lr
    wd = 0.0 if opt.weight_decay is None else opt.weight_decay
    return optax_muon(
        muon_rate,
        weight_decay=wd,
        adam_learning_rate=lr,
        adam_weight_decay=wd,
        nesterov=False,
        muon_weight_dimension_numbers=muon_leaves,
    )


def make_aggregator(cfg: Config) -> optax.GradientTransformation:
    """The aggregator of ``cfg`` over the ``data`` axis (its registered class's build);
    an aggregator that is the whole optimizer behind ``optimizer.clip_norm``'s clipping of
    each worker's own gradient."""
    agg = cfg.aggregator.build(build_context(cfg))
    if cfg.optimizer.name == "none" and cfg.optimizer.clip_norm:
        return optax.chain(optax.clip_by_global_norm(cfg.optimizer.clip_norm), agg)
    return agg


def build_context(cfg: Config) -> BuildContext:
    """What an aggregator's factory takes from the run: the ``data`` axis, the run's seed,
    the network of step 0."""
    return BuildContext(axis=AXIS, seed=cfg.seed, network=cfg.network_schedule().at(0))


class Part:
    """Hooks a trainer calls around its steps; every one is optional (a no-op here)."""

    #: Whether :meth:`before_step` / :meth:`after_step` read the trainer's current state;
    #: then the host reads every step before dispatching the next.
    reads_state = False

    def adjust_config(self, cfg: Config) -> Config:
        """The config the trainer runs with this part (e.g. a default filled in)."""
        return cfg

    def start(self, ctx: Context) -> None:
        """Called once the trainer has built its state, before any step."""

    def begin(self, ctx: Context, resumed: bool) -> None:
        """Called once the state to train from is in place (restored or fresh), before the
        first step of this run; may move the state and the step (a replica group healed
        from a live peer)."""

    def end(self, ctx: Context) -> None:
        """Called when the run loop ends, however it ends (close connections)."""

    def fingerprint(self) -> dict[str, Any]:
        """Entries a checkpoint must match to be resumed with this part."""
        return {}

    def report(self, ctx: Context, params: Any, opt_state: Any) -> dict[str, Any]:
        """Device values the host reads of a step, computed from its new state by programs
        dispatched right after it."""
        return {}

    def step_extras(self, ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
        """Columns for the step's metrics row, from the step's report."""
        return {}

    def checkpoint_extras(self) -> dict[str, Any]:
        """Host-side state saved with each checkpoint (JSON)."""
        return {}

    def restore_extras(self, ctx: Context, extras: dict[str, Any]) -> None:
        """Take back what :meth:`checkpoint_extras` saved (the whole extras mapping)."""

    def saved_arrays(self) -> dict[str, Any]:
        """Host arrays saved with each checkpoint beside the state (empty: none)."""
        return {}

    def load_arrays(self, ctx: Context, arrays: dict[str, Any]) -> None:
        """Take back what :meth:`saved_arrays` saved."""

    def summary_extras(self) -> dict[str, Any]:
        """Entries for ``summary.json``."""
        return {}

    def before_step(self, ctx: Context) -> None:
        """Host work before each step (e.g. a search that changes the step)."""

    def after_step(self, ctx: Context) -> None:
        """Host work once a step's state is accepted; may replace the state and move the
        step (with :attr:`reads_state`)."""


class Sync(Part):
    """How the data replicas synchronise: the per-worker transform and its clock."""

    #: The ``sync`` config classes (:data:`train.config.SYNCS`) this part runs.
    runs: ClassVar[tuple[type, ...]] = ()

    def make_tx(self, ctx: Context) -> optax.GradientTransformation:
        """The per-worker transform of the trainer's config (aggregator, optimizer)."""
        raise NotImplementedError

    def group_txs(
        self, ctx: Context, units: dict[str, Any], stages: int
    ) -> dict[str, optax.GradientTransformation]:
        """One transform per parameter group of a pipeline (``units``: group name -> one
        device's parameter shapes, input to output); here the same one for every group."""
        tx = self.make_tx(ctx)
        return {name: tx for name in units}

    def step_seconds(
        self, ctx: Context, traffic: Any, network: Any, step: int, measured_s: float
    ) -> tuple[float, float, float] | None:
        """``(step, compute, comm)`` seconds of step ``step`` (0-based) on this part's own
        timeline, or None for the layout's (its compute, then the logged traffic)."""
        return None

    def estimate(
        self,
        ctx: Context,
        mode: Callable[[Any, Any], dict[str, Any]],
        branches: Any,
        network: Any = None,
    ) -> dict[str, Any] | None:
        """``train.estimate``'s figures of a step on this part's own timeline, from
        ``mode(program key, branches)`` (one compiled step's figures: ``step_s``,
        ``compute_s``, ``comm_s``, ``sent_bytes_per_device``, ...) on ``network`` (the one
        ``mode`` prices); None for the layout's (one step of the current program)."""
        return None

    def eval_params(self, ctx: Context, params: Any) -> Any:
        """The per-worker parameters that evaluation and export use."""
        return params


class Controller(Part):
    """Reads a step's outputs and chooses the program of the next step."""

    reads_state = True

    def program_key(self, ctx: Context) -> Any:
        """A hashable name of the program the next step runs."""
        raise NotImplementedError

    def make_tx(self, ctx: Context, key: Any) -> optax.GradientTransformation:
        """The per-worker transform of program ``key``."""
        raise NotImplementedError


class EveryStep(Sync):
    """The configured aggregator every step, followed by the optimizer."""

    def make_tx(self, ctx: Context) -> optax.GradientTransformation:
        return optax.chain(make_aggregator(ctx.cfg), make_optimizer(ctx.cfg))
