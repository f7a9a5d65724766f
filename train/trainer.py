"""Data-parallel trainer: ``shard_map`` over a ``data`` axis with a pluggable aggregator.

Every piece of training state that may differ between workers (parameters, optimizer and
aggregator state) is stored with a leading worker axis ``[N, ...]`` sharded over ``data``, so
dense data parallelism, compressed aggregators with per-worker residuals and local SGD all
use the same step. The step is one jitted function, compiled once before the loop; around
it sit data loading, metrics, the simulated clock and Orbax checkpoints.

Per step the trainer records the mean training loss, the bytes each worker sent (read from
the aggregator's :class:`~jaxcomm.network.CommLog`, i.e. measured payload sizes), the
measured step time on this machine (``compute_s``), the modelled communication time of those
bytes under the configured network (``comm_s``), and the simulated wall clock. On 8
simulated CPU devices ``compute_s`` is the time of all 8 workers sharing the host's cores.

The host loop does not wait between steps (``async_steps``, the default): step ``t + 1`` is
dispatched before step ``t``'s metrics, finite flag and traffic logs are read, the next batch
is loaded and copied to the devices while a step runs, and the logs are copied out of the
state by a small program queued behind the step (the next step donates that state). A step
whose state the host needs (a checkpoint, an evaluation) is read before anything follows it,
so a non-finite step still stops the run at that step with the last checkpoint intact. With
lagged steps ``compute_s`` is the time from the host seeing step ``t - 1`` finish (or from
dispatching step ``t``, if later) to seeing step ``t`` finish: while the devices stay busy
that is their time per step; host jitter shifts single steps but not the sum.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.network import (
    CommLog,
    Network,
    SimClock,
    find_logs,
)
from jaxcomm.sparse import TopkState
from models import build_task
from train.checkpoint import (
    Checkpoints,
    RunFolderBusy,
    load_model_params,
    resume_note,
    run_lock,
    save_model_params,
)
from train.clock import StepTraffic, step_traffic, synchronous_step, wire_time
from train.config import DENSE_AGGREGATORS, Config
from train.data import Loader, Subset, get_dataset, shard
from train.distributed import is_primary, to_host
from train.sync import Part, make_controller, make_sync

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
]

AXIS = "data"


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The inner optimizer named by ``cfg.optimizer`` at learning rate ``cfg.lr``."""
    return {
        "none": lambda: optax.identity(),
        "sgd": lambda: optax.sgd(cfg.lr),
        "momentum": lambda: optax.sgd(cfg.lr, momentum=0.9),
        "adam": lambda: optax.adam(cfg.lr),
        "adamw": lambda: optax.adamw(cfg.lr),
    }[cfg.optimizer]()


def make_aggregator(cfg: Config) -> optax.GradientTransformation:
    """The gradient aggregator named by ``cfg.aggregator`` over the ``data`` axis."""
    args = dict(cfg.aggregator_args)
    if cfg.aggregator == "none":  # local gradients: a sync wrapper averages parameters
        return optax.identity()
    if cfg.aggregator in DENSE_AGGREGATORS:
        factory, args = jaxcomm.dense_allreduce, {"reduce": cfg.aggregator, **args}
    elif cfg.aggregator == "ec_quantized":
        factory = jaxcomm.ec_quantized_allreduce
    else:
        factory = getattr(jaxcomm, cfg.aggregator)
    if cfg.aggregator in ("marsit", "ssdm", "cascading_sign"):
        args.setdefault("seed", cfg.seed)
    if cfg.aggregator == "ar_topk" and args.get("reduce") == "auto":
        net = args.get("network") or cfg.network_schedule().at(0)
        args["network"] = Network.parse(net) if isinstance(net, str) else net
    try:
        return factory(AXIS, **args)
    except TypeError as e:
        raise ValueError(f"aggregator_args {args!r} do not fit {cfg.aggregator!r}: {e}") from e


