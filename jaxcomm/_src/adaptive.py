"""Adaptive compression ratio for AR-Topk (Sec. IV-C of the AR-Topk paper), host side.

The paper picks the compression ratio ``c`` as the knee of a three-objective Pareto front,
``min (t_comp(c), t_sync(c), 1 / gain(c))``, over candidates ``{0.1, 0.033, 0.011, 0.004,
0.001}``: each candidate is trained for a few steps from an in-memory snapshot that is
restored afterwards, giving its compression gain and compression time; its sync time is
the alpha-beta cost of the cheapest collective (AG, ART-ring or ART-tree) on the current
network. The search runs again when the gain of the current ratio moves by more than a
threshold (10% in the paper), and the choice (ratio and collective) is redone with the
stored gains when latency or bandwidth moves past a threshold.

This module holds the decision logic, independent of any trainer:
:func:`non_dominated` and :func:`knee` choose among measured candidates, and
:class:`AdaptiveRatio` keeps the measurements and says when to search. The trainer
(``train.adaptive``) runs the trials and owns the snapshot.

The paper solves the choice with NSGA-II (pymoo). With five discrete candidates an exact
non-dominated sort is the answer NSGA-II approximates (a genetic search only pays off when
the decision space is too large to enumerate), so jaxcomm sorts exactly.

Two deviations, both with the paper's form kept available:

* ``objectives="step"`` (default) uses two objectives, ``(t_comp + t_sync, 1 / gain)``:
  both times add to the step, and what a ratio costs is their sum; as separate objectives a
  selection time of a fraction of a millisecond would weigh as much as a sync time of
  100 ms. ``objectives="paper"`` keeps the three.
* The knee is the front point nearest the ideal after dividing each objective by its
  largest value on the front (``normalize="max"``). The usual min-max normalisation
  (``normalize="range"``) is blind to a constant added to an objective and to its units,
  so latency and bandwidth would never change the chosen ratio (only the collective):
  a sync time of ``3 alpha + b c / B`` scales to the same ``[0, 1]`` values on every
  network. Scaling by the largest value keeps proportions: when latency dominates, the
  sync times of the candidates differ by a few percent and the gain decides (a high ratio);
  when bandwidth dominates, they differ many-fold and a low ratio wins.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jaxcomm._src._checks import check_float, check_int
from jaxcomm._src.network import Network, choose_collective, collective_time

__all__ = [
    "CANDIDATES",
    "NORMALIZE",
    "OBJECTIVES",
    "AdaptiveRatio",
    "Trial",
    "knee",
    "non_dominated",
]

CANDIDATES = (0.1, 0.033, 0.011, 0.004, 0.001)
# choose_collective's names -> the reduce argument of jaxcomm.ar_topk and the log kind.
REDUCE = {"allgather": "allgather", "art_ring": "ring", "art_tree": "tree"}
_KIND = {"allgather": "ag_topk", "art_ring": "art_ring", "art_tree": "art_tree"}


def non_dominated(points: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the points no other point dominates (all objectives minimised).

    ``a`` dominates ``b`` when ``a <= b`` in every objective and ``a < b`` in one. Exact,
    ``O(P^2)`` comparisons; equal points are all kept.
    """
    pts = [tuple(float(v) for v in p) for p in points]
    if any(math.isnan(v) for p in pts for v in p):
        raise ValueError(f"points must not hold NaN; got {pts}")

    def dominates(a, b):
        return all(x <= y for x, y in zip(a, b, strict=True)) and a != b

    return [i for i, p in enumerate(pts) if not any(dominates(q, p) for q in pts)]


NORMALIZE = ("max", "range")
OBJECTIVES = ("step", "paper")


