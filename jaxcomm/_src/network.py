"""Alpha-beta network model: collective costs, network schedules and communication logs.

The cost of one collective over ``N`` workers is modelled as ``a * alpha + b * M * beta`` where
``alpha`` is the one-way latency per message (seconds), ``beta = 8 / bandwidth_bps`` the time
per byte (seconds/byte) and ``M`` the message size in bytes. Coefficients follow Table I and
Eqs. (4a)-(4b) of "Flexible Communication for Optimal Distributed Learning over Unpredictable
Networks" (the AR-Topk paper); ``log N`` is ``ceil(log2 N)``, the number of tree levels /
recursive-doubling rounds. With ``N = 1`` nothing is sent and every collective costs 0.

For the compressed kinds (``ag_topk``, ``art_ring``, ``art_tree``) ``M`` is the *dense* message
size and the bandwidth term is ``b * M * c * beta`` with compression ratio ``c`` in (0, 1].

Training code records what it puts on the wire in a :class:`CommLog` (jit-friendly arrays kept
in optimizer state): the bytes each worker sent, and the rounds and bytes of the algorithm that
ran, each collective describing itself with a :class:`Wire`. The host turns a log into modelled
seconds with :func:`log_time` and adds them to a :class:`SimClock`, with the network taken from a
:class:`NetworkSchedule`. :func:`jaxcomm.wire_audit` reads the same quantities from a compiled
program, so the logs can be checked against what the program actually moves.
"""

from __future__ import annotations

import bisect
import dataclasses
import decimal
import math
import operator
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "COMPRESSED_KINDS",
    "KINDS",
    "CommLog",
    "Network",
    "NetworkSchedule",
    "SimClock",
    "Stragglers",
    "Wire",
    "as_bytes",
    "as_words",
    "choose_collective",
    "collective_cost",
    "collective_time",
    "empty_log",
    "find_logs",
    "log_collective",
    "log_time",
    "log_wire",
    "merge_logs",
    "words_add",
    "words_table",
]

KINDS: tuple[str, ...] = (
    "p2p",
    "ps",
    "allreduce",
    "alltoall",
    "ring_allreduce",
    "ring_reduce_scatter",
    "ring_allgather",
    "tree_allreduce",
    "broadcast",
    "allgather",
    "ag_topk",
    "art_ring",
    "art_tree",
)
"""Collective kinds known to the cost model; also the index order of :class:`CommLog` arrays.

``allreduce`` and ``alltoall`` are XLA's own collectives (``lax.psum``, ``lax.all_to_all``),
costed as the bandwidth-optimal ring and the pairwise exchange; the ``ring_*`` and ``tree_*``
kinds are jaxcomm's ``ppermute`` implementations."""

COMPRESSED_KINDS: tuple[str, ...] = ("ag_topk", "art_ring", "art_tree")
"""Kinds whose message size is the dense size ``M`` and whose cost also depends on ``ratio``."""

_KIND_INDEX = {k: i for i, k in enumerate(KINDS)}

# Unit -> power of ten (scaled in decimal so that e.g. "50us" is exactly the float 5e-05).
_LATENCY_UNITS = {"": 0, "s": 0, "ms": -3, "us": -6, "µs": -6}
_QUANTITY_RE = re.compile(r"^\s*([0-9.eE+\-]+)\s*([a-zA-Zµ]*)\s*$")


# --------------------------------------------------------------------------- validation helpers


def _finite(name: str, value: Any, allowed: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, {allowed}; got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, {allowed}; got {value!r}")
    return x


def _int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    try:
        i = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}") from None
    if i < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    return i


def _check_kind(kind: str) -> int:
    if kind not in _KIND_INDEX:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    return _KIND_INDEX[kind]


def _check_ratio(ratio: Any) -> float:
    r = _finite("ratio", ratio, "in (0, 1]")
    if not 0.0 < r <= 1.0:
        raise ValueError(f"ratio must be in (0, 1]; got {ratio!r}")
    return r


def _log2_ceil(n: int) -> int:
    """``ceil(log2 n)`` for ``n >= 1``: number of tree levels / recursive-doubling rounds."""
    return (n - 1).bit_length()


def _parse_quantity(text: str, units: dict[str, int], what: str) -> float:
    m = _QUANTITY_RE.match(text)
    allowed = "/".join(u for u in units if u) + " or no unit"
    if m is None:
        raise ValueError(f"cannot parse {what} {text!r}: expected a number with unit {allowed}")
    unit = m.group(2).lower() if m.group(2) != "µs" else "µs"
    if unit not in units:
        raise ValueError(f"unknown {what} unit {m.group(2)!r} in {text!r}; allowed: {allowed}")
    try:
        value = decimal.Decimal(m.group(1)).scaleb(units[unit])
    except decimal.InvalidOperation:
        raise ValueError(f"cannot parse number {m.group(1)!r} in {what} {text!r}") from None
    return float(value)


_BANDWIDTH_RE = re.compile(r"^([kKmMgGtT]?)(bps|bit/s|bit|b/s|Bps|B/s|byte/s)$")
_PREFIX = {"": 0, "k": 3, "m": 6, "g": 9, "t": 12}


