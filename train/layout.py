"""Layouts: how one training step is laid over the devices.

A :class:`Layout` owns the mesh, builds the per-worker state and the step programs from the
transforms the synchronisation (or a controller) gives, runs a step, and answers for it:
which compiled programs it is made of (to audit and cost), how long it takes on the
simulated clock, how its state is saved. The trainer (:class:`train.trainer.Trainer`) runs
the loop; it calls its layout through the methods below, passing the run's
:class:`~train.context.Context` (``ctx``: the state lives there), as the parts of
:mod:`train.sync` are passed it.

* :class:`train.data_parallel.DataParallel`: ``shard_map`` over ``data``, one program;
* :class:`train.pipeline_layout.Pipeline`: GPipe over ``data x stage`` with boundary
  codecs and message buffers, plus the embedding's and head's programs on their stages.

A layout is also a :class:`~train.sync.Part`: its fingerprint, metrics columns, summary
entries and after-step work join the parts' (it is the first part, so e.g. a pipeline's
message write-back comes before a controller reads the step).
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

import jaxcomm
from jaxcomm._src.network import Network

from .clock import synchronous_step
from .config import Config
from .programs import costed
from .sync import Part

if TYPE_CHECKING:
    from .context import Context

__all__ = ["Flight", "Layout"]


@dataclasses.dataclass
class Flight:
    """A dispatched step as the host loop holds it until reading it.

    ``metrics``, ``finite`` and ``report`` are the step's device outputs (``report``: its
    traffic logs, a top-k aggregator's gain and root, and the parts' reports);
    ``extra_logs`` are logs the state does not hold (a pipeline's messages);
    ``dispatched_at`` is ``time.perf_counter()`` at dispatch; ``compute_s`` is set when the
    step ran synchronously; otherwise ``ready`` gives the ``perf_counter`` time its outputs
    became ready.
    """

    step: int
    metrics: Any
    finite: Any
    report: dict[str, Any]
    extra_logs: list
    dispatched_at: float
    compute_s: float | None
    ready: concurrent.futures.Future | None = None


class Layout(Part, abc.ABC):
    """The interface every layout implements (see the module docstring): the abstract
    methods; the audit and roofline helpers here are shared and not meant to be
    overridden.

    Attributes set by ``__init__``: ``mesh``, ``sharded`` (per-worker state's sharding),
    ``replicated``, ``n`` (data replicas), ``abstract`` (shapes only, nothing allocated).
    """

    #: Whether step ``t + 1`` may be dispatched before step ``t`` is read on the host.
    lags = False

    def __init__(self, cfg: Config, *, abstract: bool = False):
        self.cfg, self.abstract = cfg, abstract
        self._modelled: dict[Any, np.ndarray] = {}

    # ------------------------------------------------------------------ state and steps

    @abc.abstractmethod
    def init_state(self, ctx: Context) -> tuple[Any, Any]:
        """``(params, opt_state)`` before step 1 (shapes if abstract): each array one row per
        worker (leading axis sharded over the workers) or one copy."""

    @abc.abstractmethod
    def build(self, ctx: Context) -> None:
        """(Re)build the step functions from the parts' transforms, dropping every compiled
        program and cost made from earlier ones (the state's structure is unchanged)."""

    @abc.abstractmethod
    def compile(self, ctx: Context) -> None:
        """Before the loop: compile the first step's program(s), so errors (an unlogged
        collective, a stale buffer) come before any step."""

    @abc.abstractmethod
    def launch(self, ctx: Context, step: int, lagging: bool) -> Flight:
        """Dispatch step ``step`` (1-based), set the context's new state, and return what
        the host reads of it later (finished already unless ``lagging``)."""

    @abc.abstractmethod
    def trial_step(self, ctx: Context, key: Any, params: Any, opt_state: Any) -> tuple:
        """One step of a controller's program ``key`` from ``(params, opt_state)`` (donated:
        pass copies) on the loader's next batch, for a trial the trainer's own state never
        sees: ``(params, opt_state, finite, logs, measured_s, program key)``."""

    @abc.abstractmethod
    def state_logs(self, ctx: Context, opt_state: Any) -> list[Any]:
        """The traffic logs kept in ``opt_state``, each with per-device leading axes."""

    # ------------------------------------------------------------------ programs and time

    @abc.abstractmethod
    def program_key(self, ctx: Context) -> Any:
        """Which compiled program(s) the next (or last) step runs."""

    @abc.abstractmethod
    def step_programs(self, ctx: Context, key: Any) -> list[tuple[Any, np.ndarray]]:
        """The compiled programs of a step of program ``key``, each with the mesh index
        (row-major) of each of its devices; compiled on first use."""

    @abc.abstractmethod
    def simulate_step(
        self,
        ctx: Context,
        key: Any,
        traffic: jaxcomm.audit.Traffic,
        network: Network,
        step: int,
        *,
        measured_s: float | None,
        overlap: bool,
        branches: Any,
        stream: int,
    ) -> tuple[float, float, float]:
        """Simulated ``(step, compute, comm)`` seconds of one step (see
        :meth:`train.context.Context.simulate_step`); :meth:`synchronous_seconds` is the
        synchronous step's."""

    # ------------------------------------------------------------------ model and files

    @abc.abstractmethod
    def evaluate(self, ctx: Context, data: Any) -> dict[str, float]:
        """Mean metrics on ``data`` (a dataset split) of the trainer's current (evaluation)
        parameters."""

    @abc.abstractmethod
    def state_tree(self, ctx: Context) -> dict[str, Any]:
        """``{"params", "opt_state"}`` as a checkpoint stores them (global arrays)."""

    @abc.abstractmethod
    def set_state(self, ctx: Context, params: Any, opt_state: Any) -> None:
        """Take restored ``params`` and ``opt_state`` (as :meth:`state_tree` gave them)."""

    @abc.abstractmethod
    def before_save(self, ctx: Context, store: Any) -> None:
        """Host state to write before the checkpoint of ``ctx.step`` commits."""

    @abc.abstractmethod
    def after_save(self, ctx: Context, store: Any) -> None:
        """Clean-up once the checkpoint of ``ctx.step`` committed."""

    @abc.abstractmethod
    def after_restore(self, ctx: Context) -> None:
        """Host state to restore once checkpoint ``ctx.step`` was loaded."""

    @abc.abstractmethod
    def num_params(self, ctx: Context) -> int:
        """Parameters of the model (one data replica's copy)."""

    @abc.abstractmethod
    def model_params(self, ctx: Context, params: Any) -> Any:
        """Replica 0 of host ``params`` (a worker's row of those with one) in the model's own
        layout."""

    @abc.abstractmethod
    def synced_bytes(self, ctx: Context) -> int:
        """Float32 bytes of the gradients the busiest device averages over ``data``."""

    @abc.abstractmethod
    def smallest_group(self, ctx: Context) -> int:
        """Elements of the smallest gradient group a device aggregates by itself."""

    # ------------------------------------------------------------------ shared helpers

    def per_device(self, ctx: Context, key: Any, of: Callable[[Any], np.ndarray]) -> np.ndarray:
        """``of(program)`` (one value per program device) summed per mesh device over the
        step's programs: ``[devices]`` in mesh (row-major) order."""
        total = np.zeros(self.mesh.devices.size, np.float64)
        for program, index in self.step_programs(ctx, key):
            total[index] += np.asarray(of(program), np.float64)
        return total

    def step_audit(self, ctx: Context, key: Any, branches: Any = None) -> jaxcomm.audit.Traffic:
        """Per-device traffic of one step read from its compiled programs by
        :func:`jaxcomm.wire_audit` (device order as the logs); ``branches`` resolves the
        programs' conditionals as in :meth:`jaxcomm.WireAudit.traffic` (a key a program
        lacks is ignored there)."""
        audits = {}

        def part(field):
            def of(program):
                if id(program) not in audits:
                    audit = jaxcomm.wire_audit(program)
                    mine = {k: v for k, v in (branches or {}).items() if audit._matches(k)}
                    audits[id(program)] = audit.traffic(mine)
                return getattr(audits[id(program)], field)

            return self.per_device(ctx, key, of).astype(np.int64)

        return jaxcomm.audit.Traffic(
            sent=part("sent"), rounds=part("rounds"), path_bytes=part("path_bytes")
        )

    def program_seconds(self, ctx: Context, key: Any, branches: Any = None) -> np.ndarray:
        """Per-device roofline seconds of a step's programs (``branches`` as in
        :meth:`step_audit`); cached per key and branches (a run resolves the same few
        branches at every step, and costing a program reads its whole HLO text)."""
        memo = (key, repr(sorted((branches or {}).items())))
        if memo in self._modelled:
            return self._modelled[memo].copy()
        model = ctx.compute_model

        def seconds(program):
            cost = costed(program)
            mine = {k: v for k, v in (branches or {}).items() if cost._matches(k)}
            return model.seconds(cost.per_device(mine))

        self._modelled[memo] = self.per_device(ctx, key, seconds)
        return self._modelled[memo].copy()

    def synchronous_seconds(
        self,
        ctx: Context,
        key: Any,
        traffic: jaxcomm.audit.Traffic,
        network: Network,
        step: int,
        *,
        measured_s: float | None,
        overlap: bool,
        branches: Any,
        stream: int,
    ) -> tuple[float, float, float]:
        """Every device computes (its programs on the roofline, or ``measured_s`` with
        ``compute: measured``), then the logged collectives run: :func:`synchronous_step`."""
        if ctx.compute_model is None:
            if measured_s is None:
                raise ValueError("compute='measured' needs the measured step (measured_s)")
            per: Any = measured_s
        else:
            per = self.program_seconds(ctx, key, branches)
        return synchronous_step(
            per,
            traffic.rounds,
            traffic.path_bytes,
            network,
            step,
            devices=self.mesh.devices.size,
            stragglers=ctx.stragglers,
            overlap=overlap,
            stream=stream,
        )
