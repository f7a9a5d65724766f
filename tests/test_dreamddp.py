"""Tests for the DreamDDP scheduler: time model, DFS (Algorithm 2), brute force, bubble filling."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm._src.dreamddp import (
    Schedule,
    StepTimeline,
    _dfs_best,
    _solve_subproblem,
    as_schedule,
    brute_force_schedule,
    dreamddp_schedule,
    enp_schedule,
    full_sync_schedule,
    iteration_time,
    period_timeline,
    simulate_period,
)

# --------------------------------------------------------------------------- strategies


def _seconds(max_value: float = 10.0, exact: bool = False):
    # Multiples of 1/4 (sums exact, many exact ties between schedules), mixed with arbitrary
    # floats unless ``exact``.
    quarters = st.integers(0, int(4 * max_value)).map(lambda k: k / 4)
    if exact:
        return quarters
    return st.one_of(st.floats(0.0, max_value, allow_nan=False, allow_infinity=False), quarters)


@st.composite
def profiles(draw, max_layers: int = 8, max_period: int = 4, exact: bool = False):
    """``(backward_s, comm_s, period, forward_s)`` of a random small instance."""
    L = draw(st.integers(1, max_layers))
    H = draw(st.integers(1, max_period))
    b = draw(st.lists(_seconds(exact=exact), min_size=L, max_size=L))
    c = draw(st.lists(_seconds(15.0, exact), min_size=L, max_size=L))
    f = draw(_seconds(5.0, exact))
    return b, c, H, f


def _contiguous(L: int, cuts: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Groups from cut positions over layers L-1..0 (position p = layer L-1-p)."""
    bounds = (0, *cuts, L)
    return tuple(tuple(range(L - 1 - p, L - 1 - q, -1)) for p, q in itertools.pairwise(bounds))


def _enumerate_min(b, c, H, f) -> float:
    """Independent brute force: every cut-point tuple, timed by simulate_period."""
    L = len(b)
    return min(
        simulate_period(_contiguous(L, cuts), f, b, c)
        for cuts in itertools.combinations_with_replacement(range(L + 1), H - 1)
    )


# --------------------------------------------------------------------------- time model

# Case A: the averaging waits for the layer's own backward. F = 1, b = [2, 3, 1] (index 0 =
# input), c = [1, 1, 1], group {2, 1}.
#   backward: layer 2 [1, 2], layer 1 [2, 5], layer 0 [5, 7]
#   avg 2: start max(2, -) = 2, end 3;  avg 1: start max(5, 3) = 5 (waits for backward), end 6
#   iteration ends at max(7, 6) = 7 (fully hidden).
CASE_A = dict(group=(2, 1), f=1.0, b=[2.0, 3.0, 1.0], c=[1.0, 1.0, 1.0], t=7.0)
# Case B: the averaging waits for the previous averaging. F = 1, b = [4, 3, 1], c = [0.5, 1, 3.5],
# group {2, 1}.
#   backward: layer 2 [1, 2], layer 1 [2, 5], layer 0 [5, 9]
#   avg 2: 2 -> 5.5;  avg 1: start max(5, 5.5) = 5.5 (waits for avg 2), end 6.5
#   iteration ends at max(9, 6.5) = 9.
CASE_B = dict(group=(1, 2), f=1.0, b=[4.0, 3.0, 1.0], c=[0.5, 1.0, 3.5], t=9.0)
# Case C: the last averaging overflows. F = 0.5, b = [1, 1, 1], c = [2, 2, 1], group {2, 1, 0}.
#   backward: layer 2 [0.5, 1.5], layer 1 [1.5, 2.5], layer 0 [2.5, 3.5]
#   avg 2: 1.5 -> 2.5;  avg 1: max(2.5, 2.5) = 2.5 -> 4.5;  avg 0: max(3.5, 4.5) = 4.5 -> 6.5
#   iteration ends at max(3.5, 6.5) = 6.5 (3 s past the end of backward).
CASE_C = dict(group=(0, 1, 2), f=0.5, b=[1.0, 1.0, 1.0], c=[2.0, 2.0, 1.0], t=6.5)


