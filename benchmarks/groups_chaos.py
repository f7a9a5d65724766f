"""Replica groups under failures: a random group is killed every few seconds.

    python benchmarks/groups_chaos.py [--groups 3] [--steps 800] [--chaos-every 15]
                                      [--restart-after 3] [--quick]

``python -m train.groups --groups N`` trains a small GPT (1 worker a group, Streaming DiLoCo
with period 10 and 2 fragments, overlap 1, int8 pseudo-gradients) twice on this machine:
without faults (the reference) and with ``--chaos-every S``: every ``S`` seconds one
training group is killed with SIGKILL (never the last one), and started again
``--restart-after`` seconds later with nothing of its own on disk; the live groups never
stop, and the restarted group is healed from them at its first exchange.

Goodput is the samples that entered ``theta_sync`` (every committed exchange's kept
members' samples, from the groups' ``exchanges.jsonl``, which a restarted group appends to)
per second of the run's wall time, against the fault-free run's. The final model's
validation loss of both runs is reported beside it.

Writes ``benchmarks/results/groups/chaos.{md,json}``.
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
        "eval_batches=4", "groups.start_timeout_s=120"]  # fmt: skip


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
    report = json.loads((folder / "groups.json").read_text())
    total, exchanges = samples_in(folder, groups)
    losses = []
    for g in range(groups):
        path = folder / f"group_{g}" / "summary.json"
        if path.is_file():
            losses.append(json.loads(path.read_text())["valid_loss"])
    kills = [x for x in proc.stdout.splitlines() if x.startswith("chaos: killed")]
    return {
        "wall_s": wall,
        "loop_wall_s": report["wall_s"],
        "samples_in": total,
        "exchanges": exchanges,
        "goodput_samples_per_s": total / report["wall_s"],
        "kills": len(kills),
        "restarts": report["restarts"],
        "valid_loss": losses,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--chaos-every", type=float, default=15.0)
    p.add_argument("--restart-after", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
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
    finally:
        shutil.rmtree(base, ignore_errors=True)
    goodput = faulty["goodput_samples_per_s"] / free["goodput_samples_per_s"]
    meta = run_meta(argv, t0, groups=groups, steps=steps)
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "fault_free": free, "chaos": faulty, "goodput": goodput}
    (OUT / "chaos.json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Replica groups under failures",
        "",
        f"`{meta['command']}` on {meta['date']}, {meta['machine']}, JAX {meta['jax']}: "
        f"{groups} groups of 1 worker, {steps} steps each; a group killed every "
        f"{args.chaos_every:g} s and restarted {args.restart_after:g} s later with nothing on "
        "disk (healed from the live groups).",
        "",
        "| run | wall (s) | kills | exchanges | samples into theta_sync | goodput (samples/s) "
        "| validation loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in (("fault-free", free), ("chaos", faulty)):
        lines.append(
            f"| {name} | {r['loop_wall_s']:.1f} | {r['kills']} | {r['exchanges']} "
            f"| {r['samples_in']:,} | {r['goodput_samples_per_s']:.1f} "
            f"| {', '.join(f'{v:.3f}' for v in r['valid_loss'])} |"
        )
    lines += ["", f"Goodput under failures: **{goodput:.2f}x** the fault-free run's."]
    (OUT / "chaos.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
