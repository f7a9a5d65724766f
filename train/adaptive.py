"""AR-Topk's adaptive compression ratio as a trainer's controller (``adaptive:`` in a config).

Before each step the :class:`~jaxcomm.adaptive.AdaptiveRatio` controller says whether to
search. A search snapshots the training state in memory (parameters, optimizer state with
the residuals, the data position), trains every candidate ratio for ``trial_steps`` steps
from a copy of it with the collective the network model picks for that ratio, records the
candidate's mean compression gain and its compression time, restores the snapshot, and
takes the knee of the candidates' objectives (by default ``(compression time + modelled
sync time, 1 / gain)``; see :mod:`jaxcomm.adaptive`). When only the
network moved, the choice is redone from the stored trials (sync times are modelled, so no
trial is needed). One jitted step per ``(ratio, collective)`` is compiled on first use and
cached; every step's metrics row records the ratio and collective it ran.

The trial steps happen on the cluster, so their simulated time is added to the clock (the
row after a search reports it as ``search_s``). Compression time is the top-k selection's
time on this host as a multiple of a copy of the gradient, times the ``compute`` device's
copy time (a roofline would charge a sort like one memory pass); with ``compute:
measured`` it is the host time itself.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm
from jaxcomm._src.adaptive import REDUCE, Trial
from jaxcomm._src.network import Network, choose_collective
from jaxcomm._src.sparse import TopKState, ratio_k

from .clock import step_traffic
from .config import Config
from .distributed import to_host
from .sync import Controller, make_aggregator, make_optimizer

if TYPE_CHECKING:
    from .context import Context


__all__ = ["AdaptiveRatio"]


def _copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


class AdaptiveRatio(Controller):
    """AR-Topk's ratio and collective, searched and chosen between steps (see module)."""

    def __init__(self, cfg: Config):
        self.controller = cfg.adaptive_model()
        if self.controller is None:
            raise ValueError("AdaptiveRatio needs a config with adaptive settings")
        self.cfg = self.adjust_config(cfg)
        self._compress: dict[float, float] = {}
        self._event, self._search_s = "", 0.0
        self.last_search_s = 0.0

    def adjust_config(self, cfg: Config) -> Config:
        """Before the first search the step runs the first candidate ratio, unless the
        config names one."""
        if cfg.aggregator.ratio is not None:
            return cfg
        agg = cfg.aggregator.model_copy(update={"ratio": self.controller.candidates[0]})
        return cfg.model_copy(update={"aggregator": agg})

    def start(self, ctx: Context) -> None:
        """Size the search to the trainer's model: leave out candidate ratios whose
        ``k = ratio * d`` would round to 0 entries (a small model with the paper's 0.001),
        saying so; none left is an error."""
        d = ctx.layout.smallest_group(ctx)
        self._dense_bytes = ctx.layout.synced_bytes(ctx)
        keep = tuple(c for c in self.controller.candidates if c * d >= 1.0)
        if not keep:
            raise ValueError(
                f"adaptive: every candidate ratio {self.controller.candidates} gives k = 0 of "
                f"this model's {d} parameters; give candidates of at least 1/{d}"
            )
        if keep != self.controller.candidates:
            dropped = [c for c in self.controller.candidates if c not in keep]
            print(f"adaptive: candidates {dropped} left out: k = ratio x {d} parameters < 1")
            self.controller.candidates = keep

    # ------------------------------------------------------------------ programs

    def program_key(self, ctx: Context) -> tuple[float, str]:
        c = self.controller
        if c.ratio is None:  # before the first search: the config's own setting
            agg = self.cfg.aggregator
            return float(agg.ratio), "ring" if agg.reduce == "auto" else agg.reduce
        return c.ratio, c.collective

    def make_tx(self, ctx: Context, key: tuple[float, str]) -> optax.GradientTransformation:
        agg = self.cfg.aggregator.model_copy(update={"ratio": key[0], "reduce": key[1]})
        return optax.chain(make_aggregator(self.cfg.model_copy(update={"aggregator": agg})),
                           make_optimizer(self.cfg))  # fmt: skip

    # ------------------------------------------------------------------ search

    def compress_seconds(self, ctx: Context, ratio: float) -> float:
        """Seconds of one top-k selection of this model's gradient at ``ratio``.

        Measured on this host as a multiple of a copy of the same array; with a ``compute``
        device that multiple is applied to the device's copy time (its roofline), since
        a roofline charges a sort like one pass over memory and would rank selection
        methods wrongly. Measured once per process and kept in checkpoints, so a resumed
        run chooses with the same figures.
        """
        if ratio not in self._compress:
            d = self._dense_bytes // 4
            k = max(1, ratio_k(ratio, d))
            method = self.cfg.aggregator.method
            select_s, copy_s = _agreed(_selection_cost(d, k, method))
            if ctx.compute_model is None:
                self._compress[ratio] = select_s
            else:
                x = jax.ShapeDtypeStruct((d,), jnp.float32)
                copy = jax.jit(jnp.copy).lower(x).compile()
                model = ctx.compute_model
                device_copy = model.seconds(jaxcomm.audit.program_cost(copy).per_device())[0]
                self._compress[ratio] = float(select_s / copy_s * device_copy)
        return self._compress[ratio]

    def search(self, ctx: Context, network: Network) -> list[Trial]:
        """Try every candidate from a snapshot of the trainer's state, restore it, choose
        the knee.

        Returns the trials; the parameters, optimizer state (residuals included) and data
        position are exactly as before. The trial steps' simulated seconds are added to the
        clock and kept in ``last_search_s``.
        """
        params, opt_state = ctx.params, ctx.opt_state
        position = ctx.loader.position
        trials, seconds = [], 0.0
        for c, ratio in enumerate(self.controller.candidates):
            key = (ratio, REDUCE[choose_collective(self._dense_bytes, ctx.n, ratio, network)])
            p, s = _copy(params), _copy(opt_state)
            gains = []
            for i in range(self.controller.trial_steps):
                p, s, finite, logs, measured, program = ctx.layout.trial_step(ctx, key, p, s)
                if not finite:
                    break  # a candidate that diverges is not a candidate
                gains.append(_gain(s))
                measured = _agreed([measured])[0]
                # Trial steps run on the cluster beside the numbered ones: their own
                # straggler draws (stream 2 + candidate), not those of the steps that follow.
                seconds += ctx.simulate_logged(
                    step_traffic(to_host(logs)),
                    network,
                    ctx.step + i,
                    measured_s=measured,
                    key=program,
                    stream=2 + c,
                )[0]
            else:
                trials.append(
                    Trial(ratio, float(np.mean(gains)), self.compress_seconds(ctx, ratio))
                )
            ctx.loader.restore({"position": position, "seed": self.cfg.seed})
        ctx.params, ctx.opt_state = params, opt_state
        if not trials:
            raise FloatingPointError(
                f"step {ctx.step + 1}: every candidate ratio became non-finite in its "
                f"trial; {ctx.checkpoint_note()}"
            )
        self.controller.record(trials, ctx.step)
        self.controller.choose(self._dense_bytes, ctx.n, network)
        ctx.clock.advance(seconds)
        self.last_search_s = seconds
        return trials

    # ------------------------------------------------------------------ hooks

    def before_step(self, ctx: Context) -> None:
        network = ctx.schedule.at(ctx.step)
        due = self.controller.due(ctx.step, network)
        self._event, self._search_s = due or "", 0.0
        if due == "search":
            self.search(ctx, network)
            self._search_s = self.last_search_s
        elif due == "choose":
            self.controller.choose(self._dense_bytes, ctx.n, network)

    def after_step(self, ctx: Context) -> None:
        # The controller reads each step's gain before it decides on the next step.
        self.controller.observe(_gain(ctx.opt_state))

    def step_extras(self, ctx: Context, report: dict[str, Any]) -> dict[str, Any]:
        ratio, collective = self.program_key(ctx)
        return {
            "ratio": ratio,
            "collective": collective,
            "search": self._event,
            "search_s": self._search_s,
        }

    def checkpoint_extras(self) -> dict[str, Any]:
        table = [[r, s] for r, s in self._compress.items()]
        return {"adaptive": self.controller.state_dict(), "compress_s": table}

    def restore_extras(self, ctx: Context, extras: dict[str, Any]) -> None:
        if "adaptive" not in extras:
            raise ValueError(
                "the checkpoint holds no adaptive-ratio state; it was not written by an "
                "adaptive run, so it cannot be resumed as one"
            )
        self.controller.load_state_dict(extras["adaptive"])
        self._compress = {float(r): float(s) for r, s in extras.get("compress_s", [])}

    def summary_extras(self) -> dict[str, Any]:
        return {"ratio": self.controller.ratio, "collective": self.controller.collective}