@pytest.mark.parametrize("case", [CASE_A, CASE_B, CASE_C], ids=["A", "B", "C"])
def test_iteration_time_hand_computed(case):
    assert iteration_time(case["group"], case["f"], case["b"], case["c"]) == case["t"]


def test_iteration_time_empty_group_and_numpy_inputs():
    assert iteration_time((), 1.0, [2.0, 3.0, 1.0], [9.0, 9.0, 9.0]) == 7.0
    # Layer 2 (backward 3) ends at 0.5 + 3 = 3.5, its averaging at 4.5; backward ends at 6.5.
    assert iteration_time(np.array([2]), 0.5, np.array([1.0, 2.0, 3.0]), np.ones(3)) == 6.5
    f32 = np.float32
    assert iteration_time([2], np.array(f32(0.5)), np.array([1, 2, 3], f32), [f32(1)] * 3) == 6.5


def test_simulate_period_hand_computed():
    # Case C's profile: F = 0.5, b = [1, 1, 1], c = [2, 2, 1].
    #   h0 {2}:    avg 2 1.5 -> 2.5, backward ends 3.5    -> 3.5
    #   h1 {}:     3.5
    #   h2 {1, 0}: avg 1 2.5 -> 4.5, avg 0 max(3.5, 4.5) -> 6.5 -> 6.5
    f, b, c = CASE_C["f"], CASE_C["b"], CASE_C["c"]
    assert simulate_period([(2,), (), (1, 0)], f, b, c) == 3.5 + 3.5 + 6.5
    # The period does not depend on the order of the groups.
    assert simulate_period([(1, 0), (2,), ()], f, b, c) == 13.5
    assert simulate_period(Schedule(((2, 1, 0),), 3), f, b, c) == 6.5


def test_period_timeline_events():
    f, b, c = CASE_C["f"], CASE_C["b"], CASE_C["c"]
    tl = period_timeline([(2,), (1, 0)], f, b, c)
    assert [type(s) for s in tl] == [StepTimeline, StepTimeline]
    s0, s1 = tl
    assert (s0.step, s0.group, s0.start, s0.end) == (0, (2,), 0.0, 3.5)
    assert s0.forward == (0.0, 0.5)
    assert s0.backward == {2: (0.5, 1.5), 1: (1.5, 2.5), 0: (2.5, 3.5)}
    assert s0.averaging == {2: (1.5, 2.5)}
    # Step 1 starts at 3.5: avg 1 waits for its backward (2.5 + 3.5 = 6) -> 8;
    # avg 0 waits for avg 1 -> 8 .. 10; iteration = 10 - 3.5 = 6.5.
    assert (s1.start, s1.end, s1.forward) == (3.5, 10.0, (3.5, 4.0))
    assert s1.averaging == {1: (6.0, 8.0), 0: (8.0, 10.0)}
    assert s1.backward[0] == (6.0, 7.0)
    assert s1.duration == 6.5
    assert s1.end == simulate_period([(2,), (1, 0)], f, b, c)


@settings(max_examples=60, deadline=None)
@given(profiles())
def test_timeline_agrees_with_iteration_time(p):
    b, c, H, f = p
    sched = enp_schedule(len(b), H)
    tl = period_timeline(sched, f, b, c)
    assert tl[-1].end == simulate_period(sched, f, b, c)
    for s in tl:
        assert s.duration == pytest.approx(iteration_time(s.group, f, b, c), rel=1e-12, abs=1e-12)
        # Averagings run one at a time, each after its own layer's backward.
        prev_end = -math.inf
        for layer in s.group:
            start, end = s.averaging[layer]
            assert start >= s.backward[layer][1] and start >= prev_end
            prev_end = end


# --------------------------------------------------------------------------- Schedule