def _parse_bandwidth(text: str) -> float:
    """Bits per second from ``"10Gbps"``, ``"1.25GB/s"``, ``"1e9"`` (see :meth:`Network.parse`)."""
    allowed = "bps, kbps, Mbps, Gbps, Tbps (bits; also bit/s, bit, b/s) or Bps, MBps, GB/s (bytes)"
    m = re.match(r"^\s*([0-9.eE+\-]+)\s*([a-zA-Z/]*)\s*$", text)
    if m is None:
        raise ValueError(f"cannot parse bandwidth {text!r}: expected a number with unit {allowed}")
    unit, number = m.group(2), m.group(1)
    try:
        value = decimal.Decimal(number)
    except decimal.InvalidOperation:
        raise ValueError(f"cannot parse number {number!r} in bandwidth {text!r}") from None
    if unit == "":
        return float(value)
    u = _BANDWIDTH_RE.match(unit)
    if u is None:
        raise ValueError(
            f"unknown bandwidth unit {unit!r} in {text!r}: a lower-case b means bits, an "
            f"upper-case B bytes; allowed: {allowed}"
        )
    per_byte = 8 if u.group(2).startswith("B") or u.group(2) == "byte/s" else 1
    return float(value.scaleb(_PREFIX[u.group(1).lower()]) * per_byte)


# --------------------------------------------------------------------------------------- Network


@dataclasses.dataclass(frozen=True)
class Network:
    """A network link in the alpha-beta model.

    Attributes:
      latency_s: alpha, one-way latency per message in seconds (finite, >= 0).
      bandwidth_bps: bandwidth in bits per second (finite, > 0).
    """

    latency_s: float
    bandwidth_bps: float

    def __post_init__(self) -> None:
        lat = _finite("latency_s", self.latency_s, ">= 0 seconds")
        if lat < 0:
            raise ValueError(f"latency_s must be >= 0 seconds; got {self.latency_s!r}")
        bw = _finite("bandwidth_bps", self.bandwidth_bps, "> 0 bits per second")
        if bw <= 0:
            raise ValueError(
                f"bandwidth_bps must be > 0 bits per second; got {self.bandwidth_bps!r}"
            )
        object.__setattr__(self, "latency_s", lat)
        object.__setattr__(self, "bandwidth_bps", bw)

    @property
    def beta(self) -> float:
        """Seconds per byte, ``8 / bandwidth_bps``."""
        return 8.0 / self.bandwidth_bps

    def wire_seconds(self, rounds: Any, path_bytes: Any, *, latency_s: Any = None) -> Any:
        """The alpha-beta time of a wire: ``rounds * latency_s + path_bytes * beta`` seconds
        for ``rounds`` sequential message rounds carrying ``path_bytes`` bytes along the
        critical path (numbers or numpy arrays, broadcast). ``latency_s`` replaces the
        ``rounds * latency_s`` term with seconds of latency already drawn (e.g. jittered
        rounds). The one place the library turns traffic into time."""
        latency = rounds * self.latency_s if latency_s is None else latency_s
        return latency + path_bytes * self.beta

    @classmethod
    def parse(cls, spec: str) -> Network:
        """Parse ``"LATENCY,BANDWIDTH"``: ``"1ms,10Gbps"``, ``"50us,100Mbps"``, ``"0.001,1e9"``.

        Latency units: ``s``, ``ms``, ``us`` (default seconds). Bandwidth: a prefix ``k``,
        ``M``, ``G`` or ``T`` (either case) and a lower-case ``b`` for bits (``Gbps``,
        ``Gbit/s``, ``Gb/s``, or tc's ``Gbit``) or an upper-case ``B`` for bytes (``GBps``,
        ``GB/s``, 8x the bits); no unit is bits per second. Anything else (``GBPS``) is
        refused.
        """
        if not isinstance(spec, str):
            raise ValueError(f"network spec must be a string like '1ms,10Gbps'; got {spec!r}")
        parts = spec.split(",")
        if len(parts) != 2:
            raise ValueError(
                f"network spec must be 'LATENCY,BANDWIDTH' (e.g. '1ms,10Gbps'); got {spec!r}"
            )
        latency = _parse_quantity(parts[0], _LATENCY_UNITS, "latency")
        bandwidth = _parse_bandwidth(parts[1])
        return cls(latency_s=latency, bandwidth_bps=bandwidth)


# ------------------------------------------------------------------------------ collective costs


