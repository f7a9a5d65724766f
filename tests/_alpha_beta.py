"""Hand-written alpha-beta costs of the AR-Topk paper's three collectives (its Table I and
Eqs. 4-5), for tests that check the library's chooser against something it did not compute.

``M`` bytes dense, ratio ``c``, ``N`` workers, ``L = ceil(log2 N)``; the all-gather takes
``log2 N`` rounds by recursive doubling when ``N`` is a power of two and the ring's ``N - 1``
otherwise; values and indices double AG's bytes.
"""

import math


def hand_costs(nbytes, n, ratio, latency, bandwidth_bps):
    beta = 8.0 / bandwidth_bps  # seconds per byte
    L = math.ceil(math.log2(n))
    gather_rounds = L if n & (n - 1) == 0 else n - 1
    sparse = nbytes * ratio
    return {
        "allgather": gather_rounds * latency + 2 * (n - 1) * sparse * beta,
        "art_ring": (2 * (n - 1) + L) * latency + (2 * (n - 1) / n + L) * sparse * beta,
        "art_tree": 3 * L * latency + 3 * L * sparse * beta,
    }


def hand_choice(nbytes, n, ratio, latency, bandwidth_bps):
    """The cheapest of the three; ties go to AG, then ART-ring (the chooser's order)."""
    costs = hand_costs(nbytes, n, ratio, latency, bandwidth_bps)
    best = min(costs.values())
    return next(k for k in ("allgather", "art_ring", "art_tree") if costs[k] <= best * (1 + 1e-12))
