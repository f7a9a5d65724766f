"""Replica groups under failures: a random group is killed every ~60 steps.

    python benchmarks/groups_chaos.py [--groups 2] [--steps 600] [--kill-every 60]
                                      [--batch 64] [--period 10] [--overlap 1]
                                      [--restart-after 0] [--no-spare] [--quick]

``python -m train.groups --groups N --cpus-per-group 1`` trains the GPT of
``configs/diloco_default.yaml`` (1 worker a group, ``--batch`` sequences a step: 64, the
README job's global batch; Streaming DiLoCo with H = ``--period`` 10, 2 fragments,
``--overlap`` 1, int8 pseudo-gradients: an exchange every 5 steps, so a restarted group
soon meets a quorum that heals it; each group on a CPU core of its own, as if on a
machine of its own, so a dead group's core idles as a dead machine would) twice: without
faults (the reference) and with ``--chaos-every-steps``: each time the run (its furthest
live group) has gone ``--kill-every`` steps plus a random 0-9 since the last kill, the schedule of
``benchmarks/elastic_chaos.py``, one training group is killed with SIGKILL (never the
last one, nor while another is on its way back) and started again ``--restart-after``
seconds later with nothing of its own on disk; the live groups never stop, and the
restarted group is healed from them at its first exchange. A third run repeats the
failures with ``--spare``: each restart is a fork of a hot spare loaded before the groups
started (``--no-spare`` leaves it out).

Time lost per failure is the killed group's absence: from the kill to its first exchange
after the restart (the one that heals it). The exchanges the others lost are those that
failed on every try (a member lost mid-exchange is retried with a new quorum).

Goodput is the samples that entered ``theta_sync`` (every committed exchange's kept
members' samples, from the groups' ``exchanges.jsonl``, which a restarted group appends to)
per second of the training span (from the first step of any group to the last), against the
fault-free run's; over the launcher's whole wall time too (which adds the processes' start
and compilation, paid by both runs). The final model's
validation loss of both runs is reported beside it.

Writes ``benchmarks/results/groups/chaos.{md,json,png}`` (``chaos_h<H>.*`` for another
``--period`` or ``--overlap``; the plot: every group's training
loss against wall time, both runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _meta import run_meta

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results" / "groups"
SETS = ["workers=1", "aggregator=ring", "sync.fragments=2", "sync.compress=int8",
        "compute=measured", "eval_every=0", "checkpoint_every=0", "eval_batches=4",
        "groups.start_timeout_s=120",
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


def run(folder: Path, groups: int, steps: int, chaos: list[str], batch: int = 64,
        period: int = 10, overlap: int = 1) -> dict:  # fmt: skip
    pin = ["--cpus-per-group", "1"] if groups <= len(os.sched_getaffinity(0)) else []
    cmd = [sys.executable, "-m", "train.groups", "--groups", str(groups), "--grace-ms", "500",
           "--heartbeat-ms", "2000", "--config", "configs/diloco_default.yaml",
           "--out", str(folder), *pin, *chaos]  # fmt: skip
    own = [f"steps={steps}", f"global_batch={batch}", f"sync.period={period}",
           f"sync.overlap={overlap}"]  # fmt: skip
    for s in [*SETS, *own]:
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
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--kill-every", type=int, default=60, help="steps between kills (+0-9)")
    p.add_argument("--batch", type=int, default=64, help="sequences a group's step")
    p.add_argument("--restart-after", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-spare", action="store_true", help="no third run with a hot spare")
    p.add_argument("--quick", action="store_true", help="2 groups, 150 steps of 8 sequences")
    p.add_argument("--period", type=int, default=10, help="H (2 fragments)")
    p.add_argument("--overlap", type=int, default=1, help="steps an exchange overlaps")
    p.add_argument("--report-only", action="store_true", help="rewrite the report from the json")
    args = p.parse_args(argv)
    stem = "chaos" if (args.period, args.overlap) == (10, 1) else f"chaos_h{args.period}"
    if args.report_only:
        report(json.loads((OUT / f"{stem}.json").read_text()), stem)
        return
    t0 = time.time()
    groups, steps, batch = (2, 150, 8) if args.quick else (args.groups, args.steps, args.batch)
    base = Path(tempfile.mkdtemp(prefix="groups_chaos_"))
    try:
        sync = {"batch": batch, "period": args.period, "overlap": args.overlap}
        free = run(base / "free", groups, steps, [], **sync)
        print("fault-free", json.dumps(free), flush=True)
        chaos = ["--chaos-every-steps", str(args.kill_every), "--restart-after",
                 str(args.restart_after), "--chaos-seed", str(args.seed)]  # fmt: skip
        faulty = run(base / "chaos", groups, steps, chaos, **sync)
        print("chaos", json.dumps(faulty), flush=True)
        spared = None
        if not args.no_spare:
            spared = run(base / "spare", groups, steps, [*chaos, "--spare"], **sync)
            print("chaos, hot spare", json.dumps(spared), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    meta = run_meta(argv, t0, groups=groups, steps=steps, batch=batch, period=args.period,
                    overlap=args.overlap, kill_every=args.kill_every,
                    restart_after=args.restart_after)  # fmt: skip
    result = {"fault_free": free, "chaos": faulty, "meta": meta}
    if spared is not None:
        result["chaos_spare"] = spared
    OUT.mkdir(parents=True, exist_ok=True)
    report(result, stem)


def report(result: dict, stem: str = "chaos") -> None:
    """Write ``<stem>.{json,md,png}`` from the runs in ``result``."""
    meta, free, faulty = result["meta"], result["fault_free"], result["chaos"]
    spared = result.get("chaos_spare")
    result["goodput"] = faulty["goodput_in_span"] / free["goodput_in_span"]
    result["goodput_whole_wall"] = faulty["goodput_samples_per_s"] / free["goodput_samples_per_s"]
    if spared is not None:
        result["goodput_spare"] = spared["goodput_in_span"] / free["goodput_in_span"]
    runs = [("fault-free", free, "-"), ("chaos", faulty, ":")]
    runs += [("chaos, hot spare", spared, "--")] if spared is not None else []
    plot(runs, OUT / f"{stem}.png")
    (OUT / f"{stem}.json").write_text(json.dumps(result, indent=2))
    step_s = free["train_span_s"] / meta["steps"]  # a group's step, fault-free
    ref = sum(free["valid_loss"]) / len(free["valid_loss"])
    lines = [
        "# Replica groups under failures",
        "",
        f"`{meta['command']}` on {meta['date']}, {meta['machine']}, JAX {meta['jax']}: "
        f"{meta['groups']} groups of 1 worker ({meta['batch']} sequences a step, each group "
        f"on a core of its own; H = {meta.get('period', 10)}, 2 fragments, overlap "
        f"{meta.get('overlap', 1)}), {meta['steps']} steps each; a group killed each time the run "
        f"has gone {meta['kill_every']} steps (+ a random 0-9) since the last kill and "
        f"restarted {meta['restart_after']:g} s later with nothing on disk (healed from the "
        "live groups); the hot spare's restarts are forks of one process loaded before the "
        f"groups start. A fault-free step took {1e3 * step_s:.0f} ms.",
        "",
        "| run | wall (s) | training span (s) | kills | exchanges (failed) "
        "| samples into theta_sync | vs fault-free | goodput (samples/s of the span) "
        "| vs fault-free "
        "| lost per failure (s) | lost per failure (steps) | validation loss | vs fault-free |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r, _ in runs:
        lost = r["lost_per_failure_s"]
        mean = sum(lost) / len(lost) if lost else None
        lost_text = (
            f"{mean:.1f} (mean of {len(lost)}; {min(lost):.1f}-{max(lost):.1f})" if lost else "-"
        )
        steps_text = f"{mean / step_s:.1f}" if lost else "-"
        loss = sum(r["valid_loss"]) / len(r["valid_loss"])
        lines.append(
            f"| {name} | {r['loop_wall_s']:.1f} | {r['train_span_s']:.1f} | {r['kills']} "
            f"| {r['exchanges']} ({r['failed_exchanges']}) | {r['samples_in']:,} "
            f"| {r['samples_in'] / free['samples_in']:.2f}x | {r['goodput_in_span']:.1f} "
            f"| {r['goodput_in_span'] / free['goodput_in_span']:.2f}x | {lost_text} "
            f"| {steps_text} | {', '.join(f'{v:.3f}' for v in r['valid_loss'])} "
            f"| {loss / ref - 1:+.1%} |"
        )
    lines += [
        "",
        f"Samples into the model under failures: "
        f"**{faulty['samples_in'] / free['samples_in']:.2f}x** the fault-free run's"
        + (
            f"; with a hot spare **{spared['samples_in'] / free['samples_in']:.2f}x**"
            if spared
            else ""
        )
        + f". Per second of the training span: {result['goodput']:.2f}x"
        + (f" and {result['goodput_spare']:.2f}x." if spared else "."),
        "",
        "The chaos runs' training spans are shorter than the fault-free run's because their "
        "steps were faster throughout, with both groups up as well: a difference of pace "
        "between runs on this machine, not an effect of the failures. The samples' ratio, "
        "which the pace does not enter, is the goodput to quote.",
        "",
        f"![loss against wall time]({stem}.png)",
    ]
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