def collective_cost(kind: str, n: int) -> tuple[float, float]:
    """Alpha-beta coefficients ``(a, b)`` of one collective of ``kind`` over ``n`` workers.

    Time is ``a * alpha + b * M * beta`` (seconds) for a message of ``M`` bytes; for the
    compressed kinds (``ag_topk``, ``art_ring``, ``art_tree``) ``M`` is the dense size and the
    bandwidth term is ``b * M * c * beta``. ``L = ceil(log2 n)``:

    ====================  ========================  ==========================
    kind                  a                         b
    ====================  ========================  ==========================
    p2p                   1                         1
    ps                    2                         2 (N-1)
    allreduce             2 (N-1)                   2 (N-1) / N   (XLA's, as a ring)
    alltoall              N-1                       (N-1) / N     (pairwise exchange)
    ring_allreduce        2 (N-1)                   2 (N-1) / N
    ring_reduce_scatter   N-1                       (N-1) / N
    ring_allgather        N-1                       (N-1) / N
    tree_allreduce        2 L                       2 L
    broadcast             L                         L
    allgather             G                         N-1   (M = bytes per worker)
    ag_topk               G                         2 (N-1)   (values + indices)
    art_ring              2 (N-1) + L               2 (N-1) / N + L
    art_tree              3 L                       3 L
    ====================  ========================  ==========================

    ``G`` is the rounds of the all-gather that runs (:func:`jaxcomm.collectives.all_gather`):
    ``L`` by
    recursive doubling when ``n`` is a power of two, else ``n - 1`` on the ring it falls
    back to (the AR-Topk paper's Table I gives ``L``, which holds for powers of two only).

    For ``n == 1`` every collective returns ``(0.0, 0.0)``; ``p2p`` is one message between
    two devices (e.g. pipeline stages) and always costs ``(1, 1)``.
    """
    _check_kind(kind)
    n = _int("n", n, 1)
    if kind == "p2p":
        return (1.0, 1.0)
    if n == 1:
        return (0.0, 0.0)
    L = float(_log2_ceil(n))
    nm1 = float(n - 1)
    G = L if n & (n - 1) == 0 else nm1  # the all-gather that runs: doubling, or the ring
    table = {
        "p2p": (1.0, 1.0),
        "ps": (2.0, 2.0 * nm1),
        "allreduce": (2.0 * nm1, 2.0 * nm1 / n),
        "alltoall": (nm1, nm1 / n),
        "ring_allreduce": (2.0 * nm1, 2.0 * nm1 / n),
        "ring_reduce_scatter": (nm1, nm1 / n),
        "ring_allgather": (nm1, nm1 / n),
        "tree_allreduce": (2.0 * L, 2.0 * L),
        "broadcast": (L, L),
        "allgather": (G, nm1),
        "ag_topk": (G, 2.0 * nm1),
        "art_ring": (2.0 * nm1 + L, 2.0 * nm1 / n + L),
        "art_tree": (3.0 * L, 3.0 * L),
    }
    return table[kind]


def collective_time(
    kind: str,
    nbytes: float,
    n: int,
    network: Network,
    *,
    ratio: float = 1.0,
    calls: int = 1,
) -> float:
    """Modelled seconds for ``calls`` collectives of ``kind`` whose sizes add up to ``nbytes``.

    ``time = calls * a * alpha + b * nbytes * ratio * beta`` with ``(a, b) = collective_cost``.
    For ``ag_topk`` / ``art_ring`` / ``art_tree``, ``nbytes`` is the dense size ``M`` and
    ``ratio`` the compression ratio ``c`` in (0, 1]; for all other kinds ``ratio`` must be 1.0.
    Note ``collective_time("ag_topk", M, ..., ratio=c)`` equals
    ``collective_time("allgather", 2 * M * c, ...)``.
    """
    _check_kind(kind)
    nbytes_f = _finite("nbytes", nbytes, ">= 0 bytes")
    if nbytes_f < 0:
        raise ValueError(f"nbytes must be >= 0 bytes; got {nbytes!r}")
    n = _int("n", n, 1)
    if not isinstance(network, Network):
        raise ValueError(f"network must be a Network; got {network!r}")
    r = _check_ratio(ratio)
    if kind not in COMPRESSED_KINDS and r != 1.0:
        raise ValueError(
            f"ratio must be 1.0 for kind {kind!r} (only {', '.join(COMPRESSED_KINDS)} take a "
            f"compression ratio); got {ratio!r}"
        )
    calls = _int("calls", calls, 1)
    a, b = collective_cost(kind, n)
    return network.wire_seconds(calls * a, b * nbytes_f * r)


def choose_collective(nbytes: float, n: int, ratio: float, network: Network) -> str:
    """Cheapest way to aggregate a top-k compressed gradient (the AR-Topk paper's flexible scheme).

    Compares AG top-k (``collective_time("ag_topk", ...)``), ART-ring and ART-tree for dense
    size ``nbytes`` (bytes), ``n`` workers and compression ratio ``ratio``. Returns
    ``"allgather"`` (meaning AG top-k), ``"art_ring"`` or ``"art_tree"``; ties are broken in that
    order.
    """
    candidates = (("allgather", "ag_topk"), ("art_ring", "art_ring"), ("art_tree", "art_tree"))
    best_name, best_time = "", math.inf
    for name, kind in candidates:
        t = collective_time(kind, nbytes, n, network, ratio=ratio)
        if t < best_time:
            best_name, best_time = name, t
    return best_name


# ------------------------------------------------------------------------------ NetworkSchedule

