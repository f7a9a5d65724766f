"""Chaos test of the elastic launcher: a random process is killed every K steps.

    python benchmarks/elastic_chaos.py [--steps 300] [--kill-every 50] [--quick]

The run is ``python -m train.launch --processes 4 --min-processes 1`` on this machine (each
process 2 simulated CPU devices: 8 workers), a small GPT of ``configs/dp_default.yaml``
with a checkpoint every 10 steps. This script plays the cluster:

* every ``--kill-every`` steps (plus a random 0-9, so kills fall anywhere between two
  checkpoints) it sends ``kill -9`` to one live process, chosen at random (seeded); the
  launcher stops the others and restarts the survivors on the largest world they can form
  (3 survivors of 2 devices make 6 workers, which do not divide the global batch of 16:
  2 processes, 4 workers), resized from the newest checkpoint;
* ``--kill-every / 2`` steps after a restart on fewer processes, replacements "arrive": it
  stops the launcher with SIGTERM (every process saves a checkpoint and exits) and starts it
  again on 4 processes with ``--resume`` (4 workers resized back to 8).

It runs three times: without faults (the reference), with faults and JAX's persistent
compilation cache off, and with faults and the cache on (the launcher's default in elastic
mode). It reports, for each, the wall time, the goodput (steps of the finished run per
second of wall time), the failures survived, the time lost per failure (from the kill to
the run being back at the step it had reached: restart, restore, compile and the steps
redone since the checkpoint) and per planned regrow, and the final loss against the
reference. Everything is bounded by ``--timeout`` seconds per run.

Writes ``benchmarks/results/elastic/chaos.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results" / "elastic"
SETS = ["model.num_layers=1", "model.width=32", "model.seq_len=32", "workers=8",
        "global_batch=16", "checkpoint_every=10", "eval_every=0", "progress=false"]  # fmt: skip


class Launcher:
    """One ``python -m train.launch`` run in the background, its live pids kept current
    from the lines it prints (``[launch] process i: pid N`` at every start)."""

    def __init__(self, processes: int, run: Path, steps: int, resume: bool, cache: str):
        args = ["--processes", str(processes), "--min-processes", "1", "--max-restarts", "100",
                "--compile-cache", cache, "--config", "configs/dp_default.yaml"]  # fmt: skip
        for s in [*SETS, f"steps={steps}", f"out_dir={run}"]:
            args += ["--set", s]
        if resume:
            args.append("--resume")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "train.launch", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.pids: dict[int, int] = {}
        self.log: list[str] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._read, args=(self.proc.stderr, True), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stdout, False), daemon=True).start()

    def _read(self, stream, launcher_lines: bool) -> None:
        for line in stream:
            with self.lock:
                self.log.append(line.rstrip())
                if launcher_lines and line.startswith("[launch] process ") and ": pid " in line:
                    head, pid = line.split(": pid ")
                    i = int(head.split()[-1])
                    if i == 0:
                        self.pids = {}  # a new start
                    self.pids[i] = int(pid)

    def restarts(self) -> int:
        """Lost processes this launcher has reported (each followed by a restart)."""
        with self.lock:
            return sum("lost (SIGKILL)" in x for x in self.log)

    def restarted(self, count: int) -> bool:
        """Whether the launcher has reported ``count`` lost processes."""
        return self.restarts() >= count

    def live(self) -> dict[int, int]:
        with self.lock:
            return dict(self.pids)


def _last_step(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = path.read_text().splitlines()
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except (json.JSONDecodeError, KeyError):
        return 0  # a line being written


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _wait_back(run: Path, step: int, deadline: float) -> float | None:
    """Seconds until the run's metrics reach past ``step`` again (None: the deadline)."""
    t0 = time.monotonic()
    while time.monotonic() < deadline:
        if _last_step(run) > step:
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def chaos(run: Path, steps: int, kill_every: int, faults: bool, cache: str, seed: int,
          timeout: float) -> dict:  # fmt: skip
    """One run; ``faults=False`` is the reference."""
    shutil.rmtree(run, ignore_errors=True)
    rng = random.Random(seed)
    t0 = time.monotonic()
    deadline = t0 + timeout
    launcher = Launcher(4, run, steps, resume=False, cache=cache)
    failures, regrows, events = [], [], []
    # Kills land at a random step within a checkpoint interval (checkpoints every 10), so
    # the steps redone since the newest checkpoint are part of what a failure costs.
    next_kill, kills = kill_every + rng.randrange(10), 0  # kills: this launcher's
    restarts_logged = 0
    trace: list[tuple[float, int]] = []  # (seconds, last logged step), for the plot
    sampler = threading.Thread(target=_sample, args=(run, t0, trace, deadline), daemon=True)
    sampler.start()
    while launcher.proc.poll() is None and time.monotonic() < deadline:
        step = _last_step(run)
        if faults and step >= next_kill and step < steps - 5:
            live = launcher.live()
            if len(live) >= 2:
                victim = rng.choice(sorted(live))
                os.kill(live[victim], signal.SIGKILL)
                t_kill = time.monotonic()
                # The step the run had reached: read once the launcher has stopped the
                # survivors (a step in flight at the kill may still have been logged).
                kills += 1
                while not launcher.restarted(kills) and time.monotonic() < deadline:
                    time.sleep(0.02)
                step = _last_step(run)
                back = _wait_back(run, step, deadline)
                lost = None if back is None else time.monotonic() - t_kill
                t_kill -= t0
                failures.append({"step": step, "process": victim, "at_s": t_kill,
                                 "lost_s": lost, "processes_before": len(live)})  # fmt: skip
                events.append(("kill", step, t_kill))
                next_kill = step + kill_every + rng.randrange(10)
                # Replacements arrive: a planned restart on 4 processes.
                regrow_at = step + kill_every // 2
                while _last_step(run) < regrow_at and launcher.proc.poll() is None:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
                if launcher.proc.poll() is None and _last_step(run) < steps - 5:
                    t_stop = time.monotonic()
                    launcher.proc.send_signal(signal.SIGTERM)
                    launcher.proc.wait(timeout=120)
                    at = _last_step(run)  # with the steps finished before the stop
                    restarts_logged += launcher.restarts()
                    launcher, kills = Launcher(4, run, steps, resume=True, cache=cache), 0
                    back = _wait_back(run, at, deadline)
                    lost = None if back is None else time.monotonic() - t_stop
                    regrows.append({"step": at, "lost_s": lost})
                    events.append(("regrow", at, t_stop - t0))
                continue
        time.sleep(0.05)
    if launcher.proc.poll() is None:
        launcher.proc.send_signal(signal.SIGTERM)
        launcher.proc.wait(timeout=120)
    wall = time.monotonic() - t0
    rows = _rows(run)
    done = rows[-1]["step"] if rows else 0
    return {
        "faults": faults,
        "cache": cache,
        "wall_s": wall,
        "steps": done,
        "finished": done == steps,
        "goodput_steps_per_s": done / wall,
        "failures": failures,
        "regrows": regrows,
        "final_loss": rows[-1]["loss"] if rows else None,
        "last10_loss": sum(r["loss"] for r in rows[-10:]) / max(1, len(rows[-10:])),
        "losses": [r["loss"] for r in rows],
        "events": events,
        "trace": trace[:],
        "restarts_logged": restarts_logged + launcher.restarts(),
        "first_step_s": next((t for t, k in trace if k >= 1), None),
    }


