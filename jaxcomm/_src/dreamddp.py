"""DreamDDP scheduler: which layers to average at which local step of a local-SGD period.

DreamDDP ("DreamDDP: Accelerating Data Parallel Distributed LLM Training with Layer-wise
Scheduled Partial Synchronization", Sec. 3.3-3.4, Algorithm 2) runs local SGD with period
``H`` and, instead of averaging the whole model every ``H`` steps, averages a different part of
it at every local step: at step ``h`` the parameters of the layers in ``groups[h]`` are averaged
across workers right after their own backward pass, overlapping with the backward pass of the
layers below them. This module is the host-side planner: a time model of one period, the
paper's depth-first search (DFS) over layer-to-step assignments, an exact brute-force reference,
the paper's baselines, and bubble filling. It is plain Python/NumPy and runs no JAX code.

Conventions. Layers are 0-based from the input (0) to the output (``L - 1``); backward runs
``L - 1, ..., 0``. ``backward_s[l]`` and ``comm_s[l]`` are the seconds of layer ``l``'s backward
pass and of averaging its parameters; ``forward_s`` is one iteration's whole forward pass. A
:class:`Schedule` over a period of ``H`` local steps holds ``groups[h]``, the layers averaged at
step ``h = 0..H-1``, each group sorted in backward (descending) order. The paper's partitions
are contiguous in backward order with ``groups[0]`` on the output side, e.g. ``L = 6, H = 3``:
``((5, 4), (3, 2), (1, 0))``; after bubble filling a layer may be in several groups.

Time model of one iteration with group ``G`` (seconds from the iteration's start): the forward
pass takes ``forward_s``; backward then runs layer by layer, layer ``l`` ending at
``forward_s + sum(backward_s[l:])``. The averagings of ``G`` run one at a time in backward
order; layer ``l``'s starts at ``max(end of l's backward, end of the previous averaging)`` and
takes ``comm_s[l]``. The iteration ends at ``max(forward_s + sum(backward_s), end of the last
averaging)``; a period costs the sum over its ``H`` iterations (so the order of the groups does
not matter). This is the dependency structure of the paper's Eq. 7, simulated event by event.

Interpretations of, and deviations from, the paper:

* The DFS (:func:`dreamddp_schedule`) follows ``SolveSubProblem`` of Algorithm 2 rule for rule
  (all placed; last group takes the rest; at-least-one; optimal hiding; delayed
  communication-overflow assignment; otherwise branch). The hiding window of group ``h`` is
  ``t_BP^{L_h:H} - t_BP^{h0}``: the backward time of every layer not placed in an earlier group,
  less that of the group's first (output-most) layer ``h0``; the group's communication is the
  plain sum of its layers' ``comm_s``. Both sums are exactly rounded (``math.fsum``).
* Algorithm 2's line 30 recurses with ``h - 1``; that is a typo for ``h + 1`` (the "delay"
  branch, as in line 24 and Fig. 8), which is what is implemented.
* Among the DFS's solutions the one with the shortest period under the event model above is
  chosen, not the one minimising the paper's interval approximation (Eq. 8).
* The DFS's solution set is not listed one by one: in Algorithm 2 what happens after a group is
  closed depends only on the next layer and the next step, so the set is a path set through a
  small graph and its minimum is found by a forward dynamic programme over it (each path's
  period summed in the same order as :func:`simulate_period`, hence bit-identical). The set is
  exactly that of the literal recursion, kept as ``_solve_subproblem`` and checked against in
  the tests; the literal recursion may list up to ``2 ** (H - 1)`` solutions, the programme
  costs ``O(L ** 3 + H ** 2 * L)``. Ties go to the solution the recursion finds first (larger
  groups on the output side), up to float rounding of equal-valued prefixes.
* Bubble filling (Sec. 3.4, Algorithm 2 lines 3-5) adds to each group the largest output-side
  suffix ``{L-1, ..., l}`` of layers that holds no layer of the group (line 4's
  "``min_l t_COMM^{L..l}``" read as "the smallest such ``l``") such that the iteration does not
  get longer, tested with the exact :func:`iteration_time` instead of the interval form of
  Eq. 12. Bubble filling therefore never lengthens a period.
* :func:`brute_force_schedule` returns the exact minimum over all ``C(L+H-1, H-1)`` contiguous
  partitions into ``H`` possibly empty groups, found by a dynamic programme over interval costs
  (exact because every group's cost depends only on its own interval) rather than by listing
  them.
* Layers and steps are 0-based here (the paper counts ``1..L`` and ``1..H``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxcomm._src._checks import check_float, check_int

__all__ = [
    "Schedule",
    "StepTimeline",
    "as_schedule",
    "brute_force_schedule",
    "dreamddp_schedule",
    "enp_schedule",
    "full_sync_schedule",
    "iteration_time",
    "period_timeline",
    "simulate_period",
]


# --------------------------------------------------------------------------- formatting


def _ranges(layers: Sequence[int]) -> str:
    """``(7, 6, 5, 3, 1, 0)`` -> ``"7-5,3,1-0"``; ``()`` -> ``"-"`` (descending input)."""
    if not layers:
        return "-"
    runs: list[list[int]] = []
    for layer in layers:
        if runs and runs[-1][-1] == layer + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


# --------------------------------------------------------------------------- Schedule


def _as_list(name: str, value: Any, what: str) -> list[Any]:
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of {what}, got {value!r}")
    try:
        return list(value)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {what}, got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Which layers are averaged at which local step of a period of ``H`` steps.

    Attributes:
      groups: ``groups[h]`` (``h = 0..H-1``) is the tuple of layer indices (0 = input layer)
        whose parameters are averaged at local step ``h``, stored in descending (backward)
        order; a group may be empty, and a layer may be in several groups but at most once in
        each. Any sequence of sequences of ints is accepted and normalised.
      num_layers: ``L``, the number of layers; every layer ``0..L-1`` must be in some group.
    """

    groups: tuple[tuple[int, ...], ...]
    num_layers: int

    def __post_init__(self) -> None:
        n = check_int("num_layers", self.num_layers, lo=1)
        raw = _as_list("groups", self.groups, "groups of layer indices")
        if not raw:
            raise ValueError(
                "groups must hold at least one group (one per local step, period >= 1), got "
                f"{self.groups!r}"
            )
        out = []
        covered: set[int] = set()
        for h, g in enumerate(raw):
            members = _as_list(f"groups[{h}]", g, "layer indices")
            seen: set[int] = set()
            for v in members:
                layer = check_int(f"groups[{h}] layer index", v, lo=0, hi=n - 1)
                if layer in seen:
                    raise ValueError(
                        f"groups[{h}] holds layer {layer} twice; a layer is averaged at most "
                        f"once per step, got {g!r}"
                    )
                seen.add(layer)
            covered |= seen
            out.append(tuple(sorted(seen, reverse=True)))
        missing = sorted(set(range(n)) - covered, reverse=True)
        if missing:
            raise ValueError(
                f"groups must average every layer 0..{n - 1} at least once per period; layers "
                f"{_ranges(missing)} are in no group (groups={tuple(out)})"
            )
        object.__setattr__(self, "num_layers", n)
        object.__setattr__(self, "groups", tuple(out))

    @property
    def period(self) -> int:
        """``H``, the number of local steps in one period (``len(groups)``)."""
        return len(self.groups)

    def steps_of(self, layer: int) -> tuple[int, ...]:
        """The local steps ``h`` (ascending) at which ``layer`` is averaged."""
        layer = check_int("layer", layer, lo=0, hi=self.num_layers - 1)
        return tuple(h for h, g in enumerate(self.groups) if layer in g)

    def __str__(self) -> str:
        body = " | ".join(f"h{h}: {_ranges(g)}" for h, g in enumerate(self.groups))
        return f"Schedule(L={self.num_layers}, H={self.period}): {body}"