# Network configurations of the AR-Topk paper (Sec. "Flexible Communication", Fig. 6): each epoch
# of a 50-epoch run (scaled 2x for 100-epoch ResNet50) has a fixed latency and bandwidth.
# "We regard 1ms as low and 50ms as high-latency ..., while inter-node 1/beta of 25 and 1Gbps is
# considered high and low bandwidth respectively."
_LOW_LAT_S, _HIGH_LAT_S = 1e-3, 50e-3
_HIGH_BW_BPS, _LOW_BW_BPS = 25e9, 1e9
# C2's "moderate" latency and bandwidth are not given in the paper: jaxcomm takes the
# geometric means of its low and high values, sqrt(1 ms * 50 ms) and sqrt(25 Gbps * 1 Gbps).
_MODERATE_LAT_S, _MODERATE_BW_BPS = math.sqrt(_LOW_LAT_S * _HIGH_LAT_S), 5e9
_PAPER_EPOCHS = 50


@dataclasses.dataclass(frozen=True)
class NetworkSchedule:
    """Piecewise-constant network over training steps.

    Attributes:
      segments: ``((first_step, network), ...)``; ``first_step`` values are ints, strictly
        increasing, and the first is 0. Segment ``i`` applies from its ``first_step`` up to the
        next segment's ``first_step`` (the last one forever).
    """

    segments: tuple[tuple[int, Network], ...]

    def __post_init__(self) -> None:
        try:
            segs = tuple((s, net) for s, net in self.segments)
        except (TypeError, ValueError):
            raise ValueError(
                f"segments must be a sequence of (first_step, Network) pairs; got {self.segments!r}"
            ) from None
        if not segs:
            raise ValueError("segments must hold at least one (first_step, Network) pair; got ()")
        out = []
        prev = -1
        for i, (step, net) in enumerate(segs):
            step = _int(f"segments[{i}] first_step", step, 0)
            if i == 0 and step != 0:
                raise ValueError(f"segments[0] first_step must be 0; got {step}")
            if step <= prev:
                raise ValueError(
                    f"segments first_step must be strictly increasing; got {step} after {prev}"
                )
            if not isinstance(net, Network):
                raise ValueError(f"segments[{i}] network must be a Network; got {net!r}")
            out.append((step, net))
            prev = step
        object.__setattr__(self, "segments", tuple(out))
        object.__setattr__(self, "_starts", tuple(s for s, _ in out))

    def at(self, step: int) -> Network:
        """The network in effect at training step ``step`` (int >= 0)."""
        step = _int("step", step, 0)
        i = bisect.bisect_right(self._starts, step) - 1  # type: ignore[attr-defined]
        return self.segments[i][1]

    @classmethod
    def constant(cls, network: Network) -> NetworkSchedule:
        """A schedule that is ``network`` at every step."""
        return cls(((0, network),))

    @classmethod
    def parse(cls, spec: str) -> NetworkSchedule:
        """Parse ``"STEP:LATENCY,BANDWIDTH;..."``, e.g. ``"0:1ms,10Gbps;100:5ms,1Gbps"``.

        A single network without a step (``"1ms,10Gbps"``) gives a constant schedule.
        """
        if not isinstance(spec, str):
            raise ValueError(
                f"schedule spec must be a string like '0:1ms,10Gbps;100:5ms,1Gbps'; got {spec!r}"
            )
        parts = [p for p in spec.split(";") if p.strip()]
        if len(parts) == 1 and ":" not in parts[0]:
            return cls.constant(Network.parse(parts[0]))
        segs = []
        for part in parts:
            if ":" not in part:
                raise ValueError(
                    f"schedule segment {part!r} must be 'STEP:LATENCY,BANDWIDTH' "
                    f"(e.g. '100:5ms,1Gbps') in {spec!r}"
                )
            step_text, net_text = part.split(":", 1)
            try:
                step = int(step_text.strip())
            except ValueError:
                raise ValueError(
                    f"schedule step {step_text.strip()!r} must be an integer >= 0 in {spec!r}"
                ) from None
            segs.append((step, Network.parse(net_text)))
        if not segs:
            raise ValueError(f"schedule spec is empty: {spec!r}")
        return cls(tuple(segs))

    @classmethod
    def preset(cls, name: str, total_steps: int) -> NetworkSchedule:
        """The AR-Topk paper's changing network conditions, scaled to ``total_steps`` steps.

        From "Flexible Communication for Optimal Distributed Learning over Unpredictable
        Networks" (Sec. on the MOO evaluation, Fig. 6), for a 50-epoch run (low latency 1 ms,
        high 50 ms; high bandwidth 25 Gbps, low 1 Gbps):

        * ``"c1"``: epochs 1-12 (1 ms, 25 Gbps), 13-24 (1 ms, 1 Gbps), 25-36 (50 ms, 1 Gbps),
          37-50 (50 ms, 25 Gbps).
        * ``"c2"``: epochs 0-11 (1 ms, 25 Gbps), 12-19 (moderate), 20-27 (50 ms, 1 Gbps),
          28-35 (moderate), 36 onwards (1 ms, 25 Gbps). The paper does not state its
          moderate values; jaxcomm takes the geometric means of low and high, 7.07 ms and
          5 Gbps.

        Epoch ``e`` boundaries map to step ``e * total_steps // 50`` (the paper scales the same
        schedules 2x for its 100-epoch run).
        """
        total_steps = _int("total_steps", total_steps, 1)
        low_lat_high_bw = Network(_LOW_LAT_S, _HIGH_BW_BPS)
        low_lat_low_bw = Network(_LOW_LAT_S, _LOW_BW_BPS)
        high_lat_low_bw = Network(_HIGH_LAT_S, _LOW_BW_BPS)
        high_lat_high_bw = Network(_HIGH_LAT_S, _HIGH_BW_BPS)
        moderate = Network(_MODERATE_LAT_S, _MODERATE_BW_BPS)
        presets = {
            "c1": (
                (0, low_lat_high_bw),
                (12, low_lat_low_bw),
                (24, high_lat_low_bw),
                (36, high_lat_high_bw),
            ),
            "c2": (
                (0, low_lat_high_bw),
                (12, moderate),
                (20, high_lat_low_bw),
                (28, moderate),
                (36, low_lat_high_bw),
            ),
        }
        key = name.lower() if isinstance(name, str) else name
        if key not in presets:
            raise ValueError(
                f"name must be one of {', '.join(repr(k) for k in presets)}; got {name!r}"
            )
        segs: list[tuple[int, Network]] = []
        for epoch, net in presets[key]:
            step = epoch * total_steps // _PAPER_EPOCHS
            if segs and segs[-1][0] == step:  # segment shorter than one step: later one wins
                segs[-1] = (step, net)
            else:
                segs.append((step, net))
        return cls(tuple(segs))


