"""A run's summary for people: what ``python -m train`` prints at the end and writes as
``summary.txt`` beside ``summary.json``."""

from __future__ import annotations

from typing import Any

__all__ = ["format_summary"]

# Keys shown in the lines above; the rest follow as "key: value".
_SHOWN = (
    "name", "steps", "resumed", "final_loss", "valid_loss", "valid_accuracy", "params",
    "sent_bytes_mean", "sent_bytes_peak", "sent_bytes_total", "dense_ring_bytes_per_step",
    "sent_vs_dense_ring", "sim_time_s", "network", "compute", "wall_s",
    "sim_compute_s_per_step", "comm_s_per_step", "already_complete",
)  # fmt: skip


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n:,.0f} B ({n / size:,.2f} {unit})"
    return f"{n:,.0f} B"


def _seconds(s: float) -> str:
    return f"{s * 1e3:,.2f} ms" if s < 1 else f"{s:,.2f} s"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10_000:
        return f"{v:,}"
    return str(v)


def format_summary(s: dict[str, Any]) -> str:
    """Readable lines of a trainer's summary: losses, model size, bytes a worker sent (mean
    and peak a step, the run's total, and against a dense float32 ring; thousands separators
    and MB), simulated time split into compute and communication a step, then every other
    entry."""
    resumed = " (resumed)" if s.get("resumed") else ""
    lines = [f"== {s.get('name', 'run')}: {s.get('steps')} steps{resumed} =="]
    if s.get("already_complete"):
        lines.append("(already complete: nothing was run)")
    loss = s.get("final_loss")
    valid = [f"{s['valid_loss']:.4g} validation"] if s.get("valid_loss") is not None else []
    if s.get("valid_accuracy") is not None:
        valid.append(f"accuracy {100 * s['valid_accuracy']:.1f}%")
    train = [f"{loss:.4g} training"] if loss is not None else []
    lines.append(f"{'loss':<16}{', '.join(train + valid) or '-'}")
    if s.get("params") is not None:
        lines.append(f"{'parameters':<16}{s['params']:,}")
    if s.get("sent_bytes_mean") is not None:
        lines.append(
            f"{'sent a step':<16}{_bytes(s['sent_bytes_mean'])} mean, "
            f"{_bytes(s['sent_bytes_peak'])} peak, by the busiest worker of each step"
        )
        lines.append(
            f"{'sent in all':<16}{_bytes(s['sent_bytes_total'])}, the busiest worker of each "
            "step summed over the steps"
        )
        if s.get("sent_vs_dense_ring") is not None:
            lines.append(
                f"{'vs float32 ring':<16}{s['sent_vs_dense_ring']:.4g}x the bytes of a dense "
                f"float32 ring all-reduce of this model ({_bytes(s['dense_ring_bytes_per_step'])}"
                " a step)"
            )
    if s.get("sim_time_s") is not None:
        where = f" ({s.get('compute')} compute, {s.get('network')} network)"
        line = f"{'simulated time':<16}{_seconds(s['sim_time_s'])}{where}"
        if s.get("sim_compute_s_per_step") is not None:
            line += (
                f": {_seconds(s['sim_compute_s_per_step'])} compute + "
                f"{_seconds(s['comm_s_per_step'])} communication a step"
            )
        lines.append(line)
    if s.get("wall_s") is not None:
        lines.append(f"{'wall time':<16}{_seconds(s['wall_s'])} on this machine")
    rest = [(k, v) for k, v in s.items() if k not in _SHOWN]
    width = max((len(k) for k, _ in rest), default=0)
    lines += [f"{k:<{max(width, 15)}} {_value(v)}" for k, v in rest]
    return "\n".join(lines)
