"""Replica groups under failures: a random group is killed every few seconds.

    python benchmarks/groups_chaos.py [--groups 3] [--steps 800] [--chaos-every 15]
                                      [--restart-after 3] [--no-spare] [--quick]

``python -m train.groups --groups N`` trains a small GPT (1 worker a group, Streaming DiLoCo
with period 10 and 2 fragments, overlap 1, int8 pseudo-gradients) twice on this machine:
without faults (the reference) and with ``--chaos-every S``: every ``S`` seconds one
training group is killed with SIGKILL (never the last one), and started again
``--restart-after`` seconds later with nothing of its own on disk; the live groups never
stop, and the restarted group is healed from them at its first exchange. A third run
repeats the failures with ``--spare``: the restart is handed to a hot spare that has its
libraries loaded (``--no-spare`` leaves it out).

Time lost per failure is the killed group's absence: from the kill to its first exchange
after the restart (the one that heals it). The exchanges the others lost are those that
failed on every try (a member lost mid-exchange is retried with a new quorum).

Goodput is the samples that entered ``theta_sync`` (every committed exchange's kept
members' samples, from the groups' ``exchanges.jsonl``, which a restarted group appends to)
per second of the training span (from the first step of any group to the last), against the
fault-free run's; over the launcher's whole wall time too (which adds the processes' start
and compilation, paid by both runs). The final model's
validation loss of both runs is reported beside it.

Writes ``benchmarks/results/groups/chaos.{md,json,png}`` (the plot: every group's training
loss against wall time, both runs).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _meta import run_meta

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "groups"
SETS = ["workers=1", "global_batch=8", "aggregator=ring", "model.num_layers=2",
        "model.width=64", "sync.period=10", "sync.fragments=2", "sync.overlap=1",
        "sync.compress=int8", "compute=measured", "eval_every=0", "checkpoint_every=0",
        "eval_batches=4", "groups.start_timeout_s=120",
        # The paper's outer step, as the recorded runs had it (the config's is averaging).
        "sync.outer_lr=0.7", "sync.outer_momentum=0.9"]  # fmt: skip


def samples_in(folder: Path, groups: int) -> tuple[int, int]:
    """Samples that entered theta_sync over the run and the exchanges committed: each
    exchange (by its count) once, from whichever group logged it."""
    seen: dict[int, int] = {}
    for g in range(groups):
        path = folder / f"group_{g}" / "exchanges.jsonl"
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            e = json.loads(line)
            seen.setdefault(e["exchange"], e["samples_in"])
    return sum(seen.values()), len(seen)


def curves(folder: Path, groups: int, started: float) -> list[tuple[list[float], list[float]]]:
    """Each group's (wall seconds since the start, training loss) of its metrics rows."""
    out = []
    for g in range(groups):
        path = folder / f"group_{g}" / "metrics.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
        rows = [r for r in rows if "group_time" in r]
        out.append(([r["group_time"] - started for r in rows], [r["loss"] for r in rows]))
    return out


def run(folder: Path, groups: int, steps: int, chaos: list[str]) -> dict:
    cmd = [sys.executable, "-m", "train.groups", "--groups", str(groups), "--grace-ms", "500",
           "--heartbeat-ms", "2000", "--config", "configs/diloco_default.yaml",
           "--out", str(folder), *chaos]  # fmt: skip
    for s in [*SETS, f"steps={steps}"]:
        cmd += ["--set", s]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    wall = time.time() - t0
    if proc.returncode:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    report = json.loads((folder / "summary.json").read_text())
    total, exchanges = samples_in(folder, groups)
    losses = []
    for g in range(groups):
        path = folder / f"group_{g}" / "summary.json"
        if path.is_file():
            losses.append(json.loads(path.read_text())["valid_loss"])
    failed = 0
    for g in range(groups):
        path = folder / f"group_{g}" / "summary.json"
        if path.is_file():
            failed += json.loads(path.read_text())["groups"]["failed"]
    times = [t for c in curves(folder, groups, 0.0) for t in c[0]]
    span = max(times) - min(times)  # first step to last: the startup both runs pay left out
    return {
        "wall_s": wall,
        "train_span_s": span,
        "goodput_in_span": total / span,
        "lost_per_failure_s": report["lost_per_failure_s"],  # the launcher's summary
        "failed_exchanges": failed,
        "curves": curves(folder, groups, report["started"]),
        "loop_wall_s": report["wall_s"],
        "samples_in": total,
        "exchanges": exchanges,
        "goodput_samples_per_s": total / report["wall_s"],
        "kills": len(report["kills"]),
        "restarts": report["restarts"],
        "spares_taken": report.get("spares_taken", 0),
        "valid_loss": losses,
    }


