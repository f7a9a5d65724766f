"""The pipeline's simulated step: GPipe's timeline per data replica, then the data axis.

Each replica's pipeline runs :func:`jaxcomm.pipeline.gpipe_timeline`: stage ``s`` spends ``f_s``
and ``b_s`` per microbatch (its program's forward and backward ops on the roofline, divided
by the ``M + S - 1`` ticks the program runs; see :meth:`GPipeClock.tick_seconds`) and each
message takes ``latency + bytes / bandwidth``; the rest of the stage's compute (optimizer,
embedding and head updates) follows it, and the data-parallel collectives (the traffic
beyond the pipeline's messages: an aggregator's, or a sync wrapper's averaging at its
scheduled steps) are added after it, with or without ``overlap`` (they share the links with
the pipeline's messages, which with ``overlap`` proceed beside the compute). Stragglers
scale each device's compute and jitter each message's latency (drawn per message).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomm
from jaxcomm._src.network import Network
from jaxcomm._src.pipeline import FIRST_SCOPE, LAST_SCOPE

from .programs import costed

if TYPE_CHECKING:
    from .context import Context
    from .pipeline_layout import Pipeline

__all__ = ["GPipeClock"]

_COST_FIELDS = ("flops", "matmul_flops", "transcendentals", "hbm_bytes")


class GPipeClock:
    """Simulated time of pipeline layout ``p``'s steps (costs cached per program key)."""

    def __init__(self, p: Pipeline):
        self.p = p
        self._ticks: dict[Any, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._busy: dict[Any, np.ndarray] = {}

    def clear(self) -> None:
        """Forget every cost (the programs were rebuilt)."""
        self._ticks.clear()
        self._busy.clear()

    def step_seconds(
        self,
        ctx: Context,
        key: Any,
        traffic: jaxcomm.audit.Traffic,
        network: Network,
        step: int,
        *,
        overlap: bool,
        branches: Any,
        stream: int,
    ) -> tuple[float, float, float]:
        """``(step, compute, comm)`` seconds of step ``step`` (0-based) of program ``key``
        with per-device ``traffic`` (see the module docstring). ``compute`` is the slowest
        device's modelled compute, ``comm`` the busiest device's communication; ``stream``
        > 0 draws stragglers independently of the step's own draws."""
        p, cfg = self.p, self.p.cfg
        n_stages, devices = p.stages, cfg.workers * p.stages
        f, b, rest = self.tick_seconds(ctx, key, branches)
        ticks = cfg.microbatches + n_stages - 1
        fw_msg, bw_msg = self.message_bytes(key)
        factors = np.ones(devices)
        p2p_rounds = 2 * (ticks - 1)
        # Each message's latency: [replica, direction, boundary, microbatch], drawn per
        # message with stragglers' jitter.
        shape = (cfg.workers, 2, max(n_stages - 1, 0), cfg.microbatches)
        # A step's own draws are streams 0 (compute, messages) and 1 (the data-parallel
        # rounds); a trial step's stream s > 0 draws from 2s and 2s + 1.
        own, rounds_stream = (0, 1) if not stream else (2 * stream, 2 * stream + 1)
        stragglers = ctx.stragglers
        if stragglers is not None:
            factors = stragglers.compute_factors(step, devices, stream=own)
            lat = stragglers.message_latencies(step, shape, network, stream=own)
        else:
            lat = np.full(shape, network.latency_s)
        latency = float(lat.mean()) if lat.size else network.latency_s
        pipes = []
        for r in range(cfg.workers):
            idx = r * n_stages + np.arange(n_stages)
            line = jaxcomm.pipeline.gpipe_timeline(
                n_stages,
                cfg.microbatches,
                f[idx] * factors[idx],
                b[idx] * factors[idx],
                network.wire_seconds(1, fw_msg, latency_s=lat[r, 0]),
                network.wire_seconds(1, bw_msg, latency_s=lat[r, 1]),
                overlap=overlap,
            )
            pipes.append(line.seconds + float(np.max(rest[idx] * factors[idx])))
        rounds = traffic.rounds - p2p_rounds
        path = traffic.path_bytes - (ticks - 1) * (fw_msg + bw_msg)
        if (rounds < 0).any() or (path < 0).any():
            raise ValueError(
                "the step's traffic holds fewer rounds or bytes than its pipeline messages: "
                f"rounds {traffic.rounds.tolist()}, path bytes {traffic.path_bytes.tolist()}"
            )
        busiest = int(np.argmax(network.wire_seconds(rounds, path)))
        if stragglers is not None:
            lat = stragglers.round_latency(
                step, int(rounds[busiest]), cfg.workers, network, stream=rounds_stream
            )
        else:
            lat = int(rounds[busiest]) * network.latency_s
        other = network.wire_seconds(rounds[busiest], float(path[busiest]), latency_s=lat)
        # The data-parallel collectives follow the backward, after the pipeline's own
        # messages on the same links; ``overlap`` hides messages behind compute, not behind
        # other messages.
        seconds = max(pipes) + other
        compute = float(np.max((self.tick_busy(ctx, key, branches) + rest) * factors))
        p2p = network.wire_seconds(
            p2p_rounds, (ticks - 1) * (fw_msg + bw_msg), latency_s=p2p_rounds * latency
        )
        return seconds, compute, p2p + other

    def message_bytes(self, key: Any) -> tuple[int, int]:
        """Bytes of one forward and one backward boundary message in boundary mode ``key``."""
        p = self.p
        g, cfg = p.gpt_cfg, p.cfg
        mb = cfg.global_batch // (cfg.workers * cfg.microbatches)
        act = jax.ShapeDtypeStruct((mb, g.seq_len, g.width), jnp.float32)
        seen = p.split_key(key)[0]
        return jaxcomm.pipeline.boundary_message_bytes(p.boundary, act, bool(seen))

    def tick_seconds(
        self, ctx: Context, key: Any, branches: Any = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per device (mesh order), roofline seconds of one forward tick, one backward tick
        and the rest of the step.

        The pipeline program's ops are split by their JAX op names: the differentiated
        loss's forward (``jvp(...)``, the ticks with their residual writes) and backward
        (``transpose(...)``), and the rest (optimizer update, finite checks); ops without a
        name (the CPU backend's library fusions, e.g. attention's batched products) are
        shared between forward and backward in proportion to their matrix flops. Each part
        is put on the roofline by itself (a forward may be bound by compute and an update by
        memory), the ticks' parts divided by the ``M + S - 1`` ticks the program runs; the
        embedding's and head's programs join the rest. ``branches`` resolves conditionals
        (e.g. an aggregator's) as in :meth:`Layout.step_audit`. The first stage's input
        function and the last stage's loss run inside the ticks under a ``lax.cond`` on the
        stage, which the cost model counts at its costliest branch on every device; their
        ops (named :data:`~jaxcomm.pipeline.FIRST_SCOPE` and ``LAST_SCOPE``) are taken out
        again where they do not run: the input function runs on every tick of stage 0
        only, the loss on the ``M`` ticks of the last stage that carry a microbatch, so the
        last stage's ``f`` and ``b`` hold one loss per microbatch."""
        # A bare boundary mode means the controller's current program: cached under both.
        cache = (self.p.split_key(key), tuple(sorted((branches or {}).items())))
        if cache in self._ticks:
            return self._ticks[cache]
        p = self.p
        model, n = ctx.compute_model, p.mesh.devices.size
        ticks = p.cfg.microbatches + p.stages - 1
        f, b, rest = np.zeros(n), np.zeros(n), np.zeros(n)
        main, *owned = p.step_programs(ctx, key)
        cost = costed(main[0])

        def mine(c):
            return {k: v for k, v in (branches or {}).items() if c._matches(k)}

        def part(select):
            return cost.per_device(mine(cost), select=select)

        def combine(*terms):
            return jaxcomm.audit.ComputeCost(
                **{k: sum(w * getattr(c, k) for w, c in terms) for k in _COST_FIELDS}
            )

        stage = np.arange(n) % p.stages
        first = (stage == 0).astype(np.float64)  # the input function: every tick of stage 0
        last = (stage == p.stages - 1).astype(np.float64)

        def split(last_share):
            """Forward, backward and other costs with the stage conditionals' ops kept at
            ``last_share`` of its counted executions on each device (the input function at
            its own share; the program counts each at its costliest branch everywhere)."""
            total = part(None)
            fw = part(lambda op: "jvp(" in op and "transpose(" not in op)
            bw = part(lambda op: "transpose(" in op)
            for scope, share_run in ((FIRST_SCOPE, first), (LAST_SCOPE, last_share)):
                extra = 1.0 - share_run
                in_fw = part(
                    lambda op, sc=scope: sc in op and "jvp(" in op and "transpose(" not in op
                )
                in_bw = part(lambda op, sc=scope: sc in op and "transpose(" in op)
                fw = combine((1, fw), (-extra, in_fw))
                bw = combine((1, bw), (-extra, in_bw))
                total = combine((1, total), (-extra, in_fw), (-extra, in_bw))
            unnamed = part(lambda op: op == "")
            share = fw.matmul_flops / np.maximum(fw.matmul_flops + bw.matmul_flops, 1.0)
            other = combine((1, total), (-1, fw), (-1, bw), (-1, unnamed))
            fw, bw = combine((1, fw), (share, unnamed)), combine((1, bw), (1 - share, unnamed))
            return fw, bw, other

        # Per microbatch (the timeline's f and b): the loss runs once per microbatch on the
        # last stage, so it counts fully there; the program itself runs it on M of its
        # ticks only, which is what its compute time counts.
        fw, bw, other = split(last)
        f[main[1]] += model.seconds(fw) / ticks
        b[main[1]] += model.seconds(bw) / ticks
        rest[main[1]] += model.seconds(other)
        fw, bw, _ = split(last * p.cfg.microbatches / ticks)
        busy = np.zeros(n)
        busy[main[1]] += model.seconds(fw) + model.seconds(bw)
        self._busy[cache] = busy
        for program, index in owned:
            c = costed(program)
            rest[index] += model.seconds(c.per_device(mine(c)))
        self._ticks[cache] = (f, b, rest)
        return self._ticks[cache]

    def tick_busy(self, ctx: Context, key: Any, branches: Any = None) -> np.ndarray:
        """Per device, roofline seconds of all the ticks of the program (the loss counted
        on the ``M`` ticks that run it), the compute the step's ``compute`` reports."""
        self.tick_seconds(ctx, key, branches)
        return self._busy[(self.p.split_key(key), tuple(sorted((branches or {}).items())))]