def test_schedule_normalises_and_prints():
    s = Schedule([[4, 5], [2, 3], (0, 1)], 6)
    assert s.groups == ((5, 4), (3, 2), (1, 0))
    assert s.period == 3 and s.num_layers == 6
    assert str(s) == "Schedule(L=6, H=3): h0: 5-4 | h1: 3-2 | h2: 1-0"
    t = Schedule(((7, 6, 5, 3, 1, 0), (), (4, 2), (7,)), 8)
    assert str(t) == "Schedule(L=8, H=4): h0: 7-5,3,1-0 | h1: - | h2: 4,2 | h3: 7"
    assert t.steps_of(7) == (0, 3) and t.steps_of(4) == (2,)
    with pytest.raises(ValueError, match="layer"):
        t.steps_of(8)


def test_as_schedule():
    s = as_schedule([[5, 4], [3, 2], [1, 0]])
    assert s == Schedule(((5, 4), (3, 2), (1, 0)), 6)
    assert as_schedule(s) is s and as_schedule(s, 6) is s
    assert as_schedule([[1], [0], []], 2).groups == ((1,), (0,), ())
    with pytest.raises(ValueError, match="num_layers"):
        as_schedule(s, 7)
    with pytest.raises(ValueError, match="num_layers"):
        as_schedule([[], []])
    with pytest.raises(ValueError, match=r"layers 2 are in no group"):
        as_schedule([[1], [0]], 3)


def test_enp_and_full_sync_shapes():
    assert enp_schedule(6, 3).groups == ((5, 4), (3, 2), (1, 0))
    assert enp_schedule(7, 3).groups == ((6, 5, 4), (3, 2), (1, 0))
    assert enp_schedule(8, 3).groups == ((7, 6, 5), (4, 3, 2), (1, 0))
    assert enp_schedule(2, 4).groups == ((1,), (0,), (), ())
    assert enp_schedule(5, 1).groups == ((4, 3, 2, 1, 0),)
    assert full_sync_schedule(4, 3).groups == ((), (), (3, 2, 1, 0))
    assert full_sync_schedule(3, 1).groups == ((2, 1, 0),)
    for L, H in itertools.product(range(1, 12), range(1, 6)):
        sizes = [len(g) for g in enp_schedule(L, H).groups]
        assert sum(sizes) == L and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)[::-1]


# --------------------------------------------------------------------------- brute force


@settings(max_examples=200, deadline=None)
@given(profiles(max_layers=7, max_period=4))
def test_brute_force_is_the_minimum(p):
    b, c, H, f = p
    bf = brute_force_schedule(b, c, H, forward_s=f)
    assert bf.period == H
    # Contiguous in backward order, output side first.
    flat = [layer for g in bf.groups for layer in g]
    assert flat == list(range(len(b) - 1, -1, -1))
    assert simulate_period(bf, f, b, c) == _enumerate_min(b, c, H, f)


def test_brute_force_ties_prefer_big_output_side_groups():
    # Everything hides: every partition costs H * (F + sum b); the tie goes to one big group 0.
    b, c = [1.0] * 5, [0.01] * 5
    assert brute_force_schedule(b, c, 3).groups == ((4, 3, 2, 1, 0), (), ())


# --------------------------------------------------------------------------- DFS


def test_dfs_hand_computed_branch():
    # F = 0, b = [1, 1, 1, 1] (backward ends: layer 3 at 1, 2 at 2, 1 at 3, 0 at 4),
    # c = [0.5, 0.5, 1.5, 1.5], H = 2. Group 0 opens with layer 3 (at-least-one); its window is
    # b0 + b1 + b2 = 3. Layer 2: comm 1.5 + 1.5 = 3 <= 3, hidden. Layer 1: 3.5 > 3 but the group
    # does not overflow yet (3 >= 3): branch.
    #   put 1:   h0 {3,2,1}: 1 -> 2.5, 2.5 -> 4, 4 -> 4.5 = 4.5;  h1 {0}: 4 -> 4.5 = 4.5;  9
    #   delay 1: h0 {3,2}: 1 -> 2.5 -> 4 = 4;  h1 {1,0}: 3 -> 3.5, 4 -> 4.5 = 4.5;        8.5
    b, c = [1.0] * 4, [0.5, 0.5, 1.5, 1.5]
    assert list(_solve_subproblem(b, c, 2)) == [((3, 2, 1), (0,)), ((3, 2), (1, 0))]
    s = dreamddp_schedule(b, c, 2, fill_bubbles=False)
    assert s.groups == ((3, 2), (1, 0))
    assert simulate_period(s, 0.0, b, c) == 8.5