def plot(runs: list[tuple[str, dict, str]], path: Path) -> None:
    """Every group's training loss against wall time of each ``(name, run, line style)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r, style in runs:
        for g, (t, loss) in enumerate(r["curves"]):
            ax.plot(t, loss, style, lw=1, label=f"{name}, group {g}")
    ax.set_xlabel("wall time since the start (s)")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--chaos-every", type=float, default=15.0)
    p.add_argument("--restart-after", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-spare", action="store_true", help="no third run with a hot spare")
    p.add_argument("--quick", action="store_true", help="2 groups, 200 steps")
    args = p.parse_args(argv)
    t0 = time.time()
    groups, steps = (2, 200) if args.quick else (args.groups, args.steps)
    base = Path(tempfile.mkdtemp(prefix="groups_chaos_"))
    try:
        free = run(base / "free", groups, steps, [])
        print("fault-free", json.dumps(free), flush=True)
        every = str(args.chaos_every)
        chaos = ["--chaos-every", every, "--chaos-start", every, "--restart-after",
                 str(args.restart_after), "--chaos-seed", str(args.seed)]  # fmt: skip
        faulty = run(base / "chaos", groups, steps, chaos)
        print("chaos", json.dumps(faulty), flush=True)
        spared = None if args.no_spare else run(base / "spare", groups, steps, [*chaos, "--spare"])
        if spared is not None:
            print("chaos, hot spare", json.dumps(spared), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    goodput = faulty["goodput_in_span"] / free["goodput_in_span"]
    goodput_wall = faulty["goodput_samples_per_s"] / free["goodput_samples_per_s"]
    runs = [("fault-free", free, "-"), ("chaos", faulty, ":")]
    runs += [("chaos, hot spare", spared, "--")] if spared is not None else []
    plot(runs, OUT / "chaos.png")
    meta = run_meta(argv, t0, groups=groups, steps=steps)
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "fault_free": free, "chaos": faulty, "goodput": goodput,
              "goodput_whole_wall": goodput_wall}  # fmt: skip
    if spared is not None:
        result["chaos_spare"] = spared
        result["goodput_spare"] = spared["goodput_in_span"] / free["goodput_in_span"]
    (OUT / "chaos.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Replica groups under failures",
        "",
        f"`{meta['command']}` on {meta['date']}, {meta['machine']}, JAX {meta['jax']}: "
        f"{groups} groups of 1 worker, {steps} steps each; a group killed every "
        f"{args.chaos_every:g} s and restarted {args.restart_after:g} s later with nothing on "
        "disk (healed from the live groups).",
        "",
        "| run | wall (s) | training span (s) | kills | exchanges (failed) "
        "| samples into theta_sync | goodput (samples/s of the span) | lost per failure (s) "
        "| validation loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r, _ in runs:
        lost = r["lost_per_failure_s"]
        lost_text = f"{sum(lost) / len(lost):.1f} (mean of {len(lost)})" if lost else "-"
        lines.append(
            f"| {name} | {r['loop_wall_s']:.1f} | {r['train_span_s']:.1f} | {r['kills']} "
            f"| {r['exchanges']} ({r['failed_exchanges']}) | {r['samples_in']:,} "
            f"| {r['goodput_in_span']:.1f} | {lost_text} "
            f"| {', '.join(f'{v:.3f}' for v in r['valid_loss'])} |"
        )
    lines += [
        "",
        f"Goodput under failures: **{goodput:.2f}x** the fault-free run's"
        + (f"; with a hot spare **{result['goodput_spare']:.2f}x**." if spared else "."),
        "",
        "![loss against wall time](chaos.png)",
    ]
    (OUT / "chaos.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
