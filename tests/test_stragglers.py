"""Deterministic stragglers and latency jitter in the simulated clock."""

import numpy as np
import pytest

from jaxcomm._src.network import Network, Stragglers

NET = Network(1e-3, 1e9)


def test_same_seed_same_times_other_seed_other_times():
    a = Stragglers(seed=7, compute_sigma=0.3, latency_jitter=0.5)
    b = Stragglers(seed=7, compute_sigma=0.3, latency_jitter=0.5)
    c = Stragglers(seed=8, compute_sigma=0.3, latency_jitter=0.5)
    for step in (0, 1, 99):
        ta = a.step_seconds(step, 8, 0.1, 14, 1e6, NET)
        assert ta == b.step_seconds(step, 8, 0.1, 14, 1e6, NET)
        assert ta != c.step_seconds(step, 8, 0.1, 14, 1e6, NET)
    assert a.step_seconds(0, 8, 0.1, 14, 1e6, NET) != a.step_seconds(1, 8, 0.1, 14, 1e6, NET)


def test_ring_waits_for_its_one_straggler():
    """8 workers of 0.1 s, worker 3 twice as slow, then a ring all-reduce of 8 MB: the ring
    starts when worker 3 is done, and takes 2 (N - 1) rounds of 1 MB segments."""
    n, size = 8, 8e6
    rounds, path = 2 * (n - 1), 2 * (n - 1) * size / n
    total, compute, comm = Stragglers(slow={3: 2.0}).step_seconds(0, n, 0.1, rounds, path, NET)
    assert compute == pytest.approx(0.2)
    assert comm == pytest.approx(14 * 1e-3 + 14e6 * 8 / 1e9)
    assert total == pytest.approx(0.2 + 0.014 + 0.112)
    # Per-worker compute times: the slowest after the multipliers decides.
    per = np.array([0.1] * 7 + [0.3])
    _, compute, _ = Stragglers(slow={3: 2.0}).step_seconds(0, n, per, rounds, path, NET)
    assert compute == pytest.approx(0.3)
    overlap, _, _ = Stragglers(slow={3: 2.0}).step_seconds(
        0, n, 0.1, rounds, path, NET, overlap=True
    )
    assert overlap == pytest.approx(0.2)


def test_jittered_round_ends_with_its_slowest_message():
    """Latency ``alpha (1 + j e)``, ``e ~ Exp(1)``: a round among 8 waits for the largest of 8
    draws, whose mean is the harmonic number H_8 = 2.718."""
    s = Stragglers(seed=1, latency_jitter=1.0)
    per_round = [s.round_latency(step, 1, 8, NET) / 1e-3 - 1.0 for step in range(4000)]
    assert np.mean(per_round) == pytest.approx(sum(1 / k for k in range(1, 9)), rel=0.05)
    assert min(per_round) > 0


def test_compute_noise_is_lognormal():
    s = Stragglers(seed=3, compute_sigma=0.2)
    logs = np.log(np.concatenate([s.compute_factors(t, 8) for t in range(2000)]))
    assert abs(logs.mean()) < 0.01 and logs.std() == pytest.approx(0.2, rel=0.05)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="compute_sigma must be >= 0"):
        Stragglers(compute_sigma=-1.0)
    with pytest.raises(ValueError, match=r"slow\[2\] must be a multiplier > 0"):
        Stragglers(slow={2: 0.0})
    with pytest.raises(ValueError, match=r"slow workers \[9\] do not exist among n=8"):
        Stragglers(slow={9: 2.0}).compute_factors(0, 8)
    with pytest.raises(ValueError, match="compute_s must be one or 8 finite seconds"):
        Stragglers().step_seconds(0, 8, [0.1, 0.2], 1, 0.0, NET)


def test_streams_draw_independently_of_the_steps_own():
    """Trial steps (stream > 0) get their own draws, not those of the numbered step."""
    s = Stragglers(seed=2, compute_sigma=0.3, latency_jitter=0.5)
    own = s.step_seconds(5, 8, 1.0, 14, 1e6, NET)
    assert s.step_seconds(5, 8, 1.0, 14, 1e6, NET) == own
    other = s.step_seconds(5, 8, 1.0, 14, 1e6, NET, stream=2)
    assert other != own and other == s.step_seconds(5, 8, 1.0, 14, 1e6, NET, stream=2)
    assert not np.array_equal(s.compute_factors(5, 8), s.compute_factors(5, 8, stream=3))
