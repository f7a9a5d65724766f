"""Data-parallel training with AR-Topk's adaptive compression ratio (``adaptive:`` in a config).

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

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomm
from jaxcomm.adaptive import REDUCE, Trial
from jaxcomm.network import Network, choose_collective
from jaxcomm.sparse import TopkState, ratio_k
from train.config import Config
from train.trainer import Trainer, checked, host_finite, make_optimizer, step_traffic

__all__ = ["AdaptiveTrainer"]


def _copy(tree: Any) -> Any:
    return jax.tree.map(jnp.copy, tree)


class AdaptiveTrainer(Trainer):
    """:class:`~train.trainer.Trainer` whose AR-Topk ratio and collective adapt (see module)."""

    def __init__(self, cfg: Config, **kwargs: Any):
        if jax.process_count() > 1:
            raise ValueError(
                f"the adaptive-ratio trainer runs in one process (this run has "
                f"{jax.process_count()}): its trial steps time the host; run it without "
                "train.launch"
            )
        self.controller = cfg.adaptive_model()
        if self.controller is None:
            raise ValueError("AdaptiveTrainer needs a config with adaptive settings")
        if "ratio" not in cfg.aggregator_args:  # the searches choose it
            args = {**cfg.aggregator_args, "ratio": self.controller.candidates[0]}
            cfg = dataclasses.replace(cfg, aggregator_args=args)
        self._steps: dict[tuple[float, str], Any] = {}
        self._compress: dict[float, float] = {}
        self._event, self._search_s = "", 0.0
        super().__init__(cfg, **kwargs)
        self._dense_bytes = 4 * self.num_params()
        self._drop_empty_candidates()

    def _drop_empty_candidates(self) -> None:
        """Leave out candidate ratios whose ``k = ratio * d`` would round to 0 entries on this
        model (a small model with the paper's 0.001), saying so; none left is an error."""
        d = self.num_params()
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

    def _program_key(self) -> tuple[float, str]:
        c = self.controller
        if c.ratio is None:  # before the first search: the config's own setting
            args = self.cfg.aggregator_args
            reduce = args.get("reduce", "ring")
            return float(args["ratio"]), "ring" if reduce == "auto" else reduce
        return c.ratio, c.collective

    def _tx(self, key: tuple[float, str]) -> optax.GradientTransformation:
        args = {k: v for k, v in self.cfg.aggregator_args.items() if k != "network"}
        args.update(ratio=key[0], reduce=key[1])
        return optax.chain(jaxcomm.ar_topk("data", **args), make_optimizer(self.cfg))

    def _program(self, key: tuple[float, str]) -> Any:
        if key not in self._steps:
            batch = self._put_batch(self.train_data.get(self.loader.batch_ids(0)))
            step = self._build_step(self._tx(key))
            self._steps[key] = checked(step.lower(self.params, self.opt_state, batch).compile())
        return self._steps[key]

    def _compile(self) -> Any:
        # Each step runs the program of the ratio and collective chosen before it.
        return None

    def step_programs(self, key: Any = None) -> list[tuple[Any, np.ndarray]]:
        key = self._program_key() if key is None else key
        return [(self._program(key), np.arange(self.n))]

    def _step_once(self, compiled: Any) -> tuple:
        return super()._step_once(self._program(self._program_key()))

    # ------------------------------------------------------------------ search

    def compress_seconds(self, ratio: float) -> float:
        """Seconds of one top-k selection of this model's gradient at ``ratio``.

        Measured on this host as a multiple of a copy of the same array; with a ``compute``
        device that multiple is applied to the device's copy time (its roofline), since
        a roofline charges a sort like one pass over memory and would rank selection
        methods wrongly. Measured once per process and kept in checkpoints, so a resumed
        run chooses with the same figures.
        """
        if ratio not in self._compress:
            d = self.num_params()
            k = max(1, ratio_k(ratio, d))
            method = self.cfg.aggregator_args.get("method", "auto")
            select_s, copy_s = _selection_cost(d, k, method)
            if self.compute_model is None:
                self._compress[ratio] = select_s
            else:
                x = jax.ShapeDtypeStruct((d,), jnp.float32)
                copy = jax.jit(jnp.copy).lower(x).compile()
                device_copy = self.compute_model.seconds(jaxcomm.program_cost(copy).per_device())[0]
                self._compress[ratio] = float(select_s / copy_s * device_copy)
        return self._compress[ratio]

    def search(self, network: Network) -> list[Trial]:
        """Try every candidate from a snapshot of the state, restore it, choose the knee.

        Returns the trials; the parameters, optimizer state (residuals included) and data
        position are exactly as before. The trial steps' simulated seconds are added to the
        clock and kept in ``last_search_s``.
        """
        params, opt_state, position = self.params, self.opt_state, self.loader.position
        trials, seconds = [], 0.0
        for c, ratio in enumerate(self.controller.candidates):
            key = (ratio, REDUCE[choose_collective(self._dense_bytes, self.n, ratio, network)])
            program = self._program(key)
            p, s = _copy(params), _copy(opt_state)
            gains = []
            for i in range(self.controller.trial_steps):
                batch = self._put_batch(self.loader.next())
                t0 = time.perf_counter()
                p, s, _, finite, _ = program(p, s, batch)
                jax.block_until_ready((p, s))
                measured = time.perf_counter() - t0
                if not host_finite(finite):
                    break  # a candidate that diverges is not a candidate
                gains.append(_gain(s))
                traffic = step_traffic(jaxcomm.network.find_logs(s))
                # Trial steps run on the cluster beside the numbered ones: their own
                # straggler draws (stream 2 + candidate), not those of the steps that follow.
                seconds += self.simulate_logged(
                    traffic, network, self.step + i, measured_s=measured, key=key, stream=2 + c
                )[0]
            else:
                trials.append(Trial(ratio, float(np.mean(gains)), self.compress_seconds(ratio)))
            self.loader.restore({"position": position, "seed": self.cfg.seed})
        self.params, self.opt_state = params, opt_state
        if not trials:
            raise FloatingPointError(
                f"step {self.step + 1}: every candidate ratio became non-finite in its trial; "
                f"{self._checkpoint_note()}"
            )
        self.controller.record(trials, self.step)
        self.controller.choose(self._dense_bytes, self.n, network)
        self.clock.advance(seconds)
        self.last_search_s = seconds
        return trials

    # ------------------------------------------------------------------ hooks

    def _before_step(self) -> None:
        network = self.schedule.at(self.step)
        due = self.controller.due(self.step, network)
        self._event, self._search_s = due or "", 0.0
        if due == "search":
            self.search(network)
            self._search_s = self.last_search_s
        elif due == "choose":
            self.controller.choose(self._dense_bytes, self.n, network)

    def _after_step(self) -> None:
        self.controller.observe(_gain(self.opt_state))

    def _lags(self) -> bool:
        # The controller reads each step's gain before it decides on the next step.
        return False

    def _step_extras(self, report: dict[str, Any]) -> dict[str, Any]:
        ratio, collective = self._program_key()
        return {
            **super()._step_extras(report),
            "ratio": ratio,
            "collective": collective,
            "search": self._event,
            "search_s": self._search_s,
        }

    def _checkpoint_extras(self) -> dict[str, Any]:
        return {"adaptive": self.controller.state_dict(), "compress_s": self._compress_table()}

    def _compress_table(self) -> list[list[float]]:
        return [[r, s] for r, s in self._compress.items()]

    def _restore_extras(self, extras: dict[str, Any]) -> None:
        if "adaptive" not in extras:
            raise ValueError(
                "the checkpoint holds no adaptive-ratio state; it was not written by an "
                "adaptive run, so it cannot be resumed as one"
            )
        self.controller.load_state_dict(extras["adaptive"])
        self._compress = {float(r): float(s) for r, s in extras.get("compress_s", [])}

    def _summary_extras(self) -> dict[str, Any]:
        return {"ratio": self.controller.ratio, "collective": self.controller.collective}


_SELECTION_COSTS: dict[tuple[int, int, str], tuple[float, float]] = {}


def _selection_cost(d: int, k: int, method: str, rounds: int = 5) -> tuple[float, float]:
    """Median host seconds of ``topk_indices`` of ``d`` float32 entries and of a copy of
    them, in interleaved rounds (cached per process)."""
    key = (d, k, method)
    if key not in _SELECTION_COSTS:
        x = jnp.asarray(np.random.default_rng(0).standard_normal(d, dtype=np.float32))
        select = jax.jit(lambda v: jaxcomm.topk_indices(v, k, method=method)).lower(x).compile()
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
    for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, TopkState)):
        if isinstance(s, TopkState):
            return float(np.mean(np.asarray(s.gain)))
    raise ValueError("the optimizer state holds no AR-Topk state")