def as_schedule(schedule_or_groups: Any, num_layers: int | None = None) -> Schedule:
    """A :class:`Schedule` from a ``Schedule`` or a plain sequence of groups of layer indices.

    ``num_layers`` defaults to the largest index plus one for plain groups; when given with a
    ``Schedule`` it must match the schedule's ``num_layers``.
    """
    if isinstance(schedule_or_groups, Schedule):
        if num_layers is not None:
            n = check_int("num_layers", num_layers, lo=1)
            if n != schedule_or_groups.num_layers:
                raise ValueError(
                    f"num_layers must match the schedule's {schedule_or_groups.num_layers} "
                    f"layers, got {n}"
                )
        return schedule_or_groups
    if num_layers is None:
        groups = _as_list("groups", schedule_or_groups, "groups of layer indices")
        top = -1
        for h, g in enumerate(groups):
            for v in _as_list(f"groups[{h}]", g, "layer indices"):
                top = max(top, check_int(f"groups[{h}] layer index", v, lo=0))
        if top < 0:
            raise ValueError(
                "num_layers cannot be inferred from groups that hold no layer index; pass "
                f"num_layers (got groups={schedule_or_groups!r})"
            )
        num_layers = top + 1
    return Schedule(schedule_or_groups, num_layers)


# --------------------------------------------------------------------------- time model