def structs(tree: Any, sharding: Any, lead: tuple[int, ...] = ()) -> Any:
    """``tree``'s arrays (or shapes) as ``jax.ShapeDtypeStruct`` with ``sharding``, with
    ``lead`` axes prepended."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype, sharding=sharding), tree
    )


def _squeeze(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a[0], tree)


def costed(program: Any) -> jaxcomm.ProgramCost:
    """:func:`jaxcomm.program_cost` of ``program``, warning loudly when it holds custom calls
    whose flops nothing can cost (a GPU backend's own kernels other than cuBLAS and cuDNN):
    their memory traffic is in the simulated time, their arithmetic is not."""
    cost = jaxcomm.program_cost(program)
    if cost.uncounted:
        names = ", ".join(cost.uncounted[:5]) + (" ..." if len(cost.uncounted) > 5 else "")
        warnings.warn(
            f"{len(cost.uncounted)} custom call(s) of the step have no flop count ({names}): "
            "their flops are missing from the modelled compute time (their memory bytes are "
            "counted)",
            UserWarning,
            stacklevel=2,
        )
    return cost


def checked(program: Any, where: str = "the training step") -> Any:
    """``program`` after :func:`jaxcomm.check_logged_traffic`: a compiled step whose
    collectives are not all in the traffic logs (so not in the simulated time) is an error
    here, before it runs."""
    jaxcomm.check_logged_traffic(program, where=where)
    return program


def _expand(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a[None], tree)


def host_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Per-device metrics (``{name: [devices...]}``, from the step's outputs) averaged on
    the host: the step sends no bytes for them."""
    return {k: float(np.mean(np.asarray(v, np.float64))) for k, v in metrics.items()}


def host_finite(*flags: Any) -> bool:
    """Whether every device's finite flag (int or bool arrays, from the step's programs)
    is set."""
    return all(bool(np.all(np.asarray(f))) for f in flags)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


@dataclasses.dataclass
class _Flight:
    """A dispatched step as the host loop holds it until reading it.

    ``metrics``, ``finite`` and ``report`` are the step's device outputs (``report``:
    :meth:`Trainer._report`); ``dispatched_at`` is ``time.perf_counter()`` at dispatch;
    ``compute_s`` is set when the step was run synchronously; otherwise ``ready`` gives
    the ``perf_counter`` time its outputs became ready.
    """

    step: int
    metrics: Any
    finite: Any
    report: dict[str, Any]
    extra_logs: list
    dispatched_at: float
    compute_s: float | None
    ready: concurrent.futures.Future | None = None


def _ready_at(tree: Any) -> float:
    """Block until ``tree``'s arrays are ready; ``time.perf_counter()`` then."""
    jax.block_until_ready(tree)
    return time.perf_counter()


def _state_report(opt_state: Any) -> dict[str, Any]:
    """What the host reads of a step's optimizer state: its traffic logs and a top-k
    aggregator's gain and root (the first one's)."""
    topk = [
        (s.gain, s.root)
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, TopkState))
        if isinstance(s, TopkState)
    ]
    return {"logs": find_logs(opt_state), "topk": topk[:1]}


