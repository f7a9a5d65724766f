"""Per-step cost of running the same data-parallel job as several processes on one machine.

Runs the README's main job (``configs/dp_default.yaml``: GPT, 8 workers, dense ring
all-reduce) for ``--steps`` steps as 1 process with 8 CPU devices and through
``python -m train.launch`` as 2 and 4 processes (4 and 2 devices each; collectives between
processes over gloo on loopback), in interleaved rounds, and reports the median of each
run's ``compute_s`` (the measured step, collectives included) from step 3 on, and its ratio
to the single process. Losses are checked equal to 1e-5 across the runs.

    python benchmarks/multiprocess_overhead.py [--steps 20] [--rounds 2]

Writes ``multiprocess_overhead.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _meta import run_meta

ROOT = Path(__file__).resolve().parents[1]


def run(processes: int, steps: int, out: Path) -> list[dict]:
    sets = [f"steps={steps}", "checkpoint_every=0", "eval_every=0", "eval_batches=1",
            "compute=measured", "progress=false", f"out_dir={out}"]  # fmt: skip
    args = ["--config", "configs/dp_default.yaml"]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if processes == 1:
        cmd = [sys.executable, "-m", "train", *args]
    else:
        cmd = [sys.executable, "-m", "train.launch", "--processes", str(processes), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    return rows, summary["wall_s"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    t0 = time.time()
    counts = (1, 2, 4)
    medians: dict[int, list[float]] = {c: [] for c in counts}
    walls: dict[int, list[float]] = {c: [] for c in counts}
    losses: dict[int, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for c in counts:
                rows, wall = run(c, args.steps, Path(tmp) / f"{c}_{r}")
                medians[c].append(statistics.median(x["compute_s"] for x in rows[2:]))
                walls[c].append(wall / args.steps)
                losses[c] = [x["loss"] for x in rows]
    for c in counts:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses[c], losses[1], strict=True))
        if worst > 1e-5:
            raise SystemExit(f"{c} processes: losses differ from 1 process by {worst:.2e}")
    base = statistics.median(medians[1])
    base_wall = statistics.median(walls[1])
    rows = [
        {
            "processes": c,
            "devices_per_process": 8 // c,
            "step_s": statistics.median(medians[c]),
            "ratio": statistics.median(medians[c]) / base,
            "wall_per_step_s": statistics.median(walls[c]),
            "wall_ratio": statistics.median(walls[c]) / base_wall,
            "rounds": medians[c],
            "wall_rounds": walls[c],
        }
        for c in counts
    ]
    meta = run_meta(argv, t0, steps=args.steps, rounds=args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multiprocess_overhead.json").write_text(
        json.dumps({**meta, "rows": rows}, indent=2)
    )
    lines = [
        "# The README's main job as 1, 2 and 4 processes on one machine",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; JAX {meta['jax']}",
        f"- {args.steps} steps per run, median `compute_s` from step 3, median of "
        f"{args.rounds} interleaved rounds; losses equal to 1e-5 across process counts",
        "",
        "| processes | CPU devices each | step program (s) | vs 1 process "
        "| loop wall time per step (s) | vs 1 process |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['processes']} | {r['devices_per_process']} | {r['step_s']:.3f} "
            f"| {r['ratio']:.2f} | {r['wall_per_step_s']:.3f} | {r['wall_ratio']:.2f} |"
        )
    lines += [
        "",
        "Step program: median `compute_s` (the step's programs, collectives included). "
        "Loop wall time: the run's `wall_s` (from the compiled step to the end: every step's "
        "host work, the host reads' all-gather between processes, one final evaluation and "
        "the files) over its steps. All processes share this machine's cores; between "
        "processes the ring's messages go through gloo over loopback TCP instead of "
        "in-process copies.",
        "",
    ]
    (args.out / "multiprocess_overhead.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
