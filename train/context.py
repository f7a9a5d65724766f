"""What a run's layout and parts see of it: a :class:`Context`.

The trainer (:mod:`train.trainer`) owns the run loop, the files and the signals; its
layout and its parts (the synchronisation, a controller) are handed this narrower object
instead: the config, the model and data, the mesh, the simulated clock and network, the
current state (``params``, ``opt_state``, ``step``), and the few services that combine
them (the step's transform, its programs, its traffic and simulated time). Nothing here
imports the trainer, a layout or a part; they import this module.
"""

from __future__ import annotations

import concurrent.futures
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax

import jaxcomm
from jaxcomm._src.network import Network, NetworkSchedule, SimClock

from .checkpoint import load_model_params, resume_note
from .clock import StepTraffic
from .config import Config
from .data import Loader

if TYPE_CHECKING:
    from .layout import Layout
    from .sync import Controller, Part, Sync

__all__ = ["Context"]


class Context:
    """One run as its layout and parts see it (see the module docstring).

    Set at construction: ``cfg``, ``abstract`` (shapes only), ``task`` (the model's
    ``init``/``loss``), ``train_data``, ``loader``, ``schedule`` (the network over steps),
    ``clock``, ``compute_model`` (the roofline, or None for ``compute: measured``),
    ``stragglers``, ``sync`` and ``control`` (None without a controller). Set by
    :meth:`attach`: ``layout``, ``parts`` (the layout first), ``mesh``, ``n`` (data
    replicas), ``sharded`` and ``replicated`` (shardings of per-worker and shared state).
    The state: ``params`` and ``opt_state`` (each array either one row per worker,
    leading axis ``[n]`` sharded over the workers, or one copy every worker holds), ``step``
    (steps done), ``store`` (the checkpoint store once one is opened)."""

    def __init__(
        self,
        cfg: Config,
        *,
        abstract: bool,
        task: Any,
        train_data: Any,
        loader: Loader,
        schedule: NetworkSchedule,
        clock: SimClock,
        compute_model: Any,
        stragglers: Any,
        sync: Sync,
        control: Controller | None,
    ):
        self.cfg, self.abstract, self.task = cfg, abstract, task
        self.train_data, self.loader = train_data, loader
        self.schedule, self.clock = schedule, clock
        self.compute_model, self.stragglers = compute_model, stragglers
        self.sync, self.control = sync, control
        self.params: Any = None
        self.opt_state: Any = None
        self.step = 0
        self.last_compute_s = 0.0  # the measured device time of the last accepted step
        self.store: Any = None
        self._ready_pool: concurrent.futures.ThreadPoolExecutor | None = None

    def attach(self, layout: Layout) -> None:
        """Take the run's layout (made from the config this context holds)."""
        self.layout = layout
        self.parts: list[Part] = [p for p in (layout, self.sync, self.control) if p is not None]
        self.mesh, self.n = layout.mesh, layout.n
        self.sharded, self.replicated = layout.sharded, layout.replicated

    # ------------------------------------------------------------------ the step

    def initial_params(self) -> Any:
        """The model's parameters before step 1: ``cfg.init_params`` if set, else random
        (shapes only when abstract)."""
        sample = self.train_data.get(np.arange(min(2, len(self.train_data))))
        # The rbg generator compiles far faster than threefry for many parameter shapes.
        key = jax.random.key(self.cfg.seed, impl="rbg")
        if self.abstract:
            return jax.eval_shape(lambda k: self.task.init(k, sample), key)
        params = self.task.init(key, sample)
        if self.cfg.init_params:
            params = load_model_params(self.cfg.init_params, params)
        return params

    def make_tx(self) -> optax.GradientTransformation:
        """The per-worker transform of a one-group layout: the synchronisation's (an
        aggregator before the optimizer, or a sync wrapper around it), or the controller's
        current program's."""
        if self.control is not None:
            return self.control.make_tx(self, self.control.program_key(self))
        return self.sync.make_tx(self)

    def rebuild(self) -> None:
        """Build the step again from the parts (e.g. a restored schedule), dropping every
        compiled program and cost made from the old one."""
        self.layout.build(self)

    def parts_report(self, params: Any, opt_state: Any) -> dict[str, Any]:
        """Device values the parts read of a step, computed from its new state by programs
        dispatched right after it (fresh outputs: the next step's donation of the state
        leaves them intact)."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.report(self, params, opt_state))
        return out

    def waiter(self) -> concurrent.futures.ThreadPoolExecutor:
        """A thread that stamps when a step's outputs are ready."""
        if self._ready_pool is None:
            self._ready_pool = concurrent.futures.ThreadPoolExecutor(1, "jaxcomm-ready")
        return self._ready_pool

    def eval_params(self, params: Any = None) -> Any:
        """The per-worker parameters that evaluation and export use (of ``params``, default
        the current ones): the trained ones (identical on every worker for synchronous
        training; the worker mean for local SGD)."""
        return self.sync.eval_params(self, self.params if params is None else params)

    def checkpoint_note(self) -> str:
        """Where a stopped run can continue from, for its error message."""
        store = self.store
        return resume_note(store.folder if store else None, store.saved_step if store else None)

    # ------------------------------------------------------------------ programs and time

    def program_key(self) -> Any:
        """Which compiled program(s) the next (or last) step runs."""
        return self.layout.program_key(self)

    def step_programs(self, key: Any = None) -> list[tuple[Any, np.ndarray]]:
        """The compiled programs of one step of program ``key``, each with the mesh index
        (row-major) of each of its devices (see the layout's)."""
        return self.layout.step_programs(self, key)

    def step_audit(self, key: Any = None, branches: Any = None) -> jaxcomm.audit.Traffic:
        """Per-device traffic of one step read from its compiled programs by
        :func:`jaxcomm.wire_audit`; ``branches`` resolves conditionals (e.g. Marsit's
        full-precision rounds) as in :meth:`jaxcomm.WireAudit.traffic`."""
        return self.layout.step_audit(self, key, branches)

    def modelled_per_device(self, key: Any = None, branches: Any = None) -> np.ndarray:
        """Per-device roofline seconds of one step of program ``key`` (default: the current
        one), ``branches`` resolving its conditionals."""
        key = self.program_key() if key is None else key
        return self.layout.program_seconds(self, key, branches)

    def simulate_step(
        self,
        key: Any,
        traffic: jaxcomm.audit.Traffic,
        network: Network,
        step: int,
        *,
        measured_s: float | None = None,
        overlap: bool | None = None,
        branches: Any = None,
        stream: int = 0,
    ) -> tuple[float, float, float]:
        """Simulated seconds of one step of program ``key``: ``(step, compute, comm)``.

        Compute is the roofline of the step's programs on the ``compute`` device
        (``measured_s``, the host's measured step, with ``compute: measured``);
        communication is ``traffic`` (per-device totals) over ``network``; the layout
        lays them on its timeline (data parallel: the slowest device's compute, then the
        busiest device's collectives, ``max`` of the two with ``overlap``; a pipeline:
        GPipe's). Stragglers (drawn for ``step``, 0-based; ``stream`` > 0 draws
        independently of the step's own) scale each device's compute and jitter the
        latency of each round. ``overlap`` overrides the config's; ``branches`` resolves
        conditionals for the compute as in :meth:`step_audit`."""
        overlap = self.cfg.overlap if overlap is None else bool(overlap)
        return self.layout.simulate_step(
            self,
            key,
            traffic,
            network,
            step,
            measured_s=measured_s,
            overlap=overlap,
            branches=branches,
            stream=stream,
        )

    def simulate_logged(
        self,
        traffic: StepTraffic,
        network: Network,
        step: int,
        *,
        measured_s: float,
        key: Any = None,
        stream: int = 0,
    ) -> tuple[float, float, float]:
        """:meth:`simulate_step` of a step from its logged traffic; ``key`` names its
        program (default: the one the last step ran). A synchronisation with its own
        timeline (DreamDDP's layer-wise one) takes the step's own draws (``stream`` 0)."""
        if stream == 0:
            own = self.sync.step_seconds(self, traffic, network, step, measured_s)
            if own is not None:
                return own
        total = jaxcomm.audit.Traffic(
            sent=traffic.sent,
            rounds=traffic.rounds.sum(1),
            path_bytes=traffic.path_bytes.sum(1),
        )
        key = self.program_key() if key is None else key
        return self.simulate_step(key, total, network, step, measured_s=measured_s, stream=stream)