def _times(name: str, values: Any) -> tuple[float, ...]:
    """Per-layer seconds as a tuple of finite floats >= 0 (at least one layer)."""
    if hasattr(values, "__array__") and not isinstance(values, (list, tuple)):
        arr = np.asarray(values)  # NumPy / JAX arrays: Python scalars via tolist()
        if arr.ndim != 1:
            raise ValueError(
                f"{name} must be one-dimensional (seconds per layer), got shape {arr.shape}"
            )
        values = arr.tolist()
    seq = _as_list(name, values, "seconds per layer (index 0 = input layer)")
    if not seq:
        raise ValueError(f"{name} must hold at least one layer's seconds, got {values!r}")
    return tuple(check_float(f"{name}[{i}]", v, lo=0.0) for i, v in enumerate(seq))


def _profile(backward_s: Any, comm_s: Any) -> tuple[tuple[float, ...], tuple[float, ...]]:
    b = _times("backward_s", backward_s)
    c = _times("comm_s", comm_s)
    if len(b) != len(c):
        raise ValueError(
            f"comm_s must have one entry per layer like backward_s ({len(b)} layers), got "
            f"{len(c)} entries"
        )
    return b, c


def _forward(forward_s: Any) -> float:
    if hasattr(forward_s, "__array__") and np.ndim(forward_s) == 0:
        forward_s = np.asarray(forward_s).item()  # a 0-d NumPy / JAX array
    return check_float("forward_s", forward_s, lo=0.0)


def _period(period: Any) -> int:
    return check_int("period", period, lo=1)


def _backward_ends(forward_s: float, b: Sequence[float]) -> list[float]:
    """``ends[l]``: when layer ``l``'s backward ends, from the iteration's start."""
    ends = [0.0] * len(b)
    t = forward_s
    for layer in range(len(b) - 1, -1, -1):
        t += b[layer]
        ends[layer] = t
    return ends


def _iter_time(group: Sequence[int], ends: Sequence[float], c: Sequence[float]) -> float:
    """Iteration seconds of a validated group sorted in descending order."""
    done = 0.0
    for layer in group:
        done = max(ends[layer], done) + c[layer]
    return max(ends[0], done)


def _interval_times(ends: Sequence[float], c: Sequence[float]) -> list[list[float]]:
    """``t[top][low]``: iteration seconds of group ``(top, top-1, ..., low)``, ``low <= top``.

    Same operations in the same order as :func:`_iter_time`, so the values are bit-identical.
    """
    L = len(c)
    table = []
    for top in range(L):
        row = [0.0] * (top + 1)
        done = 0.0
        for low in range(top, -1, -1):
            done = max(ends[low], done) + c[low]
            row[low] = max(ends[0], done)
        table.append(row)
    return table


