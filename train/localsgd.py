"""Local SGD as a trainer's synchronisation (``sync:`` in a config).

Local SGD (FLSGD), partial local SGD with an equal-number partition (PLSGD-ENP) and DreamDDP
all run :func:`jaxcomm.partial_local_sgd` around the configured optimizer, with
``aggregator: none`` in front of it (each worker steps on its own gradient). The layers are
``models.layer_groups`` of the parameters (for the GPT: ``embed``, ``block_0`` ...,
``head``). The schedule:

* ``local_sgd``: every layer at the last step of each period
  (:func:`jaxcomm.schedules.full_sync_schedule`);
* ``enp``: :func:`jaxcomm.schedules.enp_schedule`;
* ``dreamddp``: :func:`jaxcomm.schedules.dreamddp_schedule` of this model's per-layer backward times
  (:func:`jaxcomm.compute.profile_layers`: the roofline of the compiled backward prefixes on the
  ``compute`` device, or this host's measured times) and per-layer averaging times on the
  network of step 0.

The simulated step follows DreamDDP's timeline (:func:`jaxcomm.schedules.iteration_time`): the
forward, then the backward from the output layer down, each averaged layer's all-reduce
starting once its backward is done and the previous all-reduce has ended; the step ends
when both are done. The forward part is the whole step's compute (its compiled program on
the roofline, or the host's measured time) less the profiled backward, so a step with
nothing to average costs what the synchronous trainer's compute does.

Workers' parameters differ between averagings, so evaluation, the exported
``params.msgpack`` and the summary use the worker-averaged model; every metrics row also
records the model divergence ``mean_k ||w_k - mean(w)||^2`` (DreamDDP's Fig. 5b) and the
step's ``sync_layers``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm
from jaxcomm._src.localsgd import SYNC_SCOPE, layer_comm_s, layer_wires, sync_branch
from jaxcomm._src.network import Network

from .config import Config, DreamDDPSync, ENPSync, LocalSGDSync
from .models import layer_groups
from .programs import AXIS
from .sync import Sync, make_optimizer

if TYPE_CHECKING:
    from .context import Context

__all__ = ["LocalSGD"]


@jax.jit
def _mean_and_divergence(params: Any) -> tuple[Any, jax.Array]:
    """Worker mean of ``[N, ...]`` parameters (kept ``[N, ...]``) and the divergence."""
    mean = jax.tree.map(lambda a: jnp.broadcast_to(a.mean(0, keepdims=True), a.shape), params)
    sq = jax.tree.map(lambda a, m: jnp.sum((a - m) ** 2) / a.shape[0], params, mean)
    return mean, sum(jax.tree.leaves(sq))


@jax.jit
def divergence(params: Any) -> jax.Array:
    """``f32[]``: the divergence of :func:`_mean_and_divergence` alone."""
    return _mean_and_divergence(params)[1]


class LocalSGD(Sync):
    """Local SGD, PLSGD-ENP or DreamDDP around the optimizer (see module)."""

    reads_state = False
    runs = (LocalSGDSync, ENPSync, DreamDDPSync)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        if cfg.sync is None:
            raise ValueError("LocalSGD needs a config with sync settings")
        self.sync = cfg.sync
        self.sync_schedule: jaxcomm.schedules.Schedule | None = None
        self._lag: np.ndarray | None = None  # each worker's time behind the clock (stragglers)
        self._workers = cfg.workers  # the world the profile, schedule and lags describe

    def fingerprint(self) -> dict[str, Any]:
        return {"sync": self.sync.to_dict()}

    # ------------------------------------------------------------------ schedule

    def make_tx(self, ctx: Context) -> optax.GradientTransformation:
        if self.sync_schedule is None:
            n, data = ctx.n, ctx.train_data
            sample = data.get(np.arange(self.cfg.global_batch // n))
            params = jax.eval_shape(lambda k: ctx.task.init(k, sample), jax.random.key(0))
            self.profile = self._profile(ctx, params, sample, layer_groups(params))
            # What the wrapper averages as one message: each layer, or (fused) the whole model.
            self.layers = None if getattr(self.sync, "fused", False) else list(self.profile.names)
            self.layer_wires = layer_wires(params, self.layers, n, reduce=self.sync.reduce)
            self.sync_schedule = self._schedule(self.cfg.network_schedule().at(0))
        wrapper = jaxcomm.partial_local_sgd(
            make_optimizer(self.cfg),
            AXIS,
            schedule=self.sync_schedule,
            layers=self.layers,
            reduce=self.sync.reduce,
        )
        return optax.chain(optax.identity(), wrapper)

    def group_txs(
        self, ctx: Context, units: dict[str, Any], stages: int
    ) -> dict[str, optax.GradientTransformation]:
        """A pipeline's transforms: one wrapper per parameter group (``units``: ``embed``,
        ``blocks``, ``head``, one device's shapes), each averaging its whole group over the
        ``data`` axis at the steps the schedule gives that group.

        The schedule's layers are these groups: every stage averages its own blocks on its
        own devices at the same steps (one SPMD program), the embedding on stage 0 and the
        head on the last stage. DreamDDP partitions them by the unpipelined model's
        profile: each group's backward seconds (a stage's blocks: the blocks' total over
        the stages) and averaging seconds on the network of step 0."""
        if getattr(self.sync, "fused", False):
            raise ValueError(
                f"sync.fused=true with stages={stages}: a pipeline's groups live on different "
                "devices and cannot travel as one message; leave fused out"
            )
        names = list(units)
        if self.sync_schedule is None:
            n, data = ctx.n, ctx.train_data
            sample = data.get(np.arange(self.cfg.global_batch // n))
            params = jax.eval_shape(lambda k: ctx.task.init(k, sample), jax.random.key(0))
            full = self._profile(ctx, params, sample, layer_groups(params))
            per = dict(zip(full.names, full.backward_s, strict=True))
            blocks = sum(v for k, v in per.items() if k not in ("embed", "head")) / stages
            backward = {"embed": per["embed"], "blocks": blocks, "head": per["head"]}
            self.profile = dataclasses.replace(
                full,
                names=tuple(names),
                forward_s=full.forward_s / stages,
                backward_s=tuple(backward[name] for name in names),
                param_bytes=tuple(
                    sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(units[name]))
                    for name in names
                ),
                prefix_s=(),
                spread_s=(),
                params=None,
            )
            self.layers = names
            self.layer_wires = layer_wires(units, names, n, reduce=self.sync.reduce)
            self.sync_schedule = self._schedule(self.cfg.network_schedule().at(0))
        out = {}
        for u, name in enumerate(names):
            own = [(0,) if u in g else () for g in self.sync_schedule.groups]
            wrapper = jaxcomm.partial_local_sgd(
                make_optimizer(self.cfg),
                AXIS,
                schedule=jaxcomm.schedules.as_schedule(own, 1),
                layers=None,
                reduce=self.sync.reduce,
            )
            out[name] = optax.chain(optax.identity(), wrapper)
        return out

    def timeline_backward(self) -> list[float]:
        """Backward seconds of each averaged unit (a layer, or the whole model when fused:
        its one message leaves after the whole backward)."""
        backward = list(self.profile.backward_s)
        return [sum(backward)] if self.layers is None else backward

    def _profile(
        self, ctx: Context, params: Any, sample: dict[str, np.ndarray], names: list[str]
    ) -> jaxcomm.compute.LayerProfile:
        """Per-layer times of one worker's step (its share of the global batch)."""
        loss = lambda p, b: ctx.task.loss(p, b)[0]  # noqa: E731
        device = self.cfg.roofline()  # None: layers timed on this host
        if device is not None:
            batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sample)
            return jaxcomm.compute.profile_layers(loss, params, batch, names, roofline=device)
        real = ctx.task.init(jax.random.key(0), sample)
        profile = jaxcomm.compute.profile_layers(loss, real, sample, names)
        if jax.process_count() > 1:
            # Each host times its own layers; every process must build the same schedule
            # (the same step program), so all take process 0's times.
            from jax.experimental import multihost_utils

            mine = np.array([profile.forward_s, *profile.backward_s], np.float32)
            got = np.asarray(multihost_utils.broadcast_one_to_all(mine), np.float64)
            profile = dataclasses.replace(
                profile, forward_s=float(got[0]), backward_s=tuple(float(v) for v in got[1:])
            )
        return profile

    def _schedule(self, network: Network) -> jaxcomm.schedules.Schedule:
        method, period = self.sync.key, self.sync.period
        num = len(self.layer_wires)
        if method == "local_sgd":
            return jaxcomm.schedules.full_sync_schedule(num, period)
        if method == "enp":
            return jaxcomm.schedules.enp_schedule(num, period)
        return jaxcomm.schedules.dreamddp_schedule(
            self.profile.backward_s,
            layer_comm_s(self.layer_wires, network),
            period,
            forward_s=self.profile.forward_s,
            fill_bubbles=getattr(self.sync, "fill_bubbles", True),
        )

    def checkpoint_extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "workers": self._workers,
            "schedule": [list(g) for g in self.sync_schedule.groups],
            "profile": {"forward_s": self.profile.forward_s, "backward_s": self.profile.backward_s},
        }
        if self._lag is not None:
            out["worker_lag_s"] = [float(v) for v in self._lag]
        return out

    def restore_extras(self, ctx: Context, extras: dict[str, Any]) -> None:
        """A measured profile can differ between processes: resume with the saved profile
        (the clock's forward/backward split), schedule and workers' lags. Saved by another
        number of workers, they describe another world: this one's own profile and schedule
        stay, and the workers start together."""
        saved_workers = extras.get("workers", ctx.n)
        if saved_workers != ctx.n:
            print(
                f"resumed from {saved_workers} workers on {ctx.n}: the profile and the "
                "synchronisation schedule are this world's own, not the checkpoint's",
                flush=True,
            )
            return
        prof = extras.get("profile")
        if prof is not None:
            self.profile = dataclasses.replace(
                self.profile,
                forward_s=float(prof["forward_s"]),
                backward_s=tuple(float(b) for b in prof["backward_s"]),
            )
        if extras.get("worker_lag_s") is not None:
            self._lag = np.asarray(extras["worker_lag_s"], np.float64)
        saved = extras.get("schedule")
        if saved is None:
            return
        schedule = jaxcomm.schedules.as_schedule([tuple(g) for g in saved], len(self.layer_wires))
        if schedule.groups != self.sync_schedule.groups:
            self.sync_schedule = schedule
            ctx.rebuild()

    # ------------------------------------------------------------------ clock

    def step_seconds(self, ctx, traffic, network, step, measured_s):
        """One iteration of DreamDDP's timeline (see module): ``(step, compute, comm)``;
        the layers' wires give the communication (``traffic`` is unused).

        With stragglers each worker runs its local steps at its own pace (its compute
        scaled by its draw) and keeps how far it is behind the clock; a step that averages
        layers waits, layer by layer, for the last worker's backward of that layer (each
        layer's rounds jittered), and every worker leaves it when the last averaging ends.
        A step that averages nothing waits for nobody: the clock is the slowest worker's
        time and the others' lead carries over, so local SGD absorbs stragglers between
        averagings.

        A pipeline keeps its own timeline (GPipe's, then the step's logged averaging):
        None here."""
        if ctx.cfg.stages > 1:
            return None
        group = self.sync_schedule.groups[step % self.sync_schedule.period]
        if ctx.compute_model is None:
            compute = float(measured_s)
        else:
            compute = self.branch_compute_s(ctx, sync_branch(self.sync_schedule, step))
        backward = self.timeline_backward()
        forward = max(compute - sum(backward), 0.0)
        if ctx.stragglers is not None:
            return self._straggled(ctx, group, forward, backward, network, step)
        comm = layer_comm_s(self.layer_wires, network)
        seconds = jaxcomm.schedules.iteration_time(group, forward, backward, comm)
        return seconds, forward + sum(backward), float(sum(comm[layer] for layer in group))

    def _straggled(self, ctx, group, forward, backward, network, step):
        """:meth:`step_seconds` with stragglers: ``(clock advance, compute, comm)``."""
        n, stragglers = ctx.n, ctx.stragglers
        factors = stragglers.compute_factors(step, n)
        start = np.zeros(n) if self._lag is None else -self._lag
        # ends[w, l]: when worker w's backward of layer l ends, from the clock's now.
        ends = np.zeros((n, len(backward)))
        t = start + factors * forward
        for layer in range(len(backward) - 1, -1, -1):
            t = t + factors * backward[layer]
            ends[:, layer] = t
        done, comm = -np.inf, 0.0
        for layer in sorted(group, reverse=True):
            wire = self.layer_wires[layer]
            latency = stragglers.round_latency(step, wire.rounds, n, network, stream=1 + layer)
            seconds = network.wire_seconds(wire.rounds, wire.path_bytes, latency_s=latency)
            done = max(float(ends[:, layer].max()), done) + seconds
            comm += seconds
        local = np.maximum(ends[:, 0], done) if group else ends[:, 0]
        now = float(local.max())
        self._lag = now - local
        return now, float(np.max(factors * (forward + sum(backward)))), comm

    def branch_compute_s(self, ctx: Context, branch: int) -> float:
        """Roofline seconds of the step taking averaging branch ``branch`` (its group's
        averaging arithmetic, not the costliest branch's), on the slowest device."""
        return float(np.max(ctx.modelled_per_device(None, {SYNC_SCOPE: branch})))

    # ------------------------------------------------------------------ the averaged model

    def report(self, ctx: Context, params: Any, opt_state: Any) -> dict[str, Any]:
        # The divergence is computed on the devices beside the step, so that reading it
        # does not stall the loop.
        return {"divergence": divergence(params)}

    def step_extras(self, ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
        group = self.sync_schedule.groups[(ctx.step - 1) % self.sync_schedule.period]
        return {"divergence": float(report["divergence"]), "sync_layers": len(group)}

    def eval_params(self, ctx: Context, params: Any) -> Any:
        mean = _mean_and_divergence(params)[0]
        return jax.tree.map(lambda a: jax.device_put(a, ctx.sharded), mean)

    def summary_extras(self) -> dict[str, Any]:
        return {"schedule": str(self.sync_schedule), "profile": self.profile.method}