def test_dfs_rules_delayed_and_last_group():
    # Layer 3's own comm (5) overflows its window (b0 + b1 + b2 = 3): delayed CO moves layer 2
    # on to h1, which is the last group and takes every remaining layer.
    b, c = [1.0] * 4, [0.1, 0.1, 0.1, 5.0]
    assert list(_solve_subproblem(b, c, 2)) == [((3,), (2, 1, 0))]
    # All placed before the last step: the remaining steps average nothing.
    assert list(_solve_subproblem([1.0] * 3, [0.1] * 3, 3)) == [((2, 1, 0), (), ())]


@settings(max_examples=200, deadline=None)
@given(profiles(max_layers=10, max_period=5))
def test_dfs_is_min_over_literal_algorithm2(p):
    b, c, H, f = p
    sols = list(_solve_subproblem(b, c, H))
    assert len(sols) <= 2 ** (H - 1)
    periods = [simulate_period(s, f, b, c) for s in sols]
    best, count = _dfs_best(b, c, H, f)
    assert count == len(sols)
    assert simulate_period(best, f, b, c) == min(periods)
    assert best.groups in sols
    assert best == dreamddp_schedule(b, c, H, forward_s=f, fill_bubbles=False)
    for s in sols:  # every literal solution is a contiguous backward-order partition
        assert [layer for g in s for layer in g] == list(range(len(b) - 1, -1, -1))


@settings(max_examples=100, deadline=None)
@given(profiles(max_layers=10, max_period=5, exact=True))
def test_dfs_ties_go_to_first_solution_in_dfs_order(p):
    # With exactly representable times there is no rounding: the chosen schedule is the first
    # minimal one the literal recursion lists.
    b, c, H, f = p
    sols = list(_solve_subproblem(b, c, H))
    periods = [simulate_period(s, f, b, c) for s in sols]
    best = dreamddp_schedule(b, c, H, forward_s=f, fill_bubbles=False)
    assert best.groups == sols[periods.index(min(periods))]


@settings(max_examples=400, deadline=None)
@given(profiles(max_layers=12, max_period=5))
def test_dfs_never_beats_brute_force(p):
    b, c, H, f = p
    dfs = dreamddp_schedule(b, c, H, forward_s=f, fill_bubbles=False)
    bf = brute_force_schedule(b, c, H, forward_s=f)
    assert simulate_period(dfs, f, b, c) >= simulate_period(bf, f, b, c)


def _ring_s(params: int, gbps: float, n: int = 8, latency_s: float = 50e-6) -> float:
    """fp32 ring all-reduce seconds: 2 (n-1) alpha + 2 (n-1) / n * bytes * 8 / bandwidth."""
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * 4 * params * 8 / (gbps * 1e9)


# ResNet-18 layers (conv, fc; input first) and GPT-2 small (embeddings, then attention and MLP
# of each of the 12 blocks, then the final layer norm): parameter counts.
RESNET18 = (
    [9408]
    + [36864] * 4
    + [73728, 147456, 8192, 147456, 147456]
    + [294912, 589824, 32768, 589824, 589824]
    + [1179648, 2359296, 131072, 2359296, 2359296]
    + [513000]
)
GPT2 = [39_383_808] + [2_360_832, 4_722_432] * 12 + [1536]


def _resnet_profile(gbps):
    b = [1.5e-3] * len(RESNET18)
    b[0], b[-1] = 1e-3, 0.2e-3
    return b, [_ring_s(p, gbps) for p in RESNET18], 10e-3


def _gpt_profile(gbps):
    b = [2e-3] + [3e-3, 6e-3] * 12 + [5e-3]
    return b, [_ring_s(p, gbps) for p in GPT2], 30e-3


