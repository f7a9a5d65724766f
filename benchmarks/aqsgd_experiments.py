"""AQ-SGD experiments: FP32 vs DirectQ vs AQ-SGD boundaries in pipeline-parallel fine-tuning.

A byte-level GPT is trained on a fixed set of samples of the embedded Shakespeare text for
several epochs (fine-tuning: every sample is revisited, which is what AQ-SGD's message buffer
exploits), with 4 and 8 pipeline stages. For each boundary codec and bit setting it records
the training-loss curve, the bytes that crossed the boundaries (measured from the payloads),
and a modelled throughput table: sequences per second when the measured step time of this
machine is added to the time the step's point-to-point messages take at 1 ms latency and
10 Gbps .. 100 Mbps (no compute/communication overlap, so a lower bound for every method).

    python benchmarks/aqsgd_experiments.py              # ~12 min on 2 CPU cores
    python benchmarks/aqsgd_experiments.py --steps 40   # quicker, noisier

Writes ``table.md``, ``results.json``, ``loss.png`` and ``throughput.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from jaxcomm import Network  # noqa: E402
from train.config import Config  # noqa: E402
from train.pipeline_trainer import PipelineTrainer  # noqa: E402
from train.plot import read_metrics  # noqa: E402
from train.trainer import wire_time  # noqa: E402

BANDWIDTHS = {"10Gbps": 10e9, "1Gbps": 1e9, "500Mbps": 500e6, "300Mbps": 300e6, "100Mbps": 100e6}
SETTINGS = [
    ("FP32", "fp32", 4, 0),
    ("DirectQ fw2/bw4", "directq", 2, 4),
    ("DirectQ fw3/bw6", "directq", 3, 6),
    ("DirectQ fw4/bw8", "directq", 4, 8),
    ("AQ-SGD fw2/bw4", "aqsgd", 2, 4),
    ("AQ-SGD fw3/bw6", "aqsgd", 3, 6),
    ("AQ-SGD fw4/bw8", "aqsgd", 4, 8),
]
STAGES_8 = {"FP32", "DirectQ fw2/bw4", "AQ-SGD fw2/bw4"}


def run_one(label, boundary, fw, bw, stages, args, out: Path) -> dict:
    """Train one setting; returns its metric rows."""
    run_dir = out / "runs" / f"{label.replace(' ', '_').replace('/', '-')}_s{stages}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cfg = Config(
        name=f"{label} S={stages}",
        task="gpt",
        model={"num_layers": 8, "width": 128, "num_heads": 4, "seq_len": 64},
        workers=1,
        stages=stages,
        microbatches=4,
        global_batch=32,
        train_samples=args.samples,
        steps=args.steps,
        seed=args.seed,
        optimizer="adam",
        lr=1e-3,
        aggregator="ring",
        boundary=boundary,
        fw_bits=fw,
        bw_bits=bw,
        eval_every=0,
        checkpoint_every=0,
        out_dir=str(run_dir),
        progress=False,
    )
    trainer = PipelineTrainer(cfg)
    summary = trainer.run()
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {"label": label, "stages": stages, "rows": rows, "summary": summary}


def analyse(res: dict, batch: int) -> dict:
    """Loss figures, bytes per step and modelled throughput per bandwidth."""
    rows = res["rows"]
    tail = rows[-max(1, len(rows) // 10) :]
    compute = statistics.median(r["compute_s"] for r in rows)
    later = rows[len(rows) // 2 :]  # after the first epochs, when samples are revisited
    out = {
        "method": res["label"],
        "stages": res["stages"],
        "final_loss": sum(r["loss"] for r in tail) / len(tail),
        "valid_loss": res["summary"].get("valid_loss"),
        "bytes_per_step_late": statistics.median(r["sent_bytes"] for r in later),
        "compute_s": compute,
    }
    for name, bw in BANDWIDTHS.items():
        net = Network(1e-3, bw)
        comm = statistics.median(wire_time(r["wire"], 1, net) for r in later)
        out[f"seq_per_s_{name}"] = batch / (compute + comm)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--samples", type=int, default=256, help="fine-tuning set size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/aqsgd")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [(s, 4) for s in SETTINGS] + [(s, 8) for s in SETTINGS if s[0] in STAGES_8]
    t0 = time.time()
    results = []
    for (label, boundary, fw, bw), stages in tqdm(todo, desc="aqsgd runs", unit="run"):
        results.append(run_one(label, boundary, fw, bw, stages, args, out))
    table = [analyse(r, 32) for r in results]
    meta = {
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "wall_s": round(time.time() - t0, 1),
        "steps": args.steps,
        "samples": args.samples,
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, "table": table}, indent=2))
    _write_table(out / "table.md", table, meta)
    _plots(out, results, table)
    print((out / "table.md").read_text())
    return 0


def _write_table(path: Path, table: list[dict], meta: dict) -> None:
    fp32 = {r["stages"]: r for r in table if r["method"] == "FP32"}
    lines = [
        "# AQ-SGD vs DirectQ vs FP32 pipeline boundaries",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}, JAX {meta['jax']} ({meta['backend']}), {meta['date']}; "
        f"wall {meta['wall_s']} s. GPT 8 layers x 128 wide, seq 64, batch 32 in 4 "
        f"microbatches, Adam 1e-3, {meta['steps']} steps over {meta['samples']} samples "
        f"({meta['steps'] * 32 / meta['samples']:.0f} epochs).  ",
        "Final loss: mean of the last 10% of steps. Bytes/step: median over the second half "
        "(samples revisited), the largest stage's forward + backward payloads. Throughput: "
        "32 / (median measured step time + modelled p2p time at 1 ms latency), no overlap.",
        "",
        "| method | stages | final loss | gap to FP32 | bytes/step | "
        + " | ".join(f"seq/s @{b}" for b in BANDWIDTHS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(BANDWIDTHS),
    ]
    for r in table:
        gap = r["final_loss"] - fp32[r["stages"]]["final_loss"]
        tput = " | ".join(f"{r[f'seq_per_s_{b}']:.1f}" for b in BANDWIDTHS)
        lines.append(
            f"| {r['method']} | {r['stages']} | {r['final_loss']:.4f} | {gap:+.4f} "
            f"| {r['bytes_per_step_late']:,.0f} | {tput} |"
        )
    path.write_text("\n".join(lines) + "\n")


def _plots(out: Path, results: list[dict], table: list[dict]) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, stages in zip(axes, (4, 8), strict=True):
        for r in results:
            if r["stages"] != stages:
                continue
            style = (
                "-" if r["label"].startswith("AQ") else ("--" if "Direct" in r["label"] else ":")
            )
            ax.plot(
                [x["step"] for x in r["rows"]],
                [x["loss"] for x in r["rows"]],
                style,
                label=r["label"],
                lw=1.2,
            )
        ax.set_title(f"{stages} stages")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("training loss")
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = list(BANDWIDTHS)
    for r in table:
        if r["stages"] == 4 and r["method"] in (
            "FP32",
            "DirectQ fw2/bw4",
            "AQ-SGD fw2/bw4",
            "AQ-SGD fw4/bw8",
        ):
            ax.plot(xs, [r[f"seq_per_s_{b}"] for b in xs], "o-", label=r["method"])
    ax.set_ylabel("sequences / s (modelled)")
    ax.set_xlabel("bandwidth (1 ms latency)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