def _checked_group(group: Any, num_layers: int) -> tuple[int, ...]:
    members = _as_list("group", group, "layer indices")
    seen: set[int] = set()
    for v in members:
        layer = check_int("group layer index", v, lo=0, hi=num_layers - 1)
        if layer in seen:
            raise ValueError(f"group holds layer {layer} twice, got {group!r}")
        seen.add(layer)
    return tuple(sorted(seen, reverse=True))


def _checked_schedule(schedule: Any, num_layers: int) -> Schedule:
    if isinstance(schedule, Schedule):
        if schedule.num_layers != num_layers:
            raise ValueError(
                f"schedule must cover as many layers as backward_s ({num_layers}), got a "
                f"schedule with num_layers={schedule.num_layers}"
            )
        return schedule
    return as_schedule(schedule, num_layers)


def iteration_time(
    group: Sequence[int], forward_s: float, backward_s: Sequence[float], comm_s: Sequence[float]
) -> float:
    """Seconds of one iteration that averages the layers of ``group`` (see the module model).

    Args:
      group: layer indices averaged in this iteration (any order, no repeats; may be empty).
      forward_s: seconds of the whole forward pass.
      backward_s: ``[L]`` seconds of each layer's backward pass (index 0 = input layer).
      comm_s: ``[L]`` seconds of averaging each layer's parameters.
    """
    b, c = _profile(backward_s, comm_s)
    f = _forward(forward_s)
    return _iter_time(_checked_group(group, len(b)), _backward_ends(f, b), c)


def simulate_period(
    schedule: Schedule | Sequence[Sequence[int]],
    forward_s: float,
    backward_s: Sequence[float],
    comm_s: Sequence[float],
) -> float:
    """Seconds of one period: the sum of :func:`iteration_time` over ``schedule``'s groups.

    ``schedule`` is a :class:`Schedule` over ``len(backward_s)`` layers or a plain sequence of
    groups; the sum is taken left to right (step 0 first).
    """
    b, c = _profile(backward_s, comm_s)
    f = _forward(forward_s)
    sched = _checked_schedule(schedule, len(b))
    ends = _backward_ends(f, b)
    total = 0.0
    for g in sched.groups:
        total += _iter_time(g, ends, c)
    return total


@dataclasses.dataclass(frozen=True)
class StepTimeline:
    """Events of one local step of a period; every time is seconds from the period's start.

    Attributes:
      step: the local step ``h``.
      group: layers averaged at this step (descending).
      start, end: when the iteration starts and ends (``end - start`` is its
        :func:`iteration_time` up to rounding).
      forward: ``(start, end)`` of the forward pass.
      backward: layer -> ``(start, end)`` of its backward pass, for every layer.
      averaging: layer -> ``(start, end)`` of its averaging, for the layers of ``group``.
    """

    step: int
    group: tuple[int, ...]
    start: float
    end: float
    forward: tuple[float, float]
    backward: dict[int, tuple[float, float]]
    averaging: dict[int, tuple[float, float]]

    @property
    def duration(self) -> float:
        """``end - start``, seconds."""
        return self.end - self.start


def period_timeline(
    schedule: Schedule | Sequence[Sequence[int]],
    forward_s: float,
    backward_s: Sequence[float],
    comm_s: Sequence[float],
) -> list[StepTimeline]:
    """The event timeline of one period, one :class:`StepTimeline` per local step (for plots)."""
    b, c = _profile(backward_s, comm_s)
    f = _forward(forward_s)
    sched = _checked_schedule(schedule, len(b))
    ends = _backward_ends(f, b)
    out = []
    t0 = 0.0
    for h, g in enumerate(sched.groups):
        backward = {}
        prev = f
        for layer in range(len(b) - 1, -1, -1):
            backward[layer] = (t0 + prev, t0 + ends[layer])
            prev = ends[layer]
        averaging = {}
        done = 0.0
        for layer in g:
            start = max(ends[layer], done)
            done = start + c[layer]
            averaging[layer] = (t0 + start, t0 + done)
        duration = _iter_time(g, ends, c)
        out.append(StepTimeline(h, g, t0, t0 + duration, (t0, t0 + f), backward, averaging))
        t0 += duration
    return out