@pytest.mark.parametrize(
    "profile,gbps",
    [(_resnet_profile, g) for g in (1, 5, 25)] + [(_gpt_profile, g) for g in (1, 5, 25)],
)
@pytest.mark.parametrize("H", [2, 4, 5])
def test_dfs_equals_brute_force_on_paper_like_profiles(profile, gbps, H):
    b, c, f = profile(gbps)
    dfs = dreamddp_schedule(b, c, H, forward_s=f, fill_bubbles=False)
    bf = brute_force_schedule(b, c, H, forward_s=f)
    assert simulate_period(dfs, f, b, c) == simulate_period(bf, f, b, c)


def test_dfs_on_100_layers_is_a_valid_schedule_no_shorter_than_the_optimum():
    """At DreamDDP's largest size (100 layers, H = 10): every layer averaged at least once,
    and the search's period is never below the exact minimum (brute force)."""
    rng = np.random.default_rng(0)
    b, c = rng.uniform(1e-3, 20e-3, 100), rng.uniform(1e-3, 30e-3, 100)
    s = dreamddp_schedule(b, c, 10, forward_s=0.05)
    assert s.period == 10 and s.num_layers == 100
    assert {layer for g in s.groups for layer in g} == set(range(100))
    plain = dreamddp_schedule(b, c, 10, forward_s=0.05, fill_bubbles=False)
    assert simulate_period(plain, 0.05, b, c) >= simulate_period(
        brute_force_schedule(b, c, 10, forward_s=0.05), 0.05, b, c
    )


# --------------------------------------------------------------------------- bubble filling


def test_bubble_filling_hand_computed():
    # The DFS result of test_dfs_hand_computed_branch: h0 {3,2} ends at 4, h1 {1,0} at 4.5.
    # h0 holds layer 3, so nothing can be added. h1: + {3}: avg 3 1 -> 2.5, avg 1 max(3, 2.5)
    # -> 3.5, avg 0 4 -> 4.5: still 4.5, kept. + {3, 2}: avg 2 2.5 -> 4, avg 1 4 -> 4.5,
    # avg 0 4.5 -> 5 > 4.5: rejected.
    b, c = [1.0] * 4, [0.5, 0.5, 1.5, 1.5]
    s = dreamddp_schedule(b, c, 2)
    assert s.groups == ((3, 2), (3, 1, 0))
    assert str(s) == "Schedule(L=4, H=2): h0: 3-2 | h1: 3,1-0"
    assert s.steps_of(3) == (0, 1)
    assert simulate_period(s, 0.0, b, c) == 8.5


def test_bubble_filling_uses_idle_bandwidth():
    # Comm is cheap: the DFS hides everything in h0 and leaves h1, h2 empty; bubble filling
    # then averages layers 5..1 again at h1 and h2 at no cost. Layer 0 is never added: its
    # averaging can only start when the whole backward pass has ended (6 -> 6.05).
    b, c = [1.0] * 6, [0.05] * 6
    plain = dreamddp_schedule(b, c, 3, fill_bubbles=False)
    filled = dreamddp_schedule(b, c, 3)
    assert plain.groups == ((5, 4, 3, 2, 1, 0), (), ())
    assert filled.groups == ((5, 4, 3, 2, 1, 0), (5, 4, 3, 2, 1), (5, 4, 3, 2, 1))
    expected = (6.0 + 0.05) + 6.0 + 6.0
    assert simulate_period(filled, 0.0, b, c) == simulate_period(plain, 0.0, b, c) == expected


@settings(max_examples=120, deadline=None)
@given(profiles(max_layers=10, max_period=5))
def test_bubble_filling_never_lengthens(p):
    b, c, H, f = p
    L = len(b)
    plain = dreamddp_schedule(b, c, H, forward_s=f, fill_bubbles=False)
    filled = dreamddp_schedule(b, c, H, forward_s=f)
    assert filled.period == H and filled.num_layers == L  # covers every layer (validated)
    assert simulate_period(filled, f, b, c) == simulate_period(plain, f, b, c)
    for g0, g1 in zip(plain.groups, filled.groups, strict=True):
        base = iteration_time(g0, f, b, c)
        assert iteration_time(g1, f, b, c) <= base
        extra = sorted(set(g1) - set(g0), reverse=True)
        assert set(g0) <= set(g1)
        assert extra == list(range(L - 1, L - 1 - len(extra), -1))  # an output-side suffix
        # The largest valid suffix, found by scanning every suffix (no monotonicity assumed).
        top = g0[0] if g0 else -1
        ok = [
            low
            for low in range(top + 1, L)
            if iteration_time((*range(L - 1, low - 1, -1), *g0), f, b, c) <= base
        ]
        assert len(extra) == (L - min(ok) if ok else 0)