_SELECTION_COSTS: dict[tuple[int, int, str], tuple[float, float]] = {}


def _agreed(values: Any) -> tuple[float, ...]:
    """Host measurements as every process takes them: process 0's (each process times its
    own host, but all must make the same choice and so run the same programs)."""
    values = tuple(float(v) for v in values)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    got = multihost_utils.broadcast_one_to_all(np.asarray(values, np.float32))
    return tuple(float(v) for v in np.asarray(got))


def _selection_cost(d: int, k: int, method: str, rounds: int = 5) -> tuple[float, float]:
    """Median host seconds of ``topk_indices`` of ``d`` float32 entries and of a copy of
    them, in interleaved rounds (cached per process)."""
    key = (d, k, method)
    if key not in _SELECTION_COSTS:
        x = jnp.asarray(np.random.default_rng(0).standard_normal(d, dtype=np.float32))
        select = (
            jax.jit(lambda v: jaxcomm.codecs.topk_indices(v, k, method=method)).lower(x).compile()
        )
        copy = jax.jit(jnp.copy).lower(x).compile()
        times: dict[str, list[float]] = {"select": [], "copy": []}
        for _ in range(rounds + 1):
            for name, f in (("select", select), ("copy", copy)):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x))
                times[name].append(time.perf_counter() - t0)
        _SELECTION_COSTS[key] = (
            statistics.median(times["select"][1:]),
            statistics.median(times["copy"][1:]),
        )
    return _SELECTION_COSTS[key]


def _gain(opt_state: Any) -> float:
    """Mean compression gain over workers of the AR-Topk state inside ``opt_state``."""
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, TopKState)):
        if isinstance(s, TopKState):
            return float(np.mean(to_host(s.gain)))
    raise ValueError("the optimizer state holds no AR-Topk state")