# --------------------------------------------------------------------------- baselines


def enp_schedule(num_layers: int, period: int) -> Schedule:
    """PLSGD-ENP (the paper's Example 1): contiguous groups in backward order, ``groups[0]``
    on the output side, sizes differing by at most one with the bigger groups first (groups
    are empty when ``period > num_layers``).

    The paper's Example 1 numbers the groups from the input side (``L_1 = {1, 2}``); here
    they run in backward order, as Algorithm 2's search does (its first group starts at the
    output layer). The period's time is the same either way (it does not depend on the
    order of the groups); which step averages which layers is mirrored."""
    n = check_int("num_layers", num_layers, lo=1)
    H = _period(period)
    q, r = divmod(n, H)
    groups, top = [], n - 1
    for h in range(H):
        size = q + 1 if h < r else q
        groups.append(tuple(range(top, top - size, -1)))
        top -= size
    return Schedule(tuple(groups), n)


def full_sync_schedule(num_layers: int, period: int) -> Schedule:
    """FLSGD: every layer averaged at the last local step ``H - 1``, other steps average none."""
    n = check_int("num_layers", num_layers, lo=1)
    H = _period(period)
    return Schedule(((),) * (H - 1) + (tuple(range(n - 1, -1, -1)),), n)


def _contiguous(tops_lows: Sequence[tuple[int, int]], period: int, n: int) -> Schedule:
    """Schedule from ``(top, low)`` intervals (``low = top + 1`` is empty), padded with empties."""
    groups = [tuple(range(top, low - 1, -1)) for top, low in tops_lows]
    groups += [()] * (period - len(groups))
    return Schedule(tuple(groups), n)


def brute_force_schedule(
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    period: int,
    *,
    forward_s: float = 0.0,
) -> Schedule:
    """The exact shortest period over all contiguous partitions in backward order.

    Candidates: every split of layers ``L-1, ..., 0`` into ``H = period`` consecutive, possibly
    empty groups with ``groups[0]`` on the output side (``C(L+H-1, H-1)`` of them). Each
    group's iteration time depends only on its own interval, so a forward dynamic programme over
    "groups used, layers placed" (``O(H * L**2)``, periods summed left to right exactly like
    :func:`simulate_period`) returns the exact minimum of :func:`simulate_period`. Ties go to
    the partition with the lexicographically largest group sizes (bigger output-side groups).

    Args:
      backward_s, comm_s: ``[L]`` seconds per layer (index 0 = input layer).
      period: ``H >= 1``.
      forward_s: seconds of the forward pass (adds the same to every candidate).
    """
    b, c = _profile(backward_s, comm_s)
    f = _forward(forward_s)
    H = _period(period)
    L = len(b)
    ends = _backward_ends(f, b)
    table = _interval_times(ends, c)
    empty = ends[0]
    # best[p]: (cost, negated sizes, intervals) with p layers placed from the output side.
    best: list[tuple[float, tuple[int, ...], tuple[tuple[int, int], ...]] | None]
    best = [None] * (L + 1)
    best[0] = (0.0, (), ())
    for h in range(H):
        new: list[Any] = [None] * (L + 1)
        lo = L if h == H - 1 else 0  # the last group must take every remaining layer
        for q in range(lo, L + 1):
            for p in range(q + 1):
                prev = best[p]
                if prev is None:
                    continue
                cost = prev[0] + (empty if p == q else table[L - 1 - p][L - q])
                key = (cost, prev[1] + (p - q,))
                if new[q] is None or key < new[q][:2]:
                    new[q] = (*key, prev[2] + ((L - 1 - p, L - q),))
        best = new
    return _contiguous(best[L][2], H, L)


