"""The simulated clock's arithmetic: a step's logged traffic per device, and the seconds
of a synchronous step from its devices' compute, its traffic, the network and stragglers.

Every conversion of traffic into time goes through :meth:`jaxcomm.network.Network.wire_seconds`
(``rounds * latency + path_bytes * beta``); a layout's own timeline (GPipe's, DreamDDP's)
composes these pieces.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxcomm._src.network import KINDS, CommLog, Network, Stragglers, as_bytes

__all__ = ["StepTraffic", "step_traffic", "wire_time", "synchronous_step"]


@dataclasses.dataclass(frozen=True)
class StepTraffic:
    """A step's communication per device, summed over all its logs (host side, int64).

    Attributes: ``calls``, ``message_bytes``, ``rounds``, ``path_bytes``: ``[devices, K]``
    per kind of :data:`~jaxcomm.network.KINDS`; ``ratio`` ``[devices, K]``; ``sent``
    ``[devices]`` bytes each device sent.
    """

    calls: np.ndarray
    message_bytes: np.ndarray
    ratio: np.ndarray
    rounds: np.ndarray
    path_bytes: np.ndarray
    sent: np.ndarray

    def times(self, network: Network) -> np.ndarray:
        """Modelled seconds per device: ``rounds * alpha + path_bytes * beta``."""
        return network.wire_seconds(self.rounds.sum(1), self.path_bytes.sum(1).astype(np.float64))

    def wire_record(self, network: Network) -> list[list]:
        """``[[kind, calls, message_bytes, ratio, rounds, path_bytes], ...]`` of the device
        whose communication takes longest, to re-model the step (:func:`wire_time`)."""
        w = int(np.argmax(self.times(network)))
        return [
            [
                kind,
                int(self.calls[w, i]),
                int(self.message_bytes[w, i]),
                float(self.ratio[w, i]),
                int(self.rounds[w, i]),
                int(self.path_bytes[w, i]),
            ]
            for i, kind in enumerate(KINDS)
            if self.calls[w, i] > 0
        ]


def step_traffic(logs: list[CommLog]) -> StepTraffic:
    """Sum a step's logs per device. Logs kept in per-worker state carry leading mesh axes
    (``[N, ...]``, ``[D, S, ...]``), flattened here; a log without them counts for every
    device."""
    k = len(KINDS)
    parts = []
    for log in logs:
        calls = np.asarray(log.calls).reshape(-1, k).astype(np.int64)
        parts.append(
            (
                calls,
                as_bytes(np.asarray(log.message_bytes).reshape(-1, k, 2)),
                np.asarray(log.ratio, np.float64).reshape(-1, k),
                np.asarray(log.rounds).reshape(-1, k).astype(np.int64),
                as_bytes(np.asarray(log.path_bytes).reshape(-1, k, 2)),
                as_bytes(np.asarray(log.sent_bytes).reshape(-1, 2)),
            )
        )
    devices = max((p[0].shape[0] for p in parts), default=1)
    zeros = np.zeros((devices, k), np.int64)
    calls, mbytes, rounds, path = zeros.copy(), zeros.copy(), zeros.copy(), zeros.copy()
    weighted, sent = np.zeros((devices, k)), np.zeros(devices, np.int64)
    for c, m, r, ro, pa, se in parts:
        calls += c
        mbytes += m
        weighted += r * m
        rounds += ro
        path += pa
        sent += se
    ratio = np.where(mbytes > 0, weighted / np.maximum(mbytes, 1), 1.0)
    return StepTraffic(calls, mbytes, ratio, rounds, path, sent)


def wire_time(wire: list[list], network: Network) -> float:
    """Modelled seconds of a metrics row's ``wire`` record under another ``network``:
    ``sum(rounds) * alpha + sum(path_bytes) * beta``."""
    return sum(network.wire_seconds(rounds, path) for *_, rounds, path in wire)


def synchronous_step(
    compute_s: Any,
    rounds: np.ndarray,
    path_bytes: np.ndarray,
    network: Network,
    step: int,
    *,
    devices: int,
    stragglers: Stragglers | None,
    overlap: bool,
    stream: int = 0,
) -> tuple[float, float, float]:
    """``(step, compute, comm)`` seconds of a synchronous step: every device computes
    (``compute_s``, one value or one per device), then the collectives run (``rounds`` and
    ``path_bytes`` per device); ``max`` of the two with ``overlap``. Stragglers (drawn for
    ``step``, 0-based, for ``devices`` devices; ``stream`` > 0 an independent sequence)
    scale each device's compute
    and jitter each round's latency, on the busiest device's rounds. ``compute`` is the
    slowest device's compute, ``comm`` the busiest device's communication."""
    times = network.wire_seconds(rounds, path_bytes)
    if stragglers is None:
        compute, comm = float(np.max(compute_s)), float(np.max(times))
        return (max(compute, comm) if overlap else compute + comm), compute, comm
    busiest = int(np.argmax(times))
    return stragglers.step_seconds(
        step,
        devices,
        compute_s,
        int(rounds[busiest]),
        float(path_bytes[busiest]),
        network,
        overlap=overlap,
        stream=stream,
    )