def knee(points: Sequence[Sequence[float]], *, normalize: str = "max") -> int:
    """Index of the knee of the Pareto front of ``points`` (all objectives minimised).

    The knee is the front point nearest the ideal point ``(0, ..., 0)`` after each objective
    is scaled over the front; ties go to the lower index.

    Args:
      points: ``[P][D]`` objective values.
      normalize: ``"max"`` divides each objective by its largest value on the front (values
        must be ``>= 0``), so an objective keeps its proportions: one that barely moves
        across the front, such as a sync time dominated by latency, weighs little.
        ``"range"`` maps each objective's ``[min, max]`` over the front to ``[0, 1]``, the
        usual normalisation of multi-objective decision making; it is blind to a constant
        added to an objective, so a latency-dominated sync time weighs as much as a
        bandwidth-dominated one. An objective equal on the whole front scales to 0.
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}; got {normalize!r}")
    if not points:
        raise ValueError("points must hold at least one candidate")
    front = non_dominated(points)
    dims = len(points[0])
    hi = [max(points[i][j] for i in front) for j in range(dims)]
    if normalize == "max":
        if any(points[i][j] < 0 for i in front for j in range(dims)):
            raise ValueError(f"normalize='max' needs objectives >= 0; got {points}")
        lo = [0.0] * dims
    else:
        lo = [min(points[i][j] for i in front) for j in range(dims)]

    def scaled(i):
        return [
            (points[i][j] - lo[j]) / (hi[j] - lo[j]) if hi[j] > lo[j] else 0.0 for j in range(dims)
        ]

    return min(front, key=lambda i: (sum(v * v for v in scaled(i)), i))


@dataclasses.dataclass(frozen=True)
class Trial:
    """What a candidate ratio's trial measured.

    Attributes:
      ratio: the candidate compression ratio.
      gain: mean compression gain over the trial steps and workers, in ``(0, 1]``.
      compress_s: seconds of one top-k selection at this ratio.
    """

    ratio: float
    gain: float
    compress_s: float


def _moved(new: float, old: float, threshold: float) -> bool:
    if old == 0.0:
        return new != 0.0
    return abs(new - old) > threshold * abs(old)


class AdaptiveRatio:
    """When to search for a new compression ratio and which one to take (host side).

    Args:
      candidates: ratios in ``(0, 1]`` to choose from (the paper's by default).
      trial_steps: steps each candidate trains for in a search (the paper: 10); also the
        window of the current ratio's mean gain that the gain trigger watches.
      gain_threshold: a search runs when that mean gain moves by more than this share of
        the reference gain (the paper: 0.1). The reference is the chosen ratio's own mean
        gain in training, over the window that follows a first window of warm-up after the
        choice, not its trial gain: a trial starts from the residual of another ratio, so
        its gain differs from the steady state by more than 10% on its own, and compared
        with it the trigger would fire at every ``min_interval``.
      network_threshold: the choice is redone, with the stored trials, when latency or
        bandwidth moves by more than this share of the values it was made for.
      min_interval: steps after a search before the gain may trigger another.
      objectives: ``"step"`` chooses on ``(compress_s + sync_s, 1 / gain)``, ``"paper"`` on
        ``(compress_s, sync_s, 1 / gain)`` (see the module docstring).
      normalize: how :func:`knee` scales the objectives, ``"max"`` or ``"range"``.
    """

    def __init__(
        self,
        candidates: Sequence[float] = CANDIDATES,
        *,
        trial_steps: int = 10,
        gain_threshold: float = 0.1,
        network_threshold: float = 0.1,
        min_interval: int = 50,
        objectives: str = "step",
        normalize: str = "max",
    ):
        cands = tuple(candidates)
        if not cands:
            raise ValueError("candidates must hold at least one ratio in (0, 1]")
        self.candidates = tuple(
            check_float(f"candidates[{i}]", c, lo=0.0, hi=1.0, lo_open=True)
            for i, c in enumerate(cands)
        )
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"candidates must be distinct ratios; got {cands!r}")
        self.trial_steps = check_int("trial_steps", trial_steps, lo=1)
        self.gain_threshold = check_float("gain_threshold", gain_threshold, lo=0.0, lo_open=True)
        self.network_threshold = check_float(
            "network_threshold", network_threshold, lo=0.0, lo_open=True
        )
        self.min_interval = check_int("min_interval", min_interval, lo=0)
        if objectives not in OBJECTIVES:
            raise ValueError(f"objectives must be one of {OBJECTIVES}; got {objectives!r}")
        if normalize not in NORMALIZE:
            raise ValueError(f"normalize must be one of {NORMALIZE}; got {normalize!r}")
        self.objectives, self.normalize = objectives, normalize
        self.trials: dict[float, Trial] = {}
        self.ratio: float | None = None
        self.collective: str | None = None
        self.network: Network | None = None  # what the choice was made for
        self.last_search = -(10**9)
        self.gains: list[float] = []
        self.observed = 0  # steps observed since the last choice
        self.reference: float | None = None  # the chosen ratio's settled gain

    # ------------------------------------------------------------------ decisions

    def due(self, step: int, network: Network) -> str | None:
        """What to do before ``step``: ``"search"`` (run the trials), ``"choose"`` (choose
        again from the stored trials for ``network``) or ``None``."""
        if not self.trials:
            return "search"
        window = self.gains[-self.trial_steps :]
        if (
            self.reference is not None
            and len(window) == self.trial_steps
            and step - self.last_search >= self.min_interval
            and _moved(sum(window) / len(window), self.reference, self.gain_threshold)
        ):
            return "search"
        net = self.network
        if _moved(network.latency_s, net.latency_s, self.network_threshold) or _moved(
            network.bandwidth_bps, net.bandwidth_bps, self.network_threshold
        ):
            return "choose"
        return None

    def sync_s(self, ratio: float, nbytes: int, n: int, network: Network) -> tuple[str, float]:
        """The cheapest collective for ``ratio`` and its modelled seconds."""
        best = choose_collective(nbytes, n, ratio, network)
        return best, collective_time(_KIND[best], nbytes, n, network, ratio=ratio)

    def choose(self, nbytes: int, n: int, network: Network) -> tuple[float, str]:
        """Take the knee of the objectives (see ``objectives``) over the stored trials for a
        gradient of ``nbytes`` dense bytes on ``n`` workers and ``network``; returns and
        keeps ``(ratio, reduce)`` (``reduce`` as :func:`jaxcomm.ar_topk` takes it)."""
        if not self.trials:
            raise ValueError("no trials yet: run a search (record the trials) first")
        ratios = [c for c in self.candidates if c in self.trials]
        points, picks = [], []
        for c in ratios:
            kind, sync = self.sync_s(c, nbytes, n, network)
            t = self.trials[c]
            inv_gain = 1.0 / max(t.gain, 1e-30)
            if self.objectives == "step":
                points.append((t.compress_s + sync, inv_gain))
            else:
                points.append((t.compress_s, sync, inv_gain))
            picks.append(kind)
        i = knee(points, normalize=self.normalize)
        self.ratio, self.collective, self.network = ratios[i], REDUCE[picks[i]], network
        self.gains, self.observed, self.reference = [], 0, None
        return self.ratio, self.collective

    def record(self, trials: Sequence[Trial], step: int) -> None:
        """Store a search's trials (made before ``step``)."""
        self.trials = {t.ratio: t for t in trials}
        self.last_search = step

    def observe(self, gain: float) -> None:
        """The current ratio's gain after a training step (mean over workers)."""
        self.gains = (self.gains + [float(gain)])[-self.trial_steps :]
        self.observed += 1
        if self.observed == 2 * self.trial_steps:  # one window of warm-up, then the reference
            self.reference = sum(self.gains) / len(self.gains)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (trials, current choice, what it was made for, gain window)."""
        net = self.network
        return {
            "trials": [dataclasses.asdict(t) for t in self.trials.values()],
            "ratio": self.ratio,
            "collective": self.collective,
            "network": None if net is None else [net.latency_s, net.bandwidth_bps],
            "last_search": self.last_search,
            "gains": list(self.gains),
            "observed": self.observed,
            "reference": self.reference,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.trials = {t["ratio"]: Trial(**t) for t in state["trials"]}
        self.ratio, self.collective = state["ratio"], state["collective"]
        net = state["network"]
        self.network = None if net is None else Network(*net)
        self.last_search = int(state["last_search"])
        self.gains = [float(g) for g in state["gains"]]
        self.observed = int(state.get("observed", len(self.gains)))
        ref = state.get("reference")
        self.reference = None if ref is None else float(ref)