# --------------------------------------------------------------------------- DFS (Algorithm 2)


def _solve_subproblem(
    b: Sequence[float], c: Sequence[float], period: int
) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Algorithm 2's ``SolveSubProblem`` taken literally: yield every solution, in DFS order.

    Iterative (an explicit stack), so any ``L`` is fine; the number of solutions is at most
    ``2 ** (H - 1)`` because every branch is followed by a move to the next group. Reference
    for :func:`_dfs_best` (used by the tests and the benchmark).
    """
    L, H = len(b), period
    stack: list[tuple[tuple[tuple[int, ...], ...], int, int]] = [(((),) * H, L - 1, 0)]

    def put(groups: tuple[tuple[int, ...], ...], h: int, layer: int) -> Any:
        return groups[:h] + (groups[h] + (layer,),) + groups[h + 1 :]

    while stack:
        groups, layer, h = stack.pop()
        if layer < 0:  # every layer placed
            yield groups
            continue
        if h == H - 1:  # the last group takes every remaining layer
            yield groups[:h] + (groups[h] + tuple(range(layer, -1, -1)),)
            continue
        g = groups[h]
        if not g:  # at-least-one assignment (Property 3)
            stack.append((put(groups, h, layer), layer - 1, h))
            continue
        placed = {x for gg in groups[:h] for x in gg}
        window = math.fsum(b[x] for x in range(L) if x not in placed) - b[g[0]]
        if window >= math.fsum(c[x] for x in (*g, layer)):  # optimal hiding (Property 1)
            stack.append((put(groups, h, layer), layer - 1, h))
        elif window < math.fsum(c[x] for x in g):  # delayed CO assignment (Property 2)
            stack.append((groups, layer, h + 1))
        else:  # search both ways; the "put" branch is explored first (pushed last)
            # Algorithm 2 line 30 recurses with h - 1: a typo for h + 1 (delay the layer to the
            # next group, as in line 24).
            stack.append((groups, layer, h + 1))
            stack.append((put(groups, h, layer), layer - 1, h))


def _group_exits(top: int, b: Sequence[float], c: Sequence[float]) -> list[tuple[int, int]]:
    """Ways Algorithm 2 closes a non-last group that it opened with layer ``top``.

    Returns ``[(low, next_layer), ...]`` (the group is ``top..low``, the search goes on with
    ``next_layer`` at the next step; ``-1`` = every layer placed), in DFS order. The window
    ``sum(b[0..top]) - b[top]`` is fixed for the group, so this depends on ``top`` alone.
    """
    window = math.fsum(b[: top + 1]) - b[top]
    k = top - 1
    while k >= 0 and window >= math.fsum(c[k : top + 1]):  # optimal hiding
        k -= 1
    if k < 0:
        return [(0, -1)]
    if window < math.fsum(c[k + 1 : top + 1]):  # delayed CO assignment
        return [(k + 1, k)]
    # Branch: put k (the next layer is then always delayed, the group overflowing), or delay k.
    return [(k, k - 1), (k + 1, k)]


def _dfs_best(
    b: Sequence[float], c: Sequence[float], period: int, forward_s: float
) -> tuple[Schedule, int]:
    """The shortest-period solution of Algorithm 2's search, and how many solutions it has.

    A forward dynamic programme over the search's states "next layer, next step" (the search
    after closing a group depends only on them): the minimum is over exactly the solutions
    :func:`_solve_subproblem` lists, with each period summed left to right like
    :func:`simulate_period` (float addition is monotone, so the minimum is exact).
    """
    L, H = len(b), period
    ends = _backward_ends(forward_s, b)
    table = _interval_times(ends, c)
    empty = ends[0]
    exits: dict[int, list[tuple[int, int]]] = {}
    # states[next_layer]: (cost so far, negated sizes, intervals, number of paths)
    states: dict[int, tuple[float, tuple[int, ...], tuple[tuple[int, int], ...], int]]
    states = {L - 1: (0.0, (), (), 1)}
    best: tuple[float, tuple[int, ...], tuple[tuple[int, int], ...]] | None = None
    count = 0
    for h in range(H):
        nxt: dict[int, Any] = {}
        for top in sorted(states, reverse=True):
            cost, neg, ivs, n_paths = states[top]
            finals = []
            if top < 0:  # all placed: the remaining steps average nothing
                for _ in range(h, H):
                    cost += empty
                finals.append((cost, neg + (0,) * (H - h), ivs))
            elif h == H - 1:
                finals.append((cost + table[top][0], neg + (-(top + 1),), (*ivs, (top, 0))))
            else:
                if top not in exits:
                    exits[top] = _group_exits(top, b, c)
                for low, after in exits[top]:
                    key = (cost + table[top][low], neg + (low - top - 1,))
                    old = nxt.get(after)
                    if old is None or key < old[:2]:
                        nxt[after] = (*key, (*ivs, (top, low)), n_paths + (old[3] if old else 0))
                    else:
                        nxt[after] = (*old[:3], old[3] + n_paths)
            for final in finals:
                count += n_paths
                if best is None or final[:2] < best[:2]:
                    best = final
        states = nxt
    assert best is not None
    return _contiguous(best[2], H, L), count


def _fill_bubbles(sched: Schedule, ends: Sequence[float], c: Sequence[float]) -> Schedule:
    """Add to each group the largest output-side suffix that keeps its iteration as long.

    The iteration time of ``suffix + group`` can only grow as the suffix grows (one more
    averaging ahead of the others can only delay them, and float max/+ are monotone), so the
    scan stops at the first suffix that lengthens the iteration.
    """
    L = sched.num_layers
    out = []
    for g in sched.groups:
        base = _iter_time(g, ends, c)
        lowest = g[0] + 1 if g else 0  # the suffix may hold no layer of the group
        keep = L
        for low in range(L - 1, lowest - 1, -1):
            if _iter_time((*range(L - 1, low - 1, -1), *g), ends, c) > base:
                break
            keep = low
        out.append((*range(L - 1, keep - 1, -1), *g))
    return Schedule(tuple(out), L)


def dreamddp_schedule(
    backward_s: Sequence[float],
    comm_s: Sequence[float],
    period: int,
    *,
    forward_s: float = 0.0,
    fill_bubbles: bool = True,
) -> Schedule:
    """DreamDDP's schedule: Algorithm 2's DFS, then (optionally) bubble filling (Sec. 3.4).

    The DFS assigns layers ``L-1, ..., 0`` to steps ``0, ..., H-1`` with the paper's three
    pruning rules and keeps, among its solutions, the one with the shortest
    :func:`simulate_period` (the exact event timeline, not the paper's interval approximation
    Eq. 8); see the module docstring for the details and every deviation. With
    ``fill_bubbles`` every group then also averages the largest output-side suffix of layers
    it does not hold whose averaging keeps that iteration's :func:`iteration_time` unchanged,
    so the period is never longer and output-side layers may be averaged several times.

    Args:
      backward_s, comm_s: ``[L]`` seconds per layer (index 0 = input layer).
      period: ``H >= 1`` local steps per period.
      forward_s: seconds of one forward pass.
      fill_bubbles: add the extra averagings of Sec. 3.4.
    """
    b, c = _profile(backward_s, comm_s)
    f = _forward(forward_s)
    H = _period(period)
    if not isinstance(fill_bubbles, bool):
        raise TypeError(f"fill_bubbles must be a bool, got {fill_bubbles!r}")
    sched, _ = _dfs_best(b, c, H, f)
    if fill_bubbles:
        sched = _fill_bubbles(sched, _backward_ends(f, b), c)
    return sched
