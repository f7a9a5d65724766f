"""Data-parallel training with a sync wrapper around the optimizer (``sync:`` in a config).

Local SGD (FLSGD), partial local SGD with an equal-number partition (PLSGD-ENP) and DreamDDP
all run :func:`jaxcomm.partial_local_sgd` around the configured optimizer, with
``aggregator: none`` in front of it (each worker steps on its own gradient). The layers are
``models.layer_groups`` of the parameters (for the GPT: ``embed``, ``block_0`` ...,
``head``). The schedule:

* ``local_sgd``: every layer at the last step of each period
  (:func:`jaxcomm.full_sync_schedule`);
* ``enp``: :func:`jaxcomm.enp_schedule`;
* ``dreamddp``: :func:`jaxcomm.dreamddp_schedule` of this model's per-layer backward times
  (:func:`jaxcomm.profile_layers`: the roofline of the compiled backward prefixes on the
  ``compute`` device, or this host's measured times) and per-layer averaging times on the
  network of step 0.

The simulated step follows DreamDDP's timeline (:func:`jaxcomm.iteration_time`): the
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm
from jaxcomm.localsgd import SYNC_SCOPE, layer_comm_s, layer_wires, sync_branch
from jaxcomm.network import Network
from models import layer_groups
from train.config import Config
from train.distributed import to_host
from train.trainer import AXIS, Trainer, make_optimizer

__all__ = ["LocalSGDTrainer"]


@jax.jit
def _mean_and_divergence(params: Any) -> tuple[Any, jax.Array]:
    """Worker mean of ``[N, ...]`` parameters (kept ``[N, ...]``) and the divergence."""
    mean = jax.tree.map(lambda a: jnp.broadcast_to(a.mean(0, keepdims=True), a.shape), params)
    sq = jax.tree.map(lambda a, m: jnp.sum((a - m) ** 2) / a.shape[0], params, mean)
    return mean, sum(jax.tree.leaves(sq))


@jax.jit
def _divergence(params: Any) -> jax.Array:
    """``f32[]``: the divergence of :func:`_mean_and_divergence` alone."""
    return _mean_and_divergence(params)[1]


class LocalSGDTrainer(Trainer):
    """:class:`~train.trainer.Trainer` with a local SGD sync wrapper (see module)."""

    def __init__(self, cfg: Config, **kwargs: Any):
        self.sync = cfg.sync_settings()
        self.compute_device = cfg.roofline()  # None: layers timed on this host
        if not self.sync:
            raise ValueError("LocalSGDTrainer needs a config with sync settings")
        super().__init__(cfg, **kwargs)

    # ------------------------------------------------------------------ schedule

    def _make_tx(self) -> optax.GradientTransformation:
        sample = self.train_data.get(np.arange(self.cfg.global_batch // self.n))
        params = jax.eval_shape(lambda k: self.task.init(k, sample), jax.random.key(0))
        self.profile = self._profile(params, sample, layer_groups(params))
        # What the wrapper averages as one message: each layer, or (fused) the whole model.
        self.layers = None if self.sync["fused"] else list(self.profile.names)
        self.layer_wires = layer_wires(params, self.layers, self.n, reduce=self.sync["reduce"])
        self._branch_s: dict[int, float] = {}
        self.sync_schedule = self._schedule(self.cfg.network_schedule().at(0))
        return self._wrap(self.sync_schedule)

    def _wrap(self, schedule: jaxcomm.Schedule) -> optax.GradientTransformation:
        wrapper = jaxcomm.partial_local_sgd(
            make_optimizer(self.cfg),
            AXIS,
            schedule=schedule,
            layers=self.layers,
            reduce=self.sync["reduce"],
        )
        return optax.chain(optax.identity(), wrapper)

    def timeline_backward(self) -> list[float]:
        """Backward seconds of each averaged unit (a layer, or the whole model when fused:
        its one message leaves after the whole backward)."""
        backward = list(self.profile.backward_s)
        return [sum(backward)] if self.layers is None else backward

    def _profile(
        self, params: Any, sample: dict[str, np.ndarray], names: list[str]
    ) -> jaxcomm.LayerProfile:
        """Per-layer times of one worker's step (its share of the global batch)."""
        loss = lambda p, b: self.task.loss(p, b)[0]  # noqa: E731
        if self.compute_device is not None:
            batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), sample)
            return jaxcomm.profile_layers(loss, params, batch, names, roofline=self.compute_device)
        real = self.task.init(jax.random.key(0), sample)
        profile = jaxcomm.profile_layers(loss, real, sample, names)
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

    def _schedule(self, network: Network) -> jaxcomm.Schedule:
        method, period = self.sync["method"], self.sync["period"]
        num = len(self.layer_wires)
        if method == "local_sgd":
            return jaxcomm.full_sync_schedule(num, period)
        if method == "enp":
            return jaxcomm.enp_schedule(num, period)
        return jaxcomm.dreamddp_schedule(
            self.profile.backward_s,
            layer_comm_s(self.layer_wires, network),
            period,
            forward_s=self.profile.forward_s,
            fill_bubbles=self.sync["fill_bubbles"],
        )

    def _checkpoint_extras(self) -> dict[str, Any]:
        return {
            "schedule": [list(g) for g in self.sync_schedule.groups],
            "profile": {"forward_s": self.profile.forward_s, "backward_s": self.profile.backward_s},
        }

    def _restore_extras(self, extras: dict[str, Any]) -> None:
        """A measured profile can differ between processes: resume with the saved profile
        (the clock's forward/backward split) and schedule."""
        prof = extras.get("profile")
        if prof is not None:
            self.profile = dataclasses.replace(
                self.profile,
                forward_s=float(prof["forward_s"]),
                backward_s=tuple(float(b) for b in prof["backward_s"]),
            )
        saved = extras.get("schedule")
        if saved is None:
            return
        schedule = jaxcomm.as_schedule([tuple(g) for g in saved], len(self.layer_wires))
        if schedule.groups != self.sync_schedule.groups:
            self.sync_schedule = schedule
            self.tx = self._wrap(schedule)
            self._train_step = self._build_step()
            self._step_program = None
            self._modelled.clear()
            self._branch_s.clear()

    # ------------------------------------------------------------------ clock

    def simulate_logged(self, traffic, network, step, *, measured_s, key=None, stream=0):
        """One iteration of DreamDDP's timeline (see module): ``(step, compute, comm)``
        (``traffic`` and ``stream`` are unused: the layers' wires give the communication, and
        a config with sync has no stragglers)."""
        group = self.sync_schedule.groups[step % self.sync_schedule.period]
        if self.compute_model is None:
            compute = float(measured_s)
        else:
            compute = self.branch_compute_s(sync_branch(self.sync_schedule, step))
        backward = self.timeline_backward()
        forward = max(compute - sum(backward), 0.0)
        comm = layer_comm_s(self.layer_wires, network)
        seconds = jaxcomm.iteration_time(group, forward, backward, comm)
        return seconds, forward + sum(backward), float(sum(comm[layer] for layer in group))

    def branch_compute_s(self, branch: int) -> float:
        """Roofline seconds of the step taking averaging branch ``branch`` (its group's
        averaging arithmetic, not the costliest branch's), on the slowest device."""
        if branch not in self._branch_s:
            per = self._modelled_per_device(None, {SYNC_SCOPE: branch})
            self._branch_s[branch] = float(np.max(per))
        return self._branch_s[branch]

    # ------------------------------------------------------------------ the averaged model

    def _report(self, params: Any, opt_state: Any) -> dict[str, Any]:
        # The divergence is computed on the devices beside the step, so that reading it
        # does not stall the loop.
        return {**super()._report(params, opt_state), "divergence": _divergence(params)}

    def _step_extras(self, report: dict[str, Any]) -> dict[str, Any]:
        group = self.sync_schedule.groups[(self.step - 1) % self.sync_schedule.period]
        div = float(report["divergence"])
        return {**super()._step_extras(report), "divergence": div, "sync_layers": len(group)}

    def _eval_params(self) -> Any:
        mean = _mean_and_divergence(self.params)[0]
        return jax.tree.map(lambda a: jax.device_put(a, self.sharded), mean)

    def model_params(self) -> Any:
        """The worker-averaged model in the model's own layout."""
        return jax.tree.map(lambda a: a[0], to_host(self._eval_params()))

    def _summary_extras(self) -> dict[str, Any]:
        return {"schedule": str(self.sync_schedule), "profile": self.profile.method}