# ------------------------------------------------------------------------------------ CommLog

# Byte counts travel in jitted state, where JAX (without x64) has no 64-bit integers; they are
# kept as two uint32 words ``[..., 2] = (low, high)``, exact up to 2**64 - 1 bytes.
_WORD = 1 << 32


def _wide_const(value: int) -> np.ndarray:
    return np.array([value % _WORD, value // _WORD], np.uint32)


def as_words(value: Any, name: str = "value") -> jax.Array:
    """A non-negative byte count as ``uint32[2]`` words ``(low, high)`` (traceable).

    ``value`` is a Python int (any size below ``2**64``), an integer scalar array (``int32`` or
    ``uint32``; traced ones are taken as non-negative), or already a ``uint32[..., 2]`` word
    pair. Concrete values are validated and the error names ``name``.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer number of bytes >= 0; got {value!r}")
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if not 0 <= v < _WORD * _WORD:
            raise ValueError(f"{name} must be in [0, 2**64) bytes; got {value!r}")
        return jnp.asarray(_wide_const(v))
    arr = value if isinstance(value, jax.core.Tracer) else jnp.asarray(value)
    if arr.dtype == jnp.uint32 and arr.ndim >= 1 and arr.shape[-1] == 2:
        return arr
    if arr.shape != () or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be an integer scalar number of bytes >= 0 (or uint32[2] words); "
            f"got {value!r}"
        )
    if not isinstance(arr, jax.core.Tracer) and int(arr) < 0:
        raise ValueError(f"{name} must be in [0, 2**64) bytes; got {value!r}")
    low = arr.astype(jnp.uint32)
    return jnp.stack([low, jnp.zeros_like(low)])


def words_add(a: jax.Array, b: jax.Array) -> jax.Array:
    """Sum of two ``uint32[..., 2]`` byte counts, with the carry from the low word."""
    low = a[..., 0] + b[..., 0]
    carry = (low < a[..., 0]).astype(jnp.uint32)
    return jnp.stack([low, a[..., 1] + b[..., 1] + carry], axis=-1)


def words_table(values: Any) -> jax.Array:
    """Python ints ``[n]`` as a constant ``uint32[n, 2]`` table (index it with a traced int)."""
    return jnp.asarray(np.stack([_wide_const(int(v)) for v in values]))


def _approx_words(w: jax.Array) -> jax.Array:
    """A byte count's words as an approximate float32 (for size-weighted ratios only)."""
    return w[..., 0].astype(jnp.float32) + w[..., 1].astype(jnp.float32) * float(_WORD)


def as_bytes(words: Any) -> np.ndarray:
    """Host value of ``uint32[..., 2]`` byte-count words: ``int64[...]`` (exact below 2**63)."""
    w = np.asarray(words).astype(np.uint64)
    return (w[..., 0] | (w[..., 1] << np.uint64(32))).astype(np.int64)


class CommLog(NamedTuple):
    """What one training step put on the wire, per worker, as jit-friendly arrays.

    Kept inside aggregator state so it flows out of a jitted step. Indexed by :data:`KINDS`.
    Byte counts are ``uint32[..., 2]`` words (exact 64-bit counts; read them on the host with
    :func:`as_bytes`).

    The modelled time of the step's communication is ``sum(rounds) * alpha +
    sum(path_bytes) * beta`` (:func:`log_time`): ``rounds`` counts the sequential messages of
    the algorithm that ran (``2 (N - 1)`` for a ring all-reduce, ``2 ceil(log2 N)`` for a
    tree), ``path_bytes`` the bytes along that chain of messages. Both are recorded by the
    algorithm itself, so a torus, a tree or an all-to-all is costed as it runs;
    :func:`collective_time` gives the same numbers from the paper's formulas where they apply.

    Attributes:
      calls: ``int32[K]`` collectives of each kind this step.
      message_bytes: ``uint32[K, 2]`` sum of their message sizes ``M`` (the dense size for
        the compressed kinds).
      sent_bytes: ``uint32[2]`` bytes this worker sent, measured from the payloads.
      ratio: ``float32[K]`` compression ratio ``c`` of the ``ag_topk``/``art_*`` kinds (1.0
        elsewhere); with several calls, the message-size-weighted mean.
      rounds: ``int32[K]`` sequential message rounds (latency terms).
      path_bytes: ``uint32[K, 2]`` bytes along the sequential rounds (bandwidth terms).
    """

    calls: jax.Array
    message_bytes: jax.Array
    sent_bytes: jax.Array
    ratio: jax.Array
    rounds: jax.Array
    path_bytes: jax.Array


def empty_log() -> CommLog:
    """A :class:`CommLog` with no collectives (zero counts and bytes, ratio 1.0)."""
    k = len(KINDS)
    return CommLog(
        calls=jnp.zeros((k,), jnp.int32),
        message_bytes=jnp.zeros((k, 2), jnp.uint32),
        sent_bytes=jnp.zeros((2,), jnp.uint32),
        ratio=jnp.ones((k,), jnp.float32),
        rounds=jnp.zeros((k,), jnp.int32),
        path_bytes=jnp.zeros((k, 2), jnp.uint32),
    )


@dataclasses.dataclass(frozen=True)
class Wire:
    """Traffic of one collective call as its algorithm runs it (static, host side).

    Built by the collectives (e.g. :func:`jaxcomm.collectives.ring_all_reduce_wire`) from the
    payload they move and the message pattern they use, and recorded with :func:`log_wire`.

    Attributes:
      kind: one of :data:`KINDS`.
      message_bytes: the message size ``M`` (bytes).
      rounds: sequential message rounds.
      path_bytes: bytes along those rounds (the largest message of each round, summed).
      sent: bytes each device on the axis sends, indexed by axis position.
      ratio: compression ratio of the compressed kinds (1.0 otherwise).
    """

    kind: str
    message_bytes: int
    rounds: int
    path_bytes: int
    sent: tuple[int, ...]
    ratio: float = 1.0

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        for name in ("message_bytes", "rounds", "path_bytes"):
            _int(name, getattr(self, name), 0)
        object.__setattr__(self, "sent", tuple(_int("sent", s, 0) for s in self.sent))


def log_collective(
    log: CommLog,
    kind: str,
    message_bytes: Any,
    sent_bytes: Any,
    *,
    rounds: int,
    path_bytes: Any,
    ratio: Any = 1.0,
    calls: int = 1,
) -> CommLog:
    """Record ``calls`` collectives of ``kind`` (total message size ``message_bytes`` bytes).

    Pure and jit-able: ``kind``, ``calls`` and ``rounds`` are static Python ints;
    ``message_bytes``, ``sent_bytes`` (bytes this worker sent) and ``path_bytes`` are Python
    ints, integer scalars or ``uint32[2]`` words (see :func:`as_words`); ``ratio`` a float or
    float32 scalar (compression ratio c; must be 1.0 for uncompressed kinds). Concrete values
    are validated; traced ones are taken as they are.
    """
    i = _check_kind(kind)
    calls = _int("calls", calls, 1)
    rounds = _int("rounds", rounds, 0)
    mb = as_words(message_bytes, "message_bytes")
    sb = as_words(sent_bytes, "sent_bytes")
    pb = as_words(path_bytes, "path_bytes")
    if not isinstance(ratio, jax.core.Tracer):
        r = _check_ratio(np.asarray(ratio).item() if np.ndim(ratio) == 0 else ratio)
        if kind not in COMPRESSED_KINDS and r != 1.0:
            raise ValueError(
                f"ratio must be 1.0 for kind {kind!r} (only {', '.join(COMPRESSED_KINDS)} take "
                f"a compression ratio); got {ratio!r}"
            )
    r = jnp.asarray(ratio, jnp.float32)
    old = log.message_bytes[i]
    new = words_add(old, mb)
    approx = _approx_words
    weighted = (log.ratio[i] * approx(old) + r * approx(mb)) / jnp.maximum(approx(new), 1.0)
    new_ratio = jnp.where(approx(new) > 0, weighted, r)
    return CommLog(
        calls=log.calls.at[i].add(jnp.int32(calls)),
        message_bytes=log.message_bytes.at[i].set(new),
        sent_bytes=words_add(log.sent_bytes, sb),
        ratio=log.ratio.at[i].set(new_ratio.astype(jnp.float32)),
        rounds=log.rounds.at[i].add(jnp.int32(rounds)),
        path_bytes=log.path_bytes.at[i].set(words_add(log.path_bytes[i], pb)),
    )


def log_wire(log: CommLog, wire: Wire, index: Any = None, *, calls: int = 1) -> CommLog:
    """Record ``calls`` runs of ``wire`` for the device at axis position ``index``.

    ``index`` (a traced ``lax.axis_index`` or a Python int) picks this device's entry of
    ``wire.sent``; it may be None only when every device sends the same.
    """
    if not isinstance(wire, Wire):
        raise TypeError(f"wire must be a Wire, got {type(wire).__name__}")
    calls = _int("calls", calls, 1)
    if index is None:
        if len(set(wire.sent)) > 1:
            raise ValueError(
                f"wire.sent differs between devices ({wire.sent}); pass index=lax.axis_index(...)"
            )
        sent = as_words(calls * wire.sent[0]) if wire.sent else as_words(0)
    else:
        sent = words_table([calls * s for s in wire.sent])[index]
    return log_collective(
        log,
        wire.kind,
        calls * wire.message_bytes,
        sent,
        rounds=calls * wire.rounds,
        path_bytes=calls * wire.path_bytes,
        ratio=wire.ratio,
        calls=calls,
    )


def merge_logs(*logs: CommLog) -> CommLog:
    """One :class:`CommLog` holding everything the given logs hold (same leading axes)."""
    if not logs:
        return empty_log()
    out = logs[0]
    for log in logs[1:]:
        total = words_add(out.message_bytes, log.message_bytes)
        approx = _approx_words

        weighted = out.ratio * approx(out.message_bytes) + log.ratio * approx(log.message_bytes)
        ratio = jnp.where(approx(total) > 0, weighted / jnp.maximum(approx(total), 1.0), 1.0)
        out = CommLog(
            calls=out.calls + log.calls,
            message_bytes=total,
            sent_bytes=words_add(out.sent_bytes, log.sent_bytes),
            ratio=ratio.astype(jnp.float32),
            rounds=out.rounds + log.rounds,
            path_bytes=words_add(out.path_bytes, log.path_bytes),
        )
    return out


def log_time(log: CommLog, network: Network) -> float:
    """Modelled communication seconds of a step's :class:`CommLog` (host side, numpy).

    ``sum(rounds) * alpha + sum(path_bytes) * beta``. Fields may be numpy or jax arrays,
    optionally with leading axes (e.g. one per worker); then the time is computed per worker
    and the maximum is returned.
    """
    if not isinstance(network, Network):
        raise ValueError(f"network must be a Network; got {network!r}")
    k = len(KINDS)
    rounds = np.asarray(log.rounds).reshape(-1, k).sum(axis=1)
    path = as_bytes(np.asarray(log.path_bytes).reshape(-1, k, 2)).sum(axis=1)
    per_worker = network.wire_seconds(rounds, path.astype(np.float64))
    return float(per_worker.max()) if per_worker.size else 0.0


def find_logs(tree: Any) -> list[CommLog]:
    """All :class:`CommLog` nodes inside a pytree (e.g. optimizer state), in leaf order."""
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, CommLog))
    return [x for x in leaves if isinstance(x, CommLog)]