@settings(max_examples=80, deadline=None)
@given(profiles(max_layers=10, max_period=1), st.data())
def test_iteration_time_monotone_in_extra_layers(p, data):
    b, c, _, f = p
    g = data.draw(st.sets(st.integers(0, len(b) - 1)))
    t = iteration_time(g, f, b, c)
    for extra in range(len(b)):
        if extra not in g:
            assert iteration_time(g | {extra}, f, b, c) >= t


# --------------------------------------------------------------------------- validation

B3, C3 = [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "call,exc,pattern",
    [
        (lambda: dreamddp_schedule(B3, C3, 0), ValueError, r"period .*\[1, inf\].* 0"),
        (lambda: brute_force_schedule(B3, C3, 2.0), TypeError, "period must be an int"),
        (lambda: enp_schedule(3, -1), ValueError, "period"),
        (lambda: enp_schedule(0, 2), ValueError, "num_layers"),
        (lambda: full_sync_schedule(3, 0), ValueError, "period"),
        (lambda: dreamddp_schedule(B3, [1.0, 1.0], 2), ValueError, r"comm_s .*3 layers.* 2"),
        (lambda: dreamddp_schedule([], [], 2), ValueError, "backward_s must hold at least one"),
        (lambda: iteration_time((), 0.0, [1.0, -2.0], C3[:2]), ValueError, r"backward_s\[1\]"),
        (lambda: simulate_period([[0]], 0.0, [1.0], [math.nan]), ValueError, r"comm_s\[0\]"),
        (lambda: brute_force_schedule(B3, [1, 1, math.inf], 2), ValueError, r"comm_s\[2\]"),
        (lambda: brute_force_schedule(B3, [1, "x", 1], 2), TypeError, r"comm_s\[1\]"),
        (lambda: dreamddp_schedule(B3, C3, 2, forward_s=-1.0), ValueError, "forward_s"),
        (lambda: period_timeline([[2, 1, 0]], math.nan, B3, C3), ValueError, "forward_s"),
        (lambda: dreamddp_schedule(B3, C3, 2, fill_bubbles=1), TypeError, "fill_bubbles"),
        (lambda: dreamddp_schedule(np.ones((2, 2)), C3, 2), ValueError, "backward_s"),
        (lambda: dreamddp_schedule(3.0, C3, 2), TypeError, "backward_s"),
        (lambda: Schedule(((4, 3), (1,)), 5), ValueError, r"layers 2,0 are in no group"),
        (lambda: Schedule(((2, 1), (0, 5)), 3), ValueError, r"groups\[1\] .*\[0, 2\].* 5"),
        (lambda: Schedule(((2, 1, 1), (0,)), 3), ValueError, r"groups\[0\] holds layer 1 twice"),
        (lambda: Schedule((), 3), ValueError, "groups must hold at least one group"),
        (lambda: Schedule(((0,),), 0), ValueError, "num_layers"),
        (lambda: Schedule(((0, "a"),), 1), TypeError, r"groups\[0\]"),
        (lambda: as_schedule([[1], [-1]]), ValueError, r"groups\[1\]"),
        (lambda: iteration_time((3,), 0.0, B3, C3), ValueError, r"group .*\[0, 2\].* 3"),
        (lambda: iteration_time((1, 1), 0.0, B3, C3), ValueError, "group holds layer 1 twice"),
        (lambda: simulate_period(enp_schedule(4, 2), 0.0, B3, C3), ValueError, "num_layers=4"),
        (lambda: simulate_period([[2, 1]], 0.0, B3, C3), ValueError, "layers 0 are in no group"),
        (lambda: period_timeline([[3, 2, 1, 0]], 0.0, B3, C3), ValueError, r"\[0, 2\]"),
    ],
)
def test_bad_inputs_raise(call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()