class Trainer:
    """Builds the mesh, model, data, optimizer and step of one :class:`Config`, and runs it."""

    def __init__(self, cfg: Config, *, abstract: bool = False):
        """``abstract=True`` builds shapes only (no parameters, optimizer state or buffers
        are allocated): enough to compile the step and cost it (``train.estimate``)."""
        self.abstract = abstract
        if cfg.workers > jax.device_count():
            raise ValueError(
                f"workers={cfg.workers} needs that many devices, but JAX sees "
                f"{jax.device_count()}; on CPU set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={cfg.workers} before JAX starts"
            )
        if jax.process_count() > 1 and cfg.workers * cfg.stages != jax.device_count():
            raise ValueError(
                f"workers x stages = {cfg.workers} x {cfg.stages} must use every device of a "
                "multi-process run "
                f"({jax.process_count()} processes, {jax.device_count()} devices)"
            )
        # The synchronisation of the data replicas and the controllers that change the
        # step between steps: parts that the run loop calls around each step.
        self.sync = make_sync(cfg)
        self.control = make_controller(cfg)
        self.parts: list[Part] = [p for p in (self.sync, self.control) if p is not None]
        for part in self.parts:
            cfg = part.adjust_config(cfg)
        self.cfg = cfg
        self.n = cfg.workers
        self.mesh = jax.make_mesh((self.n,), (AXIS,), devices=jax.devices()[: self.n])
        me = jax.process_index()
        # Mesh rows (workers) whose device this process owns, and those devices.
        self._local_rows = [
            i for i, d in enumerate(self.mesh.devices.flat) if d.process_index == me
        ]
        self._local_devices = [self.mesh.devices.flat[i] for i in self._local_rows]
        self.task = build_task(cfg.task, **cfg.model)
        data_kwargs = {"seq_len": self.task.module.cfg.seq_len} if cfg.task == "gpt" else {}
        self.train_data = get_dataset(cfg.dataset, "train", **data_kwargs)
        self.valid_data = get_dataset(cfg.dataset, "valid", **data_kwargs)
        if cfg.train_samples:
            self.train_data = Subset(self.train_data, cfg.train_samples)
        self.loader = Loader(self.train_data, cfg.global_batch, seed=cfg.seed, num_shards=self.n)
        self.schedule = cfg.network_schedule()
        self.tx = self._make_tx()
        self.sharded = NamedSharding(self.mesh, P(AXIS))
        self.replicated = NamedSharding(self.mesh, P())
        self.clock = SimClock(overlap=self.cfg.overlap)
        self.compute_model = cfg.roofline()
        self.stragglers = cfg.straggler_model()
        self._modelled: dict[Any, np.ndarray] = {}
        self.step = 0
        self.last_traffic: StepTraffic | None = None
        self.params, self.opt_state = self._init_state()
        self._train_step = self._build_step()
        self._programs: dict[Any, Any] = {}
        self._eval_step = self._build_eval()
        for part in self.parts:
            part.start(self)

    # ------------------------------------------------------------------ state

    def _make_tx(self) -> optax.GradientTransformation:
        """The per-worker transform: the synchronisation's (an aggregator before the
        optimizer, or a sync wrapper around it), or the controller's current program's."""
        if self.control is not None:
            return self.control.make_tx(self, self.control.program_key(self))
        return self.sync.make_tx(self)

    def rebuild_step(self) -> None:
        """Build the step again from the parts (e.g. a restored schedule), dropping every
        compiled program and cost made from the old one."""
        self.tx = self._make_tx()
        self._train_step = self._build_step()
        self._programs.clear()
        self._modelled.clear()

    def _initial_params(self) -> Any:
        """The model's parameters before step 1: ``cfg.init_params`` if set, else random."""
        sample = self.train_data.get(np.arange(min(2, len(self.train_data))))
        # The rbg generator compiles far faster than threefry for many parameter shapes.
        key = jax.random.key(self.cfg.seed, impl="rbg")
        if self.abstract:
            return jax.eval_shape(lambda k: self.task.init(k, sample), key)
        params = self.task.init(key, sample)
        if self.cfg.init_params:
            params = load_model_params(self.cfg.init_params, params)
        return params

    def _init_state(self) -> tuple[Any, Any]:
        params = self._initial_params()
        init = jax.jit(
            jax.shard_map(
                lambda p: _expand(self.tx.init(_squeeze(p))),
                mesh=self.mesh,
                in_specs=P(AXIS),
                out_specs=P(AXIS),
            )
        )
        if self.abstract:
            stacked = structs(params, self.sharded, lead=(self.n,))
            return stacked, structs(jax.eval_shape(init, stacked), self.sharded)

        def spread(a: Any) -> jax.Array:
            # Built from each process's own devices' slices (the init is the same on
            # every process), so it also works when the mesh spans several processes.
            full = np.broadcast_to(np.asarray(a), (self.n, *a.shape))
            return jax.make_array_from_callback(full.shape, self.sharded, lambda i: full[i])

        stacked = jax.tree_util.tree_map(spread, params)
        return stacked, init(stacked)

    def _build_step(self, tx: optax.GradientTransformation | None = None) -> Callable:
        """The jitted step of ``tx`` (default: the config's aggregator and optimizer)."""
        task, tx = self.task, tx or self.tx

        def per_worker(params, opt_state, batch):
            # params, opt_state: [1, ...] this worker's; batch: [1, B / N, ...]
            p, s, b = _squeeze(params), _squeeze(opt_state), _squeeze(batch)
            (loss, metrics), grads = jax.value_and_grad(task.loss, has_aux=True)(p, b)
            updates, s = tx.update(grads, s, p)
            p = optax.apply_updates(p, updates)
            ok = _all_finite((loss, grads, p)).astype(jnp.int32)
            # Each worker's metrics and finite flag go to the host, which averages them
            # (`host_metrics`): a collective for them would cost every step 2 (N - 1)
            # latencies on the ring for a few bytes. The report (traffic logs, a top-k
            # aggregator's gain and root) is a separate output, so that the host can read
            # it after the next step has taken (donated) the state it also lives in.
            report = _expand(_state_report(s))
            return _expand(p), _expand(s), _expand(metrics), _expand(ok), report

        step = jax.shard_map(
            per_worker,
            mesh=self.mesh,
            in_specs=(P(AXIS), P(AXIS), P(AXIS)),
            out_specs=(P(AXIS),) * 5,
        )
        return jax.jit(step, donate_argnums=(0, 1))

    def _build_eval(self) -> Callable:
        task = self.task

        def per_worker(params, batch):
            _, metrics = task.loss(_squeeze(params), _squeeze(batch))
            return jax.lax.pmean(metrics, AXIS)

        f = jax.shard_map(per_worker, mesh=self.mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P())
        return jax.jit(f)

    def _put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A global batch ``[B, ...]`` as ``[N, B / N, ...]`` arrays sharded over workers;
        each process copies only its own workers' rows to its devices."""
        if jax.process_count() == 1:
            return {k: jax.device_put(v, self.sharded) for k, v in shard(batch, self.n).items()}
        rows = self._local_rows
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

    # ------------------------------------------------------------------ checkpoints

    def fingerprint(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed into this trainer."""
        shapes = jax.tree_util.tree_map(lambda a: list(a.shape[1:]), self.params)
        return {
            "task": self.cfg.task,
            "model": self.cfg.model,
            "dataset": self.cfg.dataset,
            "workers": self.n,
            "global_batch": self.cfg.global_batch,
            "seed": self.cfg.seed,
            "optimizer": self.cfg.optimizer,
            "aggregator": self.cfg.aggregator,
            "aggregator_args": self.cfg.aggregator_args,
            **{k: v for part in self.parts for k, v in part.fingerprint().items()},
            "param_shapes": jax.tree_util.tree_flatten_with_path(shapes)[0].__repr__(),
        }

    def _state_tree(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "opt_state": self.opt_state,
            "step": np.asarray(self.step, np.int64),
            "loader_position": np.asarray(self.loader.position, np.int64),
            "clock": np.asarray(self.clock.now, np.float64),
        }

    def _set_state(self, params: Any, opt_state: Any) -> None:
        """Hook: take restored ``params`` and ``opt_state`` (as :meth:`_state_tree` saved
        them)."""
        self.params, self.opt_state = params, opt_state

    def save(self, store: Checkpoints) -> None:
        """Write a checkpoint of the current step (atomic: a crash leaves the previous one)."""
        store.save(self.step, self._state_tree(), self.fingerprint(), self._checkpoint_extras())
        self.store = store

    def _checkpoint_note(self) -> str:
        """Where a stopped run can continue from, for its error message."""
        store = getattr(self, "store", None)
        return resume_note(store.folder if store else None, store.saved_step if store else None)

    def restore(self, store: Checkpoints) -> bool:
        """Load the newest intact checkpoint of ``store`` (see :meth:`Checkpoints.restore`);
        False when there is none."""
        self.store = store
        found = store.restore(self._state_tree(), self.fingerprint())
        if found is None:
            return False
        step, state, extras = found
        self._set_state(state["params"], state["opt_state"])
        self._restore_extras(extras)
        self.step = step
        self.loader.restore({"position": int(state["loader_position"]), "seed": self.cfg.seed})
        self.clock.restore({"now": float(state["clock"]), "overlap": self.cfg.overlap})
        return True

    # ------------------------------------------------------------------ loop

    def evaluate(self) -> dict[str, float]:
        """Mean validation metrics over ``eval_batches`` fixed batches."""
        batch_size = min(self.cfg.global_batch, len(self.valid_data) // self.n * self.n)
        loader = Loader(self.valid_data, batch_size, seed=0, num_shards=self.n, shuffle=False)
        totals: dict[str, float] = {}
        count = min(self.cfg.eval_batches, loader.batches_per_epoch)
        params = self._eval_params()
        for _ in range(count):
            m = self._eval_step(params, self._put_batch(loader.next()))
            for k, v in to_host(m).items():
                totals[k] = totals.get(k, 0.0) + float(v) / count
        return totals

    def compiled_step(self, key: Any = None) -> Any:
        """The train step of program ``key`` (None: the parts' own; a controller's key:
        its transform's) compiled ahead of time for the loader's batch shapes, audited
        (:func:`checked`); compiled on first use."""
        if key not in self._programs:
            batch = self._put_batch(self.train_data.get(self.loader.batch_ids(0)))
            if self.abstract:
                batch = structs(batch, self.sharded)
            step = self._train_step
            if key is not None and self.control is not None:
                step = self._build_step(self.control.make_tx(self, key))
            lowered = step.lower(self.params, self.opt_state, batch)
            self._programs[key] = checked(lowered.compile())
        return self._programs[key]

    def trial_step(self, key: Any, params: Any, opt_state: Any) -> tuple:
        """One step of the controller's program ``key`` from ``(params, opt_state)`` (donated:
        pass copies) on the loader's next batch, for a trial that the trainer's own state
        never sees: ``(params, opt_state, finite, logs, measured_s, program key)``."""
        program = self.compiled_step(key)
        batch = self._put_batch(self.loader.next())
        t0 = time.perf_counter()
        p, s, _, finite, _ = program(params, opt_state, batch)
        jax.block_until_ready((p, s))
        measured = time.perf_counter() - t0
        return p, s, host_finite(finite), find_logs(s), measured, key

    def synced_bytes(self) -> int:
        """Float32 bytes of the gradients a device averages over ``data`` each step."""
        return 4 * self.num_params()

    def smallest_group(self) -> int:
        """Elements of the smallest gradient group a device aggregates by itself."""
        return self.num_params()

    def _compile(self) -> Callable:
        """Compile the next step's program before the loop (errors before any step);
        returns the step the loop calls, which runs the program of the current key (a
        controller may change it between steps)."""
        self.compiled_step(self._program_key())

        def step(params: Any, opt_state: Any, batch: Any) -> tuple:
            return self.compiled_step(self._program_key())(params, opt_state, batch)

        return step

    def _program_key(self) -> Any:
        """Which compiled step the next (or last) step runs: the controller's choice, or
        None (one program)."""
        return None if self.control is None else self.control.program_key(self)

    def step_programs(self, key: Any = None) -> list[tuple[Any, np.ndarray]]:
        """The compiled programs of one step, each with the mesh index (row-major) of each
        of its devices: here the one data-parallel step of program ``key`` (default: the
        current one). Compiled on first use."""
        key = self._program_key() if key is None else key
        return [(self.compiled_step(key), np.arange(self.n))]

    def _per_device(self, key: Any, of: Callable[[Any], np.ndarray]) -> np.ndarray:
        """``of(program)`` (one value per program device) summed per mesh device over the
        step's programs: ``[devices]`` in mesh (row-major) order."""
        total = np.zeros(self.mesh.devices.size, np.float64)
        for program, index in self.step_programs(key):
            total[index] += np.asarray(of(program), np.float64)
        return total

    def step_audit(self, key: Any = None, branches: Any = None) -> jaxcomm.Traffic:
        """Per-device traffic of one step read from its compiled programs by
        :func:`jaxcomm.wire_audit` (device order as the logs). ``branches`` resolves the
        aggregator's conditionals (e.g. Marsit's full-precision rounds) as in
        :meth:`jaxcomm.WireAudit.traffic`; a key that a program lacks is ignored there."""
        audits = {}

        def part(field):
            def of(program):
                if id(program) not in audits:
                    audit = jaxcomm.wire_audit(program)
                    mine = {k: v for k, v in (branches or {}).items() if audit._matches(k)}
                    audits[id(program)] = audit.traffic(mine)
                return getattr(audits[id(program)], field)

            return self._per_device(key, of).astype(np.int64)

        return jaxcomm.Traffic(
            sent=part("sent"), rounds=part("rounds"), path_bytes=part("path_bytes")
        )

    def _program_seconds(self, key: Any, branches: Any = None) -> np.ndarray:
        """Per-device roofline seconds of a step's programs (``branches`` as in
        :meth:`step_audit`)."""
        model = self.compute_model

        def seconds(program):
            cost = costed(program)
            mine = {k: v for k, v in (branches or {}).items() if cost._matches(k)}
            return model.seconds(cost.per_device(mine))

        return self._per_device(key, seconds)

    def modelled_compute_s(self) -> float:
        """Compute time of the last step on the ``compute`` device: the roofline of its
        compiled program(s), on the slowest device (a synchronous step waits for it)."""
        return float(np.max(self._modelled_per_device()))

    def simulate_step(
        self,
        key: Any,
        traffic: jaxcomm.Traffic,
        network: Network,
        step: int,
        *,
        measured_s: float | None = None,
        overlap: bool | None = None,
        branches: Any = None,
        stream: int = 0,
    ) -> tuple[float, float, float]:
        """Simulated seconds of one step: ``(step, compute, comm)``.

        Compute is the roofline of the step's programs of kind ``key`` on the ``compute``
        device, per device (``measured_s``, the host's measured step, when ``compute`` is
        ``measured``); communication is ``traffic`` (per-device totals) over ``network``.
        ``stream`` > 0 draws stragglers independently of step ``step``'s own draws.
        The step waits for the slowest device and adds communication (``max`` of the two
        with ``overlap``); stragglers (drawn for ``step``, 0-based) scale each device's
        compute and jitter the latency of each round. ``compute`` and ``comm`` are the
        slowest device's compute and the busiest device's communication. ``overlap``
        overrides the config's; ``branches`` resolves the programs' conditionals for the
        compute as in :meth:`step_audit` (unresolved ones count their costliest branch).
        """
        overlap = self.cfg.overlap if overlap is None else bool(overlap)
        if self.compute_model is None:
            if measured_s is None:
                raise ValueError("compute='measured' needs the measured step (measured_s)")
            per: Any = measured_s
        else:
            per = self._modelled_per_device(key, branches)
        return synchronous_step(
            per,
            traffic.rounds,
            traffic.path_bytes,
            network,
            step,
            devices=self.mesh.devices.size,
            stragglers=self.stragglers,
            overlap=overlap,
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
        program (default: the one the last step ran); ``stream`` as there."""
        total = jaxcomm.Traffic(
            sent=traffic.sent,
            rounds=traffic.rounds.sum(1),
            path_bytes=traffic.path_bytes.sum(1),
        )
        key = self._program_key() if key is None else key
        if stream == 0:
            own = self.sync.step_seconds(self, traffic, network, step, measured_s)
            if own is not None:
                return own
        return self.simulate_step(key, total, network, step, measured_s=measured_s, stream=stream)

    def _modelled_per_device(self, key: Any = None, branches: Any = None) -> np.ndarray:
        key = self._program_key() if key is None else key
        if branches:
            return self._program_seconds(key, branches)
        if key not in self._modelled:
            self._modelled[key] = self._program_seconds(key)
        return self._modelled[key]

    def _step_once(self, compiled: Callable) -> tuple:
        """One synchronous step: ``(params, opt_state, metrics, finite, compute_s,
        extra_logs)``; ``compute_s`` is dispatch to the new state being ready."""
        batch = self._next_batch()
        t0 = time.perf_counter()
        params, opt_state, metrics, finite, _ = compiled(self.params, self.opt_state, batch)
        jax.block_until_ready((params, opt_state))
        return params, opt_state, metrics, finite, time.perf_counter() - t0, []

    # ------------------------------------------------------------------ the host loop

    def _lags(self) -> bool:
        """Hook: whether step ``t + 1`` may be dispatched before step ``t`` is read on the
        host (``cfg.async_steps``). Trainers whose host work between steps feeds the next
        step (a host-side message buffer, a ratio search) return False; so does, by
        default, a subclass that overrides a hook reading the trainer's current state
        (``_before_step``, ``_after_step``, ``_state_logs``), which lagging would show
        the next step's state."""
        cls = type(self)
        reads_state = any(
            getattr(cls, hook) is not getattr(Trainer, hook)
            for hook in ("_before_step", "_after_step", "_state_logs")
        ) or any(part.reads_state for part in self.parts)
        return self.cfg.async_steps and not reads_state

    def _batch_at(self, position: int) -> dict[str, jax.Array]:
        ids = self.loader.batch_ids(position)
        if jax.process_count() == 1:
            return self._put_batch(self.train_data.get(ids))
        # Each process loads only its own workers' samples.
        rows = shard({"ids": ids}, self.n)["ids"][self._local_rows]
        local = self.train_data.get(rows.reshape(-1))
        return self._put_local({k: v.reshape(*rows.shape, *v.shape[1:]) for k, v in local.items()})

    def _next_batch(self) -> dict[str, jax.Array]:
        """The device batch at the loader's position (the prefetched one when it is that
        position's), advancing the loader."""
        pos = self.loader.position
        fetched, self._prefetched = getattr(self, "_prefetched", None), None
        batch = fetched[1] if fetched is not None and fetched[0] == pos else self._batch_at(pos)
        self.loader.position = pos + 1
        return batch

    def _prefetch(self) -> None:
        """Load the next batch and start its copy to the devices (``device_put`` is
        asynchronous), keyed by its loader position."""
        self._prefetched = (self.loader.position, self._batch_at(self.loader.position))

    def _report(self, params: Any, opt_state: Any) -> dict[str, Any]:
        """Hook: device values the host reads of a step beyond the step program's own
        report, computed from the step's new state by programs dispatched right after it
        (e.g. local SGD's divergence); fresh outputs, so the next step's donation of the
        state leaves them intact: the parts' reports."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.report(self, params, opt_state))
        return out

    def _launch(self, compiled: Callable, step: int) -> _Flight:
        """Dispatch step ``step`` (1-based) and take its new state; returns what the host
        reads of it later. Lagged: nothing waits; synchronous: the step is finished."""
        if not self._lagging:
            params, opt_state, metrics, finite, compute_s, extra = self._step_once(compiled)
            self.params, self.opt_state = params, opt_state
            report = {
                **_state_report(opt_state),
                **self._report(params, opt_state),
                "logs": self._state_logs(),
            }
            return _Flight(step, metrics, finite, report, list(extra), 0.0, compute_s)
        batch = self._next_batch()
        t0 = time.perf_counter()
        params, opt_state, metrics, finite, report = compiled(self.params, self.opt_state, batch)
        report = {**report, **self._report(params, opt_state)}
        # A thread stamps when the step's outputs are ready, whatever the host loop is
        # doing then (compute_s must not count the host's own work).
        ready = self._waiter().submit(_ready_at, (metrics, finite))
        self.params, self.opt_state = params, opt_state
        if step < self.cfg.steps:
            self._prefetch()  # host work while the devices run the step
        return _Flight(step, metrics, finite, report, [], t0, None, ready)

    def _waiter(self) -> concurrent.futures.ThreadPoolExecutor:
        if getattr(self, "_ready_pool", None) is None:
            self._ready_pool = concurrent.futures.ThreadPoolExecutor(1, "jaxcomm-ready")
        return self._ready_pool

    def _state_logs(self) -> list[CommLog]:
        """Hook: the traffic logs kept in the optimizer state (per-worker leading axes)."""
        return find_logs(self.opt_state)

    def _after_step(self) -> None:
        """Hook run once a step's state is accepted (before metrics and checkpoints)."""
        for part in self.parts:
            part.after_step(self)

    def _checkpoint_extras(self) -> dict[str, Any]:
        """Hook: host-side state saved with each checkpoint as JSON (the parts')."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.checkpoint_extras())
        return out

    def _restore_extras(self, extras: dict[str, Any]) -> None:
        """Hook: restore :meth:`_checkpoint_extras`' output."""
        for part in self.parts:
            part.restore_extras(self, extras)

    def _before_step(self) -> None:
        """Hook run before each training step (e.g. a search that changes the step)."""
        for part in self.parts:
            part.before_step(self)

    def _step_extras(self, report: dict[str, Any]) -> dict[str, float]:
        """Hook: extra per-step metrics for the JSONL row from the step's :meth:`_report`:
        a top-k aggregator's compression gain (mean over workers) and root (-1:
        all-gather)."""
        out: dict[str, float] = {}
        for gain, root in report.get("topk", []):
            out["gain"] = float(np.mean(np.asarray(gain)))
            out["root"] = int(np.asarray(root).reshape(-1)[0])
        for part in self.parts:
            out.update(part.step_extras(self, report))
        return out

    def _summary_extras(self) -> dict[str, Any]:
        """Hook: extra entries for ``summary.json`` (the parts')."""
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(part.summary_extras())
        return out

    def run(self, *, resume: bool = False, metrics_cb: Callable | None = None) -> dict[str, Any]:
        """Train to ``cfg.steps``; returns a summary. ``resume`` continues the newest checkpoint.

        The run folder is locked for the run (``<out_dir>/<name>/.lock``, by process 0): a
        second run into the same folder while this one lives is refused, naming this one's
        process, instead of interleaving metrics and overwriting checkpoints."""
        self.cfg.run_dir.mkdir(parents=True, exist_ok=True)
        with run_lock(self.cfg.run_dir) if is_primary() else contextlib.nullcontext():
            return self._run(resume=resume, metrics_cb=metrics_cb)

    def _run(self, *, resume: bool, metrics_cb: Callable | None) -> dict[str, Any]:
        cfg = self.cfg
        run_dir = cfg.run_dir
        manager = self.store = Checkpoints(run_dir, cfg.keep_checkpoints)
        if manager.latest_step() is not None and not resume:
            raise ValueError(
                f"{str(run_dir)!r} already holds checkpoints (newest: step "
                f"{manager.latest_step()}); pass --resume to continue it or choose another out_dir"
            )
        resumed = self.restore(manager) if resume else False
        primary = is_primary()
        metrics_path = run_dir / "metrics.jsonl"
        kept = []
        if resumed and metrics_path.exists():
            kept = [
                line
                for line in metrics_path.read_text().splitlines()
                if line and json.loads(line).get("step", 0) <= self.step
            ]
        if primary:  # files are written once, by process 0
            if resumed and (run_dir / "config.json").is_file():
                try:
                    before = json.loads((run_dir / "config.json").read_text())
                except (json.JSONDecodeError, UnicodeDecodeError):
                    before = {}
                if "lr" in before and before["lr"] != cfg.lr:
                    print(f"resuming with lr changed: {before['lr']!r} -> {cfg.lr!r}", flush=True)
            metrics_path.write_text("".join(line + "\n" for line in kept))
            (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

        compiled = self._compile()
        wall0 = time.perf_counter()
        self._lagging = self._lags()
        self._prefetched = None
        self._last_ready = None
        self._last: dict[str, Any] = {}
        bar = _progress(cfg, self.step) if primary else None
        flights: collections.deque[_Flight] = collections.deque()
        dispatched = self.step
        with open(metrics_path if primary else os.devnull, "a") as out:
            while dispatched < cfg.steps or flights:
                if dispatched < cfg.steps:
                    self._before_step()
                    dispatched += 1
                    flights.append(self._launch(compiled, dispatched))
                # Read a step once the next is queued behind it; read at once when its
                # state is needed on the host (a checkpoint, an evaluation: the next step
                # would donate it), when no step follows, or when not lagging.
                while flights and (
                    len(flights) > 1
                    or not self._lagging
                    or dispatched == cfg.steps
                    or self._needs_state(flights[0].step)
                ):
                    self._accept(flights.popleft(), out, manager, bar, metrics_cb)
        last = self._last
        if bar is not None:
            bar.close()
        if manager.latest_step() != self.step:
            self.save(manager)
        manager.close()
        valid = self.evaluate()
        summary = {
            "name": cfg.name,
            "steps": self.step,
            "resumed": resumed,
            "final_loss": last.get("loss"),
            **{f"valid_{k}": v for k, v in valid.items()},
            "params": self.num_params(),
            "sent_bytes_per_step": last.get("sent_bytes"),
            "sim_time_s": self.clock.now,
            "network": cfg.network,
            "compute": cfg.compute,
            "wall_s": time.perf_counter() - wall0,
            **self._summary_extras(),
        }
        model = self.model_params()  # on every process: a collective read when multi-process
        if primary:
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            save_model_params(run_dir / "params.msgpack", model)
            from train.plot import plot_metrics

            plot_metrics(metrics_path, run_dir / "loss.png", title=cfg.name)
        return summary

    def _needs_state(self, step: int) -> bool:
        """Whether step ``step``'s accepted state is read on the host (checkpoint, eval)."""
        cfg = self.cfg
        return bool(
            (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)
            or (cfg.eval_every and step % cfg.eval_every == 0)
        )

    def _accept(self, flight: _Flight, out: Any, manager: Any, bar: Any, metrics_cb: Any) -> None:
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
                f"(loss={float(metrics['loss'])}); {self._checkpoint_note()}"
            )
        self.step = flight.step
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
        if metrics_cb is not None:
            metrics_cb(last)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{last['loss']:.3f}", sim=f"{sim:.1f}s")
        if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
            self.save(manager)

    def num_params(self) -> int:
        """Parameters of the model (one worker's copy)."""
        return sum(math.prod(a.shape[1:]) for a in jax.tree_util.tree_leaves(self.params))

    def _eval_params(self) -> Any:
        """The per-worker parameters (``[N, ...]``) that evaluation runs: the trained ones
        (identical on every worker for synchronous training; the worker mean for local
        SGD)."""
        return self.sync.eval_params(self, self.params)

    def worker_params(self, worker: int = 0) -> Any:
        """Parameters of one worker as host numpy arrays."""
        return jax.tree_util.tree_map(lambda a: a[worker], to_host(self.params))

    def model_params(self) -> Any:
        """Worker 0's parameters (the averaged model for local SGD) in the model's own
        layout (what ``init_params`` loads)."""
        return jax.tree_util.tree_map(lambda a: a[0], to_host(self._eval_params()))


def _progress(cfg: Config, start: int):
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start, desc=cfg.name, unit="step", dynamic_ncols=True)