# ------------------------------------------------------------------------------------ SimClock


class SimClock:
    """Simulated wall clock: per step adds measured compute and modelled communication seconds.

    With ``overlap=False`` a step takes ``compute_s + comm_s``; with ``overlap=True`` it takes
    ``max(compute_s, comm_s)`` (communication fully hidden behind compute where possible).
    ``now`` is the simulated time in seconds.
    """

    def __init__(self, overlap: bool = False) -> None:
        self.overlap: bool = bool(overlap)
        self.now: float = 0.0

    def tick(self, compute_s: float, comm_s: float) -> float:
        """Advance one step of ``compute_s`` and ``comm_s`` seconds (each >= 0); return ``now``."""
        c = _finite("compute_s", compute_s, ">= 0 seconds")
        m = _finite("comm_s", comm_s, ">= 0 seconds")
        if c < 0:
            raise ValueError(f"compute_s must be >= 0 seconds; got {compute_s!r}")
        if m < 0:
            raise ValueError(f"comm_s must be >= 0 seconds; got {comm_s!r}")
        self.now += max(c, m) if self.overlap else c + m
        return self.now

    def advance(self, seconds: float) -> float:
        """Advance by one step of ``seconds`` (>= 0) modelled elsewhere; return ``now``."""
        s = _finite("seconds", seconds, ">= 0")
        if s < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        self.now += s
        return self.now

    def state(self) -> dict[str, Any]:
        """Checkpointable state: ``{"now": seconds, "overlap": bool}``."""
        return {"now": self.now, "overlap": self.overlap}

    def restore(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state` output."""
        now = _finite("state['now']", state["now"], ">= 0 seconds")
        if now < 0:
            raise ValueError(f"state['now'] must be >= 0 seconds; got {state['now']!r}")
        self.now = now
        if "overlap" in state:
            self.overlap = bool(state["overlap"])


# ---------------------------------------------------------------------------------- Stragglers


@dataclasses.dataclass(frozen=True)
class Stragglers:
    """Deterministic stragglers and latency jitter for the simulated clock.

    Every draw is a function of ``(seed, step)`` alone (a NumPy generator seeded with that
    pair), so the same seed gives the same times in any run and on any host, and a resumed
    run continues the same sequence.

    Attributes:
      seed: seeds every draw.
      compute_sigma: per step, worker ``w``'s compute time is multiplied by
        ``exp(sigma * z)``, ``z ~ N(0, 1)`` (0: no noise).
      slow: fixed multipliers for chosen workers, e.g. ``{3: 2.0}`` (worker 3 always takes
        twice as long); applied on top of the noise.
      latency_jitter: each message's latency is ``latency * (1 + jitter * e)``, ``e ~ Exp(1)``
        (0: none). A round of a synchronous collective ends with its slowest message.
    """

    seed: int = 0
    compute_sigma: float = 0.0
    slow: Mapping[int, float] = dataclasses.field(default_factory=dict)
    latency_jitter: float = 0.0

    def __post_init__(self) -> None:
        _int("seed", self.seed, 0)
        for name in ("compute_sigma", "latency_jitter"):
            if _finite(name, getattr(self, name), ">= 0") < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for w, m in dict(self.slow).items():
            _int("slow worker", w, 0)
            if _finite(f"slow[{w}]", m, "> 0") <= 0:
                raise ValueError(f"slow[{w}] must be a multiplier > 0, got {m!r}")

    def _rng(self, *key: int) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, *key])))

    def compute_factors(self, step: int, n: int, *, stream: int = 0) -> np.ndarray:
        """``float64[n]``: each worker's compute multiplier at ``step`` (``stream`` picks an
        independent sequence, e.g. for trial steps that the clock charges beside the real
        ones)."""
        step, n = _int("step", step, 0), _int("n", n, 1)
        stream = _int("stream", stream, 0)
        bad = [w for w in self.slow if w >= n]
        if bad:
            raise ValueError(f"slow workers {bad} do not exist among n={n} workers")
        rng = self._rng(0, step, stream) if stream else self._rng(0, step)
        z = rng.standard_normal(n) if self.compute_sigma else np.zeros(n)
        factors = np.exp(self.compute_sigma * z)
        for w, m in self.slow.items():
            factors[w] *= m
        return factors

    def round_latency(
        self, step: int, rounds: int, n: int, network: Network, *, stream: int = 0
    ) -> float:
        """Seconds of latency of ``rounds`` synchronous rounds among ``n`` workers at
        ``step``: per round, the slowest of the ``n`` messages. ``stream`` picks an
        independent sequence of draws for another set of messages of the same step."""
        step, rounds, n = _int("step", step, 0), _int("rounds", rounds, 0), _int("n", n, 1)
        stream = _int("stream", stream, 0)
        if not self.latency_jitter or not rounds:
            return rounds * network.latency_s
        rng = self._rng(1, step, stream) if stream else self._rng(1, step)
        extra = rng.exponential(size=(rounds, n)).max(axis=1)
        return float(network.latency_s * (rounds + self.latency_jitter * extra.sum()))

    def message_latencies(
        self, step: int, shape: tuple[int, ...], network: Network, *, stream: int = 0
    ) -> np.ndarray:
        """``float64[shape]``: each message's latency at ``step``, ``alpha (1 + jitter e)``
        with ``e ~ Exp(1)`` drawn per message (``alpha`` alone without jitter). ``stream``
        picks an independent sequence for another set of messages of the same step."""
        step, stream = _int("step", step, 0), _int("stream", stream, 0)
        shape = tuple(_int("shape", d, 0) for d in shape)
        if not self.latency_jitter:
            return np.full(shape, network.latency_s)
        e = self._rng(2, step, stream).exponential(size=shape)
        return network.latency_s * (1.0 + self.latency_jitter * e)

    def step_seconds(
        self,
        step: int,
        workers: int,
        compute_s: Any,
        rounds: int,
        path_bytes: float,
        network: Network,
        *,
        overlap: bool = False,
        stream: int = 0,
    ) -> tuple[float, float, float]:
        """``(step, compute, comm)`` seconds of a synchronous step.

        Args:
          step: the step index (0-based), keying the draws.
          workers: the workers ``n`` that synchronise.
          compute_s: each worker's compute seconds before noise, ``float[n]`` or one value
            for all.
          rounds: message rounds of the step's collectives (on the busiest worker).
          path_bytes: bytes along those rounds.
          network: latency and bandwidth.
          overlap: hide communication behind compute (``max``) instead of adding it.
          stream: an independent sequence of draws for steps beside the numbered ones
            (0: the step's own draws).

        The collectives start when the slowest worker is done, so ``compute`` is the largest
        noisy compute time; ``comm`` is :meth:`round_latency` plus ``path_bytes * beta``.
        """
        n = _int("workers", workers, 1)
        base = np.asarray(compute_s, np.float64)
        if base.shape not in ((), (n,)) or (base < 0).any() or not np.isfinite(base).all():
            raise ValueError(f"compute_s must be one or {n} finite seconds >= 0, got {compute_s!r}")
        factors = self.compute_factors(step, n, stream=stream)
        compute = float((np.broadcast_to(base, (n,)) * factors).max())
        latency = self.round_latency(step, rounds, n, network, stream=stream)
        comm = network.wire_seconds(rounds, float(path_bytes), latency_s=latency)
        return (max(compute, comm) if overlap else compute + comm), compute, comm
