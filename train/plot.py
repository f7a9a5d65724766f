"""Plots of a run's metrics: loss against step and against simulated wall-clock time."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_metrics", "read_metrics"]


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(
    metrics: str | Path | dict[str, str | Path], out: str | Path, *, title: str = ""
) -> Path:
    """Write a PNG with training loss vs step and vs simulated time.

    Args:
      metrics: one ``metrics.jsonl`` path, or ``{label: path}`` to overlay several runs.
      out: PNG path.
      title: figure title.
    """
    runs = metrics if isinstance(metrics, dict) else {"": metrics}
    fig, (ax_step, ax_time) = plt.subplots(1, 2, figsize=(11, 4))
    for label, path in runs.items():
        rows = read_metrics(path)
        if not rows:
            continue
        steps = [r["step"] for r in rows]
        loss = [r["loss"] for r in rows]
        sim = [r["sim_time_s"] for r in rows]
        ax_step.plot(steps, loss, label=label or None, lw=1.2)
        ax_time.plot(sim, loss, label=label or None, lw=1.2)
        vsteps = [r["step"] for r in rows if "valid_loss" in r]
        if vsteps:
            vloss = [r["valid_loss"] for r in rows if "valid_loss" in r]
            ax_step.plot(vsteps, vloss, "o--", ms=3, label=f"{label} valid".strip())
    ax_step.set_xlabel("step")
    ax_time.set_xlabel("simulated time (s)")
    for ax in (ax_step, ax_time):
        ax.set_ylabel("training loss")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