def _sample(run: Path, t0: float, trace: list, deadline: float) -> None:
    """Append ``(seconds since t0, last logged step)`` every 0.25 s until the run ends."""
    while time.monotonic() < deadline:
        trace.append((round(time.monotonic() - t0, 2), _last_step(run)))
        if (run / "summary.json").exists():
            return
        time.sleep(0.25)


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def report(results: dict, meta: dict) -> str:
    ref = results["reference"]
    lines = [
        "# Elastic training under a chaos test",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}; JAX {meta['jax']}; {meta['date']}.",
        "",
        "4 processes of 2 simulated CPU devices (8 workers), small GPT of "
        "`configs/dp_default.yaml`, ring all-reduce + Adam, checkpoint every 10 steps. "
        f"A random process is killed (`kill -9`) every {meta['kill_every']} steps; the "
        "elastic launcher restarts the survivors on 2 processes (4 workers); "
        f"{meta['kill_every'] // 2} steps later replacements arrive (SIGTERM, restart on 4 "
        "processes with --resume).",
        "",
        "| run | finished | wall (s) | goodput (steps/s) | vs reference | failures survived "
        "| time lost per failure (s) | per regrow (s) | final loss | largest loss gap |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def seconds(xs):
        xs = [x for x in xs if x is not None]
        return f"{_mean(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"

    for name, r in results.items():
        gap = max(abs(a - b) / b for a, b in zip(r["losses"], ref["losses"], strict=False))
        lines.append(
            f"| {name} | {'yes' if r['finished'] else 'no'} ({r['steps']} steps) | "
            f"{r['wall_s']:.0f} | {r['goodput_steps_per_s']:.2f} | "
            f"{r['goodput_steps_per_s'] / ref['goodput_steps_per_s']:.2f}x | "
            f"{len(r['failures'])} | {seconds(f['lost_s'] for f in r['failures'])} | "
            f"{seconds(g['lost_s'] for g in r['regrows'])} | "
            f"{r['final_loss']:.6f} | {gap:.1e} |"
        )
    lines += [
        "",
        "- **Time lost per failure**: from the kill until the run's metrics are back past "
        "the step it had reached: stopping the survivors, starting every process and JAX, "
        "the restore and resize, compilation, and the steps redone since the newest "
        "checkpoint (mean, and range over the failures). A regrow is the same from the "
        "SIGTERM, with a checkpoint written first and so no step redone.",
        "- **Goodput**: steps of the finished run per second of wall time, start-up "
        f"included (the reference logged its first step {ref.get('first_step_s') or 0:.0f} s "
        "after its launcher started).",
        "- **Restarts**: "
        + ", ".join(f"{name}: {r.get('restarts_logged', '-')}" for name, r in results.items())
        + " lost processes reported by the launcher, each followed by a restart.",
        "- **Loss**: the largest relative gap between a step's loss and the reference's "
        "step. Every run serves the same global batches in the same order; with a ring "
        "all-reduce and Adam the parameters are identical on every worker, so a resize "
        "copies them bit for bit and the mean gradient over 4 or 8 workers is the mean over "
        "the same global batch: the runs differ only by the order of floating-point sums.",
        "",
        "![loss](chaos.png)",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict, kill_every: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traced = any(r.get("trace") for r in results.values())
    fig, axes = plt.subplots(1, 2 if traced else 1, figsize=(13 if traced else 8, 4))
    ax = axes[0] if traced else axes
    for name, r in results.items():
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name, lw=1)
    for r in results.values():
        for f in r["failures"]:
            ax.axvline(f["step"], color="red", lw=0.6, alpha=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"kill -9 of a random process every {kill_every} steps (red lines)")
    ax.legend()
    if traced:
        ax = axes[1]
        for name, r in results.items():
            if r.get("trace"):
                t, step = zip(*r["trace"], strict=True)
                ax.plot(t, step, label=name, lw=1)
            for f in r["failures"]:
                ax.axvline(f["at_s"], color="red", lw=0.6, alpha=0.4)
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("last step logged")
        ax.set_title("progress: flat and falling stretches are restarts (kills in red)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "chaos.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-every", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run at most")
    p.add_argument("--quick", action="store_true", help="60 steps, a kill every 20")
    p.add_argument("--report-only", action="store_true", help="rewrite the report from chaos.json")
    args = p.parse_args(argv)
    if args.report_only:
        saved = json.loads((OUT / "chaos.json").read_text())
        (OUT / "chaos.md").write_text(report(saved["results"], saved["meta"]))
        plot(saved["results"], saved["meta"]["kill_every"])
        print(report(saved["results"], saved["meta"]))
        return 0
    if args.quick:
        args.steps, args.kill_every = 60, 20
    from benchmarks._meta import run_meta

    t0 = time.time()
    OUT.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/jaxcomm_chaos")
    results = {}
    for name, faults, cache in (
        ("reference", False, "off"),
        ("chaos, no compile cache", True, "off"),
        ("chaos, compile cache", True, str(work / "cache")),
    ):
        shutil.rmtree(work / "cache", ignore_errors=True) if faults and cache != "off" else None
        r = chaos(work / "run", args.steps, args.kill_every, faults, cache, args.seed,
                  args.timeout)  # fmt: skip
        results[name] = r
        print(f"{name}: {r['steps']} steps in {r['wall_s']:.0f} s, "
              f"{len(r['failures'])} failures, lost {[f['lost_s'] for f in r['failures']]}",
              flush=True)  # fmt: skip
    meta = run_meta(argv, t0, kill_every=args.kill_every, steps=args.steps)
    (OUT / "chaos.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (OUT / "chaos.md").write_text(report(results, meta))
    plot(results, args.kill_every)
    print(report(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
