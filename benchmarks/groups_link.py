"""Replica groups over real shaped links: compute utilisation with and without overlap.

    python benchmarks/groups_link.py [--mbit 100] [--steps 180] [--batch 8] [--quick]

Two replica groups, each its own process and JAX runtime in its own network namespace, its
link shaped to ``--mbit`` Mbit/s each way by tbf (``python -m train.groups --network``;
root, Linux), train the GPT of ``configs/diloco_default.yaml`` (1 worker a group, batch
``--batch`` sequences a step: 8, the README job's per-worker batch, or 64, its global batch;
Streaming DiLoCo with H = 30 and 2 fragments). Settings: float32 pseudo-gradients with no
overlap (DiLoCo's blocking exchange), float32 with ``overlap=5`` (the exchange on a host
thread while 5 inner steps run), and error-fed int8 and SparseLoCo with ``overlap=5``.

Each group is pinned to one CPU core of its own (``--cpus-per-group 1``), as if each had a
machine: its exchange thread shares that core with its steps (on a GPU machine it would
run beside the device). For each setting it reports, per group: the compute utilisation
(the steps at the devices' own pace, the median step with no exchange in flight, over the
training loop's steady wall time, from the end of its first step to the end of its last),
the same with the tail (the wait for the last exchange, which no step can overlap), where
the steady window's other seconds went (``slowed``: the steps' measured time beyond the
median pace, the exchange thread's work on the same core among it; ``waited``: merges
waiting for their exchange; ``host``: the loop's own work, launches and merges), the bytes
the transport counted and the bytes the kernel counted on the group's link (the wire
audit: headers, payloads, TCP/IP framing and torchft's control traffic), and the
utilisation ``train.estimate``'s clock of replica groups predicts
(:func:`train.replica_groups.link_utilisation` with the measured step time, each exchange
:func:`train.replica_groups.exchange_seconds` on the link plus its fixed software cost,
measured by the groups at the start with an exchange of headers alone) beside the measured
one, the measured wall time against that prediction's, and the utilisation the bytes alone
would allow. Then ``python -m train.estimate`` alone, for the same setting with
``compute=measured`` (it times the compiled step on one core of this machine, on zero
inputs, before any group runs) on the same link: its step (a period's mean on the link
clock) times the steps against each group's measured loop wall time.

Writes ``benchmarks/results/groups/link.{md,json}``.
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
SETS = ["workers=1", "aggregator=ring", "sync.period=30", "sync.fragments=2",
        "compute=measured", "eval_every=0", "checkpoint_every=0", "eval_batches=2",
        # The paper's outer step, as the recorded runs had it (the config's is averaging).
        "sync.outer_lr=0.7", "sync.outer_momentum=0.9"]  # fmt: skip
SETTINGS = {
    "float32, overlap 0": ["sync.overlap=0"],
    "float32, overlap 5": ["sync.overlap=5"],
    "int8, overlap 5": ["sync.overlap=5", "sync.compress=int8"],
    "sparseloco, overlap 5": ["sync.overlap=5", "sync.compress=sparseloco"],
}


def predicted_utilisation(step_s: float, payload: list[int], groups: int, mbit: float,
                          period: int, fragments: int, overlap: int,
                          alpha: float = 0.0) -> float:  # fmt: skip
    """Compute over wall time of the steady state on ``train.estimate``'s clock of replica
    groups (:func:`train.replica_groups.link_utilisation`): each step computes ``step_s``;
    fragment ``p``'s exchange takes ``alpha`` (its fixed software cost, measured by the
    groups at the start) plus :func:`train.replica_groups.exchange_seconds` of its
    payload at ``mbit``, and its merge ``overlap`` steps later waits for it."""
    import jaxcomm
    from jaxcomm.network import Network
    from train.replica_groups import exchange_seconds, link_utilisation

    net = Network(latency_s=0.0, bandwidth_bps=mbit * 1e6)
    schedule = jaxcomm.schedules.streaming_schedule(fragments, period, fragments)
    comm = [alpha + exchange_seconds(b, groups, net) for b in payload]
    return link_utilisation(step_s, comm, period, schedule, overlap)[0]


def estimated(sets: list[str], mbit: float, batch: int, folder: Path) -> dict:
    """``python -m train.estimate`` of a group of this setting (``compute=measured`` on one
    core of this machine, the link of ``mbit`` Mbit/s with no added delay)."""
    from train.groups import pinned

    out = folder / "estimate.json"
    cmd = [sys.executable, "-m", "train.estimate", "--config", "configs/diloco_default.yaml",
           "--json", str(out)]  # fmt: skip
    own = ["compute=measured", f"network=0ms,{mbit:g}Mbps", f"global_batch={batch}",
           "groups.lighthouse=http://127.0.0.1:1", "groups.slot=0", "groups.count=2"]  # fmt: skip
    for s in [*SETS, *sets, *own]:
        cmd += ["--set", s]
    core = sorted(os.sched_getaffinity(0))[0]
    proc = subprocess.run(pinned(cmd, {core}), cwd=ROOT, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    if proc.returncode:
        raise RuntimeError(f"train.estimate: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    est = json.loads(out.read_text())
    return {"step_s": est["step_s"], "compute_s": est["compute_s"],
            "utilisation": est["groups"]["compute_utilisation"]}  # fmt: skip


def estimate_note(results: list[dict]) -> str:
    """The paragraph under the table: train.estimate's timed step against the groups'."""
    parts = []
    for r in results:
        steps = [row["step_s"] for row in r["rows"]]
        est = r["estimate"]["compute_s"]
        parts.append(f"{r['setting']}: {1e3 * est:.0f} ms against "
                     + " and ".join(f"{1e3 * s:.0f}" for s in steps) + " ms")  # fmt: skip
    return (
        "`train.estimate` times the step on one core with the other idle (before the "
        "groups run); the groups step with both cores busy, their two processes sharing the "
        "machine's memory and caches, and most of the wall time above its prediction is "
        "that: its step against the groups' median steps, " + "; ".join(parts) + "."
    )


def run(name: str, sets: list[str], steps: int, mbit: float, folder: Path,
        batch: int = 8) -> dict:  # fmt: skip
    out = folder / name.replace(", ", "_").replace(" ", "")
    cmd = [sys.executable, "-m", "train.groups", "--groups", "2", "--network", str(mbit),
           "--cpus-per-group", "1", "--config", "configs/diloco_default.yaml",
           "--out", str(out)]  # fmt: skip
    for s in [*SETS, *sets, f"steps={steps}", f"global_batch={batch}"]:
        cmd += ["--set", s]
    out.mkdir(parents=True, exist_ok=True)
    est = estimated(sets, mbit, batch, out)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        raise RuntimeError(f"{name}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    report = json.loads((out / "summary.json").read_text())
    overlap = int(next(s for s in sets if s.startswith("sync.overlap=")).split("=")[1])
    rows = []
    for g in range(2):
        summary = json.loads((out / f"group_{g}" / "summary.json").read_text())
        st = summary["groups"]
        step_s = st["clean_step_s"]  # the devices' own pace, as the utilisation's
        rows.append({
            "group": g,
            "utilisation": st["utilisation"],
            "utilisation_with_tail": st["utilisation_with_tail"],
            "tail_s": st["tail_s"],
            "predicted_utilisation": predicted_utilisation(
                step_s, st["payload_bytes"], 2, mbit, 30, 2, overlap, st["exchange_alpha_s"]
            ),
            "bandwidth_only_utilisation": predicted_utilisation(
                step_s, st["payload_bytes"], 2, mbit, 30, 2, overlap
            ),
            "exchange_alpha_s": st["exchange_alpha_s"],
            "step_s": step_s,
            "wait_s": st["wait_s"],
            "lost_s": st["lost_s"],
            "busy_utilisation": st["busy_utilisation"],
            "wall_s": st["wall_s"],
            "sent_bytes": st["sent_bytes"],
            "link_tx_bytes": report["link_tx_bytes"][str(g)],
            "payload_bytes": st["payload_bytes"],
            "exchanges": st["exchanges"],
            "valid_loss": summary["valid_loss"],
            "estimate_wall_s": est["step_s"] * steps,
        })  # fmt: skip
    return {"setting": name, "rows": rows, "estimate": est, "launcher_wall_s": time.time() - t0}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mbit", type=float, default=100.0)
    p.add_argument("--steps", type=int, default=180)
    p.add_argument("--batch", type=int, default=8, help="sequences a group's step (8 or 64)")
    p.add_argument("--quick", action="store_true", help="60 steps, one setting")
    args = p.parse_args(argv)
    t0 = time.time()
    settings = dict(list(SETTINGS.items())[1:2]) if args.quick else SETTINGS
    steps = 60 if args.quick else args.steps
    folder = Path(tempfile.mkdtemp(prefix="groups_link_"))
    results = []
    try:
        for name, sets in settings.items():
            results.append(run(name, sets, steps, args.mbit, folder, args.batch))
            print(json.dumps(results[-1]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    meta = run_meta(argv, t0, mbit=args.mbit, steps=steps, batch=args.batch)
    OUT.mkdir(parents=True, exist_ok=True)
    stem = "link" if args.batch == 8 else f"link_b{args.batch}"
    (OUT / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    lines = [
        f"# Replica groups over {args.mbit:g} Mbit/s links",
        "",
        f"`{meta['command']}` on {meta['date']}, {meta['machine']}, JAX {meta['jax']}: 2 groups "
        f"(1 worker each, its own process, namespace and CPU core, {args.batch} sequences a "
        f"step), {steps} steps, H = 30, 2 "
        "fragments; no delay is added to the links (this kernel has no netem): their "
        "latency is the veth's, tens of microseconds.",
        "",
        "| setting | group | utilisation | with the tail | predicted | wall vs predicted "
        "| bytes alone "
        "| exchange alpha (ms) | step (ms) | slowed (s) | waited (s) | host (s) | tail (s) "
        "| loop (s) | counted (MB) | on the link (MB) | link / counted "
        "| train.estimate (s) | loop vs train.estimate |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for row in r["rows"]:
            lines.append(
                f"| {r['setting']} | {row['group']} | {row['utilisation']:.1%} "
                f"| {row['utilisation_with_tail']:.1%} "
                f"| {row['predicted_utilisation']:.1%} "
                f"| {row['predicted_utilisation'] / row['utilisation'] - 1:+.1%} "
                f"| {row['bandwidth_only_utilisation']:.1%} "
                f"| {1e3 * (row['exchange_alpha_s'] or 0):.0f} | {1e3 * row['step_s']:.0f} "
                f"| {row['lost_s']['slowed']:.2f} | {row['lost_s']['waited']:.2f} "
                f"| {row['lost_s']['host']:.2f} | {row['tail_s']:.2f} | {row['wall_s']:.1f} "
                f"| {row['sent_bytes'] / 1e6:.2f} "
                f"| {row['link_tx_bytes'] / 1e6:.2f} "
                f"| {row['link_tx_bytes'] / row['sent_bytes']:.3f} "
                f"| {row['estimate_wall_s']:.1f} "
                f"| {row['wall_s'] / row['estimate_wall_s'] - 1:+.1%} |"
            )
    lines += ["", estimate_note(results)]
    (OUT / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
