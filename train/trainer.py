"""The trainer: one training program composed of named parts, and its run loop.

A :class:`Trainer` is built from a :class:`~train.config.Config` as

* a **layout** (:mod:`train.layout`): the mesh and how one step is built, compiled, run,
  audited and costed: data parallel (:mod:`train.data_parallel`) or a pipeline over
  ``data x stage`` (:mod:`train.pipeline_layout`);
* a **synchronisation** (:mod:`train.sync`): what happens to gradients or parameters
  across the ``data`` axis: an aggregator every step, or local SGD / partial local SGD /
  DreamDDP (:mod:`train.localsgd`); every layout takes every synchronisation;
* an optional **controller**: what reads a step's outputs and changes the next program
  (the adaptive compression ratio, :mod:`train.adaptive`);
* the **clock** (:mod:`train.clock`): simulated time of each step from the layout's
  timeline, the synchronisation's timeline and stragglers;
* **state and checkpoints** (:mod:`train.checkpoint`): the per-worker parameters and
  optimizer state, the loader position and the clock, saved with a fingerprint.

Per step the trainer records the mean training loss, the bytes each device sent (read from
the aggregators' and codecs' :class:`~jaxcomm.network.CommLog`, i.e. measured payload
sizes), the measured step time on this machine (``compute_s``), the modelled time of those
bytes under the configured network (``comm_s``) and the simulated wall clock. On simulated
CPU devices ``compute_s`` is the time of all devices sharing the host's cores.

The host loop need not wait between steps (``async_steps``, where the layout allows it and
no part reads the state between steps): step ``t + 1`` is dispatched before step ``t``'s
metrics, finite flag and traffic logs are read. A step whose state the host needs (a
checkpoint, an evaluation) is read before anything follows it, so a non-finite step still
stops the run at that step with the last checkpoint intact. With lagged steps
``compute_s`` is the time from the host seeing step ``t - 1`` finish (or from dispatching
step ``t``, if later) to seeing step ``t`` finish.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import jaxcomm
from jaxcomm._src.network import Network, SimClock

from . import RUN
from .adaptive import AdaptiveRatio
from .checkpoint import (
    Checkpoints,
    RunFolderBusy,
    has_rows,
    load_model_params,
    lock_holder,
    restore_run,
    run_fingerprint,
    run_lock,
    save_model_params,
    save_run,
    write_atomically,
)
from .clock import StepTraffic, step_traffic, wire_time
from .config import Config, resume_command
from .context import Context
from .data import HELD_OUT_DATASETS, Loader, Subset, get_dataset
from .data_parallel import DataParallel
from .diloco import DiLoCo
from .distributed import is_primary, to_host
from .layout import Flight, Layout
from .localsgd import LocalSGD
from .pipeline_layout import Pipeline
from .programs import AXIS, host_finite, host_metrics
from .sync import Controller, EveryStep, Sync, make_aggregator, make_optimizer

__all__ = [
    "Trainer",
    "make_optimizer",
    "make_aggregator",
    "wire_time",
    "StepTraffic",
    "step_traffic",
    "save_model_params",
    "load_model_params",
    "RunFolderBusy",
    "Interrupted",
    "NothingToResume",
    "nothing_to_resume",
    "AXIS",
]


class Trainer:
    """Builds the layout, model, data, parts and state of one :class:`Config`, and runs it."""

    def __init__(self, cfg: Config, *, abstract: bool = False):
        """``abstract=True`` builds shapes only (no parameters, optimizer state or buffers
        are allocated): enough to compile the step and cost it (``train.estimate``)."""
        if jax.process_count() > 1 and cfg.workers * cfg.stages != jax.device_count():
            raise ValueError(
                f"workers x stages = {cfg.workers} x {cfg.stages} must use every device of a "
                "multi-process run "
                f"({jax.process_count()} processes, {jax.device_count()} devices)"
            )
        sync, control = make_sync(cfg), make_controller(cfg)
        for part in (sync, control):
            if part is not None:
                cfg = part.adjust_config(cfg)
        self.cfg = cfg
        task = cfg.model.build()
        data_kwargs = {"seq_len": task.module.cfg.seq_len} if cfg.task == "gpt" else {}
        train_data = get_dataset(cfg.dataset, "train", **data_kwargs)
        self.valid_data = get_dataset(cfg.dataset, "valid", **data_kwargs)
        if cfg.train_samples:
            train_data = Subset(train_data, cfg.train_samples)
        # What the layout and the parts see of this run (the state lives there).
        self.ctx = ctx = Context(
            cfg,
            abstract=abstract,
            task=task,
            train_data=train_data,
            loader=Loader(
                train_data,
                cfg.global_batch,
                seed=cfg.seed,
                num_shards=cfg.workers,
                part=(cfg.groups.slot, cfg.groups.count) if cfg.groups else None,
            ),
            schedule=cfg.network_schedule(),
            clock=SimClock(overlap=cfg.overlap),
            compute_model=cfg.roofline(),
            stragglers=cfg.straggler_model(),
            sync=sync,
            control=control,
        )
        ctx.attach(make_layout(cfg, abstract=abstract))
        self.last_traffic: StepTraffic | None = None
        ctx.params, ctx.opt_state = ctx.layout.init_state(ctx)
        ctx.layout.build(ctx)
        for part in ctx.parts:
            part.start(ctx)

    # What the trainer shares with its context (the same objects).
    abstract = property(lambda self: self.ctx.abstract)
    task = property(lambda self: self.ctx.task)
    train_data = property(lambda self: self.ctx.train_data)
    loader = property(lambda self: self.ctx.loader)
    schedule = property(lambda self: self.ctx.schedule)
    clock = property(lambda self: self.ctx.clock)
    compute_model = property(lambda self: self.ctx.compute_model)
    sync = property(lambda self: self.ctx.sync)
    control = property(lambda self: self.ctx.control)
    layout = property(lambda self: self.ctx.layout)
    parts = property(lambda self: self.ctx.parts)
    mesh = property(lambda self: self.ctx.mesh)
    n = property(lambda self: self.ctx.n)
    sharded = property(lambda self: self.ctx.sharded)
    replicated = property(lambda self: self.ctx.replicated)

    @property
    def params(self) -> Any:
        """The parameters: one row per worker (leading axis ``[n]``) where they differ between
        workers, one copy where every worker holds them (``checkpoint.has_rows`` tells)."""
        return self.ctx.params

    @params.setter
    def params(self, value: Any) -> None:
        self.ctx.params = value

    @property
    def opt_state(self) -> Any:
        """Optimizer (and aggregator) state, each array one row per worker or one copy (as
        :attr:`params`)."""
        return self.ctx.opt_state

    @opt_state.setter
    def opt_state(self, value: Any) -> None:
        self.ctx.opt_state = value

    @property
    def step(self) -> int:
        """Steps done."""
        return self.ctx.step

    @step.setter
    def step(self, value: int) -> None:
        self.ctx.step = value

    @property
    def stragglers(self) -> Any:
        """The straggler model (None: none)."""
        return self.ctx.stragglers

    @stragglers.setter
    def stragglers(self, value: Any) -> None:
        self.ctx.stragglers = value

    @property
    def store(self) -> Any:
        """The checkpoint store once one is opened."""
        return self.ctx.store

    def rebuild_step(self) -> None:
        """Build the step again from the parts (see :meth:`train.context.Context.rebuild`)."""
        self.ctx.rebuild()

    def initial_params(self) -> Any:
        """The model's parameters before step 1: ``cfg.init_params`` if set, else random."""
        return self.ctx.initial_params()

    def eval_params(self) -> Any:
        """The per-worker parameters that evaluation runs: the trained ones (identical on
        every worker for synchronous training; the worker mean for local SGD)."""
        return self.ctx.eval_params()

    # ------------------------------------------------------------------ checkpoints

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed into this trainer."""
        return run_fingerprint(self.ctx)

    def save(self, store: Checkpoints) -> None:
        """Write a checkpoint of the current step (:func:`train.checkpoint.save_run`). A
        second Ctrl-C while it is written waits for it (a half-written checkpoint would
        only be thrown away)."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.saving = True
        try:
            save_run(self.ctx, store)
        finally:
            if stop is not None:
                stop.saving = False

    def restore(self, store: Checkpoints, *, allow_unverified: bool = False) -> bool:
        """Load the newest intact checkpoint of ``store`` (:func:`train.checkpoint.restore_run`);
        False when there is none."""
        return restore_run(self.ctx, store, allow_unverified=allow_unverified)

    # ------------------------------------------------------------------ programs and time

    def evaluate(self, split: str = "valid") -> dict[str, float]:
        """Mean metrics of split ``split`` (``valid``, or ``test`` where the dataset has one)
        over ``eval_batches`` fixed batches."""
        data = self.valid_data if split == "valid" else self._held_out_data(split)
        return self.layout.evaluate(self.ctx, data)

    def _held_out_data(self, split: str) -> Any:
        cfg = self.cfg
        data_kwargs = {"seq_len": self.task.module.cfg.seq_len} if cfg.task == "gpt" else {}
        return get_dataset(cfg.dataset, split, **data_kwargs)

    def step_programs(self, key: Any = None) -> list[tuple[Any, np.ndarray]]:
        """The compiled programs of one step (:meth:`train.context.Context.step_programs`)."""
        return self.ctx.step_programs(key)

    def step_audit(self, key: Any = None, branches: Any = None) -> jaxcomm.audit.Traffic:
        """Per-device traffic of one step (:meth:`train.context.Context.step_audit`)."""
        return self.ctx.step_audit(key, branches)

    def modelled_compute_s(self) -> float:
        """Compute time of the last step on the ``compute`` device: the roofline of its
        compiled program(s), on the slowest device (a synchronous step waits for it)."""
        return float(np.max(self.ctx.modelled_per_device()))

    def simulate_step(self, key: Any, traffic: Any, network: Network, step: int, **kw: Any):
        """Simulated ``(step, compute, comm)`` seconds of one step of program ``key``
        (:meth:`train.context.Context.simulate_step`)."""
        return self.ctx.simulate_step(key, traffic, network, step, **kw)

    def simulate_logged(self, traffic: StepTraffic, network: Network, step: int, **kw: Any):
        """:meth:`simulate_step` of a step from its logged traffic
        (:meth:`train.context.Context.simulate_logged`)."""
        return self.ctx.simulate_logged(traffic, network, step, **kw)

    # ------------------------------------------------------------------ the host loop

    def _lags(self) -> bool:
        """Whether step ``t + 1`` may be dispatched before step ``t`` is read on the host:
        ``cfg.async_steps``, a layout that allows it (a pipeline's host buffers feed the
        next step), and no part that reads the trainer's state between steps (nor a
        subclass overriding a hook that does)."""
        cls = type(self)
        reads_state = any(
            getattr(cls, hook) is not getattr(Trainer, hook)
            for hook in ("_before_step", "_after_step")
        ) or any(part.reads_state for part in self.parts)
        return self.cfg.async_steps and self.layout.lags and not reads_state

    def _after_step(self) -> None:
        """Run once a step's state is accepted (before metrics and checkpoints)."""
        for part in self.parts:
            part.after_step(self.ctx)

    def _before_step(self) -> None:
        """Run before each training step (e.g. a search that changes the step)."""
        for part in self.parts:
            part.before_step(self.ctx)

    def _step_extras(self, report: dict[str, Any]) -> dict[str, float]:
        """Extra per-step metrics: a top-k aggregator's compression gain (mean over
        workers) and root (-1: all-gather), and the parts' columns."""
        out: dict[str, float] = {}
        for gain, root in report.get("topk", []):
            out["gain"] = float(np.mean(np.asarray(gain)))
            out["root"] = int(np.asarray(root).reshape(-1)[0])
        for part in self.parts:
            out.update(part.step_extras(self.ctx, report))
        return out

    # ------------------------------------------------------------------ run

    def run(
        self,
        *,
        resume: bool = False,
        metrics_cb: Callable | None = None,
        allow_unverified: bool = False,
    ) -> dict[str, Any]:
        """Train to ``cfg.steps``; returns a summary. ``resume`` continues the newest checkpoint
        that proves it belongs to this run (``allow_unverified``: also one that cannot be
        verified, see :meth:`train.checkpoint.Checkpoints.restore`).

        The run folder is locked for the run (``<out_dir>/<name>/.lock``, by process 0): a
        second run into the same folder while this one lives is refused, naming this one's
        process, instead of interleaving metrics and overwriting checkpoints.

        SIGINT (Ctrl-C) and SIGTERM stop the run after the steps already dispatched, save a
        checkpoint of the last one and raise :class:`Interrupted` (a second Ctrl-C stops at
        once). Resuming a finished run returns its summary and changes nothing (raise
        ``steps`` to train further); resuming a folder without checkpoints raises
        :class:`NothingToResume`."""
        if resume:
            # Said before anything is made: an empty folder stays as it was.
            why = nothing_to_resume(self.cfg)
            if why is not None:
                raise NothingToResume(why)
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        with run_lock(self.cfg.run_dir) if is_primary() else contextlib.nullcontext():
            with _stop_signals() as stop:
                self._stop = stop
                return self._run(
                    resume=resume, metrics_cb=metrics_cb, allow_unverified=allow_unverified
                )

    def _stopping(self) -> bool:
        """Whether a stop signal arrived here or (several processes) at any process: every
        process must dispatch the same steps, so they agree before each one."""
        stop = getattr(self, "_stop", None)
        signum = int(stop.signum) if stop is not None else 0
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
            if stop is not None and signum and not stop.signum:
                stop.signum = signum  # another process's signal: stop (and report) as it does
        return bool(signum)

    def _finished_summary(self, summary_path: Any) -> dict[str, Any] | None:
        """The stored summary of a run already at (or past) ``cfg.steps`` whose outputs are
        all in place; None when any is missing (stopped between its last checkpoint and the
        end of its outputs: they are written again)."""
        try:
            summary = json.loads(summary_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(summary, dict) or summary.get("steps") != self.step:
            return None  # an earlier, shorter run's summary: this step's is written now
        missing = [n for n in OUTPUTS if not (summary_path.parent / n).is_file()]
        if missing:
            if is_primary():
                print(
                    f"{self.cfg.name} reached step {self.step} but {', '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} missing: writing its outputs again",
                    flush=True,
                )
            return None
        if is_primary():
            print(
                f"{self.cfg.name} is already complete at step {self.step}; its summary "
                f"({summary_path}) is unchanged. To train further, resume with --set "
                f"steps=<more than {self.step}>",
                flush=True,
            )
        return {**summary, "resumed": True, "already_complete": True}

    def _run(
        self, *, resume: bool, metrics_cb: Callable | None, allow_unverified: bool = False
    ) -> dict[str, Any]:
        store = self._open_store(resume)
        resumed = self.restore(store, allow_unverified=allow_unverified) if resume else False
        try:
            return self._run_from(store, resumed, metrics_cb)
        finally:
            for part in self.parts:
                part.end(self.ctx)

    def _run_from(self, store: Checkpoints, resumed: bool, metrics_cb: Callable | None):
        cfg = self.cfg
        if resumed and self.step >= cfg.steps:
            done = self._finished_summary(cfg.run_dir / "summary.json")
            if done is not None:
                store.close()
                return done
        self._say("compiling the training step (the first run on this machine takes the longest)")
        self.layout.compile(self.ctx)
        for part in self.parts:
            part.begin(self.ctx, resumed)
        kept = self._start_files(resumed)
        wall0 = time.perf_counter()
        start = self.step
        stopped = self._train(kept, store, metrics_cb)
        self._save_last(store, stopped, start)
        self._say("final evaluation and summary")
        summary = self._summary(resumed, wall0)
        self._write_outputs(summary)
        return summary

    def _say(self, what: str) -> None:
        """One line of progress on stderr (process 0)."""
        if is_primary():
            print(f"{self.cfg.name}: {what}...", file=sys.stderr, flush=True)

    def _open_store(self, resume: bool) -> Checkpoints:
        """The run folder's checkpoints: a new run refuses a folder that holds some, a
        resume one that holds none."""
        run_dir = self.cfg.run_dir
        store = self.ctx.store = Checkpoints(run_dir, self.cfg.keep_checkpoints)
        if store.latest_step() is not None and not resume:
            raise ValueError(
                f"{str(run_dir)!r} already holds a run's checkpoints (newest: step "
                f"{store.latest_step()}): continue it with {RUN} --resume "
                f"{str(run_dir)} (its saved settings), or write this run to another folder "
                "with --set name=<new name> (or --set out_dir=<folder>)"
            )
        if resume and store.latest_step() is None:
            raise NothingToResume(nothing_to_resume(self.cfg) or f"nothing to resume in {run_dir}")
        if not resume:
            store.start_run()
        return store

    def _start_files(self, resumed: bool) -> list[str]:
        """Write ``config.json`` and ``metrics.jsonl`` (a resumed or healed run's rows up to
        its step); returns those rows."""
        metrics_path = self.cfg.run_dir / "metrics.jsonl"
        # A run that starts past step 0 without a checkpoint of its own (a replica group
        # healed from a live peer) keeps its folder's earlier rows up to that step too.
        kept = _kept_rows(metrics_path, self.step) if resumed or self.step else []
        if is_primary():  # files are written once, by process 0
            write_atomically(metrics_path, "".join(line + "\n" for line in kept))
            config = json.dumps(self.cfg.to_dict(), indent=2)
            write_atomically(self.cfg.run_dir / "config.json", config)
        return kept

    def _train(self, kept: list[str], store: Checkpoints, metrics_cb: Callable | None) -> bool:
        """Step to ``cfg.steps`` (or a stop signal), each step dispatched before the last
        one's outputs are read where the layout allows; returns whether a signal stopped it."""
        cfg = self.cfg
        primary = is_primary()
        self._lagging = self._lags()
        self._last_ready = None
        # A resumed run's last logged step, so a run resumed at its end still reports it.
        self._last: dict[str, Any] = json.loads(kept[-1]) if kept else {}
        rows = [json.loads(r) for r in kept]
        self._times = [(r.get("sim_compute_s", 0.0), r.get("comm_s", 0.0)) for r in rows]
        self._sent = [int(r.get("sent_bytes", 0)) for r in rows]
        self._workers = [int(r.get("workers", self.n)) for r in rows]
        bar = _progress(cfg, self.step) if primary else None
        flights: collections.deque[Flight] = collections.deque()
        dispatched = self.step
        stopped = False
        metrics_path = cfg.run_dir / "metrics.jsonl"
        with open(metrics_path if primary else os.devnull, "a") as out:
            while (dispatched < cfg.steps and not stopped) or flights:
                if dispatched < cfg.steps and not stopped:
                    stopped = self._stopping()
                if dispatched < cfg.steps and not stopped:
                    self._before_step()
                    dispatched += 1
                    flights.append(self.layout.launch(self.ctx, dispatched, self._lagging))
                # Read a step once the next is queued behind it; read at once when its
                # state is needed on the host (a checkpoint, an evaluation: the next step
                # would donate it), when no step follows, or when not lagging.
                while flights and (
                    len(flights) > 1
                    or not self._lagging
                    or dispatched == cfg.steps
                    or stopped
                    or self._needs_state(flights[0].step)
                ):
                    self._accept(flights.popleft(), out, store, bar, metrics_cb)
                if not flights:
                    dispatched = self.step  # a part may have moved the step (a heal)
        if bar is not None:
            bar.close()
        return stopped

    def _save_last(self, store: Checkpoints, stopped: bool, start: int) -> None:
        """Checkpoint the last step (unless it is saved already) and close the store; a
        stopped run raises :class:`Interrupted` naming where to continue."""
        if stopped and self.step == start:  # a signal before the first step finished
            store.close()
            name = signal.Signals(self._stop.signum).name
            raise Interrupted(
                f"stopped by {name} before step {start + 1}; nothing new to save"
                + (" (the newest checkpoint is unchanged)" if start else ""),
                self._stop.signum,
            )
        # The step this store wrote or restored last, the same on every process (a listing
        # of the folder could differ between processes while one finishes a commit).
        if store.saved_step != self.step:
            self.save(store)
        store.close()
        if stopped and self.step < self.cfg.steps:
            name = signal.Signals(self._stop.signum).name
            raise Interrupted(
                f"stopped by {name} at step {self.step} of {self.cfg.steps}; checkpoint saved "
                f"in {store.folder / str(self.step)}; continue with "
                f"{resume_command(self.cfg.run_dir)}",
                self._stop.signum,
            )

    def _summary(self, resumed: bool, wall0: float) -> dict[str, Any]:
        """The run's summary: the final evaluation, bytes, simulated and wall time."""
        cfg, last = self.cfg, self._last
        valid = self.evaluate()
        # Where the dataset holds a test split apart from the validation split that settings
        # are chosen on, the summary reports it too.
        test = self.evaluate("test") if cfg.dataset in HELD_OUT_DATASETS else {}
        times = self._times
        return {
            "name": cfg.name,
            "steps": self.step,
            "workers": self.n,
            "samples_seen": self.loader.position * cfg.global_batch,
            "resumed": resumed,
            "final_loss": last.get("loss"),
            **{f"valid_{k}": v for k, v in valid.items()},
            **{f"test_{k}": v for k, v in test.items()},
            "params": self.num_params(),
            **self._bytes_summary(),
            "sim_time_s": self.clock.now,
            "sim_compute_s_per_step": float(np.mean([c for c, _ in times])) if times else None,
            "comm_s_per_step": float(np.mean([m for _, m in times])) if times else None,
            "network": cfg.network,
            "compute": cfg.compute,
            "wall_s": time.perf_counter() - wall0,
            **{k: v for part in self.parts for k, v in part.summary_extras().items()},
        }

    def _write_outputs(self, summary: dict[str, Any]) -> None:
        """The trained model, the loss plot and the summary, in the run folder."""
        run_dir = self.cfg.run_dir
        model = self.model_params()  # on every process: a collective read when multi-process
        if is_primary():
            from .plot import plot_metrics
            from .summary import format_summary

            # summary.json last: its presence (with every other output) marks the run
            # complete, so a crash or a full disk before it leaves a run that --resume ends.
            save_model_params(run_dir / "params.msgpack", model)
            plot_metrics(run_dir / "metrics.jsonl", run_dir / "loss.png", title=self.cfg.name)
            write_atomically(run_dir / "summary.txt", format_summary(summary) + "\n")
            write_atomically(run_dir / "summary.json", json.dumps(summary, indent=2))

    def _bytes_summary(self) -> dict[str, Any]:
        """Bytes sent per worker over the run (the busiest worker of each step, as
        ``metrics.jsonl``'s ``sent_bytes``): mean, peak and total, and the total against a
        dense float32 ring all-reduce of this model's gradient over each step's workers
        (a run resumed on another number of workers changes the ring)."""
        sent, params = self._sent, self.num_params()
        total = int(sum(sent))
        dense = [2 * (n - 1) * 4 * params // n for n in self._workers]
        mean = total / len(sent) if sent else None
        return {
            "sent_bytes_mean": mean,
            "sent_bytes_peak": max(sent) if sent else None,
            "sent_bytes_total": total,
            "dense_ring_bytes_per_step": sum(dense) / len(dense) if dense else None,
            "sent_vs_dense_ring": total / sum(dense) if sum(dense) else None,
        }

    def _needs_state(self, step: int) -> bool:
        """Whether step ``step``'s accepted state is read on the host (checkpoint, eval)."""
        cfg = self.cfg
        return bool(
            (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            or (cfg.eval_every and step % cfg.eval_every == 0)
        )

    def _accept(self, flight: Flight, out: Any, manager: Any, bar: Any, metrics_cb: Any) -> None:
        """Read a dispatched step on the host: stop on non-finite values, log its traffic,
        metrics and simulated time, evaluate and checkpoint when due."""
        cfg = self.cfg
        if flight.compute_s is None:
            # Lagged: from the previous step's outputs being ready (or this step's
            # dispatch, if later) to this step's being ready, both stamped by a waiting
            # thread: the devices' time for the step, whatever the host loop was doing.
            ready = flight.ready.result()
            start = flight.dispatched_at
            if self._last_ready is not None:
                start = max(start, self._last_ready)
            compute_s, self._last_ready = ready - start, ready
        else:
            compute_s = flight.compute_s
        # One read of everything the host needs (an all-gather when multi-process).
        fetched, finite, report = to_host((flight.metrics, flight.finite, flight.report))
        metrics, finite = host_metrics(fetched), host_finite(finite)
        if not finite:
            raise FloatingPointError(
                f"step {flight.step}: loss, gradients or parameters became non-finite "
                f"(loss={float(metrics['loss'])}); {self.ctx.checkpoint_note()}"
            )
        self.step = flight.step
        self.ctx.last_compute_s = compute_s
        self._after_step()
        # Every collective of the step (e.g. pipeline p2p and data-parallel all-reduce),
        # per device; the busiest device's bytes and time are reported.
        traffic = step_traffic(list(report["logs"]) + list(to_host(flight.extra_logs)))
        self.last_traffic = traffic
        network = self.schedule.at(self.step - 1)
        seconds, step_s, comm_s = self.simulate_logged(
            traffic, network, self.step - 1, measured_s=compute_s
        )
        sim = self.clock.advance(seconds)
        last = {
            "step": self.step,
            **{k: float(v) for k, v in metrics.items()},
            "sent_bytes": int(traffic.sent.max()),
            "workers": self.n,
            "compute_s": compute_s,
            "sim_compute_s": step_s,
            "comm_s": comm_s,
            "sim_step_s": seconds,
            "sim_time_s": sim,
            "latency_s": network.latency_s,
            "bandwidth_bps": network.bandwidth_bps,
            "wire": traffic.wire_record(network),
            **self._step_extras(report),
        }
        if cfg.eval_every and self.step % cfg.eval_every == 0:
            last.update({f"valid_{k}": v for k, v in self.evaluate().items()})
        out.write(json.dumps(last) + "\n")
        out.flush()
        self._last = last
        self._times.append((step_s, comm_s))
        self._sent.append(last["sent_bytes"])
        self._workers.append(self.n)
        if metrics_cb is not None:
            metrics_cb(last)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", sim=f"{sim:.1f}s")
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            self.save(manager)

    def num_params(self) -> int:
        """Parameters of the model (one data replica's copy)."""
        return self.layout.num_params(self.ctx)

    def worker_params(self, worker: int = 0) -> Any:
        """Parameters of one worker (data replica) as host numpy arrays (a worker's row of
        those with a row per worker; those held once as they are)."""
        rows = jax.tree_util.tree_map(has_rows, self.params)
        return jax.tree_util.tree_map(
            lambda a, r: a[worker] if r else a, to_host(self.params), rows
        )

    def model_params(self) -> Any:
        """Replica 0's parameters (the averaged model for local SGD) in the model's own
        layout (what ``init_params`` loads)."""
        return self.layout.model_params(self.ctx, to_host(self.eval_params()))


def make_layout(cfg: Config, *, abstract: bool = False) -> Layout:
    """The layout of ``cfg``: a pipeline over ``stage x data`` when ``stages > 1``, else
    data parallel."""
    return (Pipeline if cfg.stages > 1 else DataParallel)(cfg, abstract=abstract)


#: The synchronisation parts; each names the ``sync`` config classes it runs.
SYNC_PARTS: tuple[type[Sync], ...] = (LocalSGD, DiLoCo)


def make_sync(cfg: Config) -> Sync:
    """The synchronisation of ``cfg``: replica groups (``groups``), the part that runs its
    ``sync`` choice, else its aggregator each step."""
    if cfg.groups is not None:
        from .replica_groups import ReplicaGroups

        return ReplicaGroups(cfg)
    if cfg.sync is None:
        return EveryStep()
    for part in SYNC_PARTS:
        if isinstance(cfg.sync, part.runs):
            return part(cfg)
    raise ValueError(f"sync {cfg.sync.key!r}: no synchronisation part runs it")


def make_controller(cfg: Config) -> Controller | None:
    """The controller of ``cfg`` (the adaptive compression ratio), or None."""
    return AdaptiveRatio(cfg) if cfg.adaptive else None


def nothing_to_resume(cfg: Config) -> str | None:
    """Why ``cfg``'s run folder holds nothing to resume (no checkpoint yet: none was ever
    written, or a run in progress there has not written its first), or None."""
    folder = cfg.run_dir / "checkpoints"
    if not cfg.run_dir.is_dir():
        return (
            f"nothing to resume in {str(cfg.run_dir)!r}: it does not exist; run without "
            "--resume to start this run there"
        )
    if folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir()):
        return None
    holder = lock_holder(cfg.run_dir)
    if holder is not None:
        every = cfg.checkpoint_every
        return (
            f"nothing to resume in {str(cfg.run_dir)!r} yet: a run is in progress there "
            f"(process {holder}) and has not written its first checkpoint"
            + (f" (one every {every} steps)" if every else "")
            + "; wait for it, or stop it (Ctrl-C saves one)"
        )
    return (
        f"nothing to resume in {str(cfg.run_dir)!r}: it holds no checkpoint; run without "
        "--resume to start this run there"
    )


def _kept_rows(path: Any, step: int) -> list[str]:
    """The metrics rows of steps up to ``step`` (a resumed run's history). A line that does
    not parse (the last one, torn by a crash mid-write) is dropped with a line saying so."""
    if not path.exists():
        return []
    kept = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            print(f"{path}: line {n} is not a complete row (dropped)", file=sys.stderr, flush=True)
            continue
        if row.get("step", 0) <= step:
            kept.append(line)
    return kept


# What a finished run leaves in its folder; summary.json is written last.
OUTPUTS = ("summary.json", "summary.txt", "params.msgpack", "loss.png")


class Interrupted(RuntimeError):
    """A run stopped by a signal once its last completed step was checkpointed."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class NothingToResume(ValueError):
    """``resume`` was asked of a run folder that holds no checkpoint."""


class _StopFlag:
    signum: int = 0
    saving: bool = False  # a checkpoint is being written: a second Ctrl-C waits for it


@contextlib.contextmanager
def _stop_signals():
    """While the block runs, SIGINT and SIGTERM set a flag (the run loop stops at the next
    step and checkpoints) instead of ending the process; a second SIGINT raises
    ``KeyboardInterrupt`` at once. Outside the main thread (no handlers possible) the flag
    never rises."""
    flag = _StopFlag()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def handler(signum: int, _frame: Any) -> None:
        if flag.signum and signum == signal.SIGINT:
            if flag.saving:
                print("\nstill writing the checkpoint; it ends in a moment", flush=True)
                return
            raise KeyboardInterrupt
        if not flag.signum:
            print(
                f"\n{signal.Signals(signum).name}: stopping after the steps under way and "
                "saving a checkpoint (Ctrl-C again to stop at once, keeping only the newest "
                "checkpoint)",
                flush=True,
            )
        flag.signum = flag.signum or signum

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


class PlainProgress:
    """Progress without a bar (``progress: false``, ``--no-progress``): one plain line on
    stderr every ``every_s`` seconds of the run (and for the last step), for logs and
    terminals where a bar does not belong."""

    def __init__(self, name: str, total: int, start: int, every_s: float = 30.0):
        self.name, self.total, self.n, self.every_s = name, total, start, every_s
        self.t0 = self.last = time.monotonic()
        self.postfix: dict[str, str] = {}

    def update(self, n: int = 1) -> None:
        """Count ``n`` more steps; print a line when ``every_s`` passed or the run ends."""
        self.n += n
        now = time.monotonic()
        if now - self.last >= self.every_s or self.n >= self.total:
            self.last = now
            extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
            print(
                f"{self.name}: step {self.n}/{self.total}{extra} ({now - self.t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    def set_postfix(self, **values: str) -> None:
        """Values shown on the next line (as tqdm's ``set_postfix``)."""
        self.postfix = dict(values)

    def close(self) -> None:
        """Nothing to tear down (the interface of a bar)."""


def _progress(cfg: Config, start: int):
    if not cfg.progress:
        return PlainProgress(cfg.name, cfg.steps, start)
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start, desc=cfg.name, unit="step", dynamic_ncols=True)
