"""DiLoCo family experiments: bytes, loss and simulated time against data parallelism.

Every method here runs at one untuned setting, so its losses compare settings as much as
methods; the tuned comparison across sizes is ``benchmarks/quality.py``, and the loss gaps
this script reports are not to be quoted as the methods' (its bytes and times are).

The GPT of the main job (4 layers, width 128, 867K parameters) on the embedded Shakespeare
text, 8 workers, global batch 64, Adam at lr 3e-3 (the inner optimizer of every local
method), V100 compute (the roofline of the compiled step), a fixed token budget
(``--steps`` x 64 sequences x 64 tokens; 600 steps: 2.46M tokens), two seeds:

- DP: the gradients averaged by a float32 ring all-reduce every step;
- DiLoCo H = 10, 30, 100: Nesterov outer step (lr 0.7, momentum 0.9), float32 ring;
- Streaming DiLoCo: H = 30, three strided fragments, overlap tau = 1 (alpha 0.5), 4-bit
  error-fed pseudo-gradients (``int4``: jaxcomm's uniform 4-bit codes, not the paper's
  4-bit float);
- SparseLoCo: H = 30, top-64 of every 4,096 entries, 2-bit values, error buffer decay
  0.95, outer SGD 1.0, all-gather;
- DiLoCo + AR-Topk: H = 30, AR-Topk's shared root indices (ratio 0.01) and a ring
  all-reduce of values, error-fed, outer SGD 1.0;
- DreamDDP H = 5 (partial local SGD, for reference).

Each method trains once per seed at 100 Mbps / 50 ms (only DreamDDP's schedule depends on
the network); its simulated time on the other networks is replayed from the rows (each
step's compute and its logged collectives' alpha-beta time; DiLoCo's link clock, in which
an overlapped transfer hides behind the next steps' compute). Reported per method: final
validation loss (on theta_sync for DiLoCo), total and peak bytes a worker sent, the ratio
to DP's bytes, and simulated time at 10 Gbps / 1 ms, 1 Gbps / 10 ms and 100 Mbps / 50 ms.

Writes ``experiments.md``, ``experiments.json`` and ``loss_vs_time.png`` (validation loss
against simulated time at 100 Mbps, one line per method) to ``--out`` (default
``benchmarks/results/diloco``).

    python benchmarks/diloco_experiments.py                 # ~2 h on 2 CPU cores (1 h a seed)
    python benchmarks/diloco_experiments.py --seeds 1 --add # one more seed into the record
    python benchmarks/diloco_experiments.py --quick         # 40 steps, one seed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _meta import run_meta  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from jaxcomm.network import Network  # noqa: E402
from train.clock import wire_time  # noqa: E402
from train.config import Config  # noqa: E402
from train.diloco import DiLoCo  # noqa: E402
from train.plot import read_metrics  # noqa: E402
from train.trainer import Trainer  # noqa: E402

NETWORKS = {"10 Gbps": "1ms,10Gbps", "1 Gbps": "10ms,1Gbps", "100 Mbps": "50ms,100Mbps"}
TRAIN_NET = "100 Mbps"


def _diloco(period: int, **kw) -> dict:
    return {"aggregator": "none", "sync": {"method": "diloco", "period": period, **kw}}


METHODS: dict[str, dict] = {
    "DP": {"aggregator": "ring"},
    "DiLoCo H=10": _diloco(10),
    "DiLoCo H=30": _diloco(30),
    "DiLoCo H=100": _diloco(100),
    "Streaming DiLoCo int4": _diloco(30, fragments=3, overlap=1, compress="int4"),
    "SparseLoCo": _diloco(30, compress="sparseloco", outer_lr=1.0, outer_momentum=0.0),
    "DiLoCo + AR-Topk": _diloco(30, compress="ar_topk", outer_lr=1.0, outer_momentum=0.0),
    "DreamDDP H=5": {"aggregator": "none", "sync": {"method": "dreamddp", "period": 5}},
}


def config(slug: str, out: Path, steps: int, seed: int, **kw) -> Config:
    """One run's config; ``kw`` overrides."""
    run_dir = out / "runs" / f"{slug}_s{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    base = dict(
        name=slug,
        model={"name": "gpt", "num_layers": 4, "width": 128, "num_heads": 4, "seq_len": 64},
        dataset="shakespeare",
        workers=8,
        global_batch=64,
        steps=steps,
        seed=seed,
        optimizer={"name": "adam", "lr": 3e-3},
        network=NETWORKS[TRAIN_NET],
        compute="v100",
        eval_every=max(steps // 12, 1),
        eval_batches=8,
        checkpoint_every=0,
        out_dir=str(run_dir),
        progress=False,
    )
    base.update(kw)
    return Config(**base)


def seconds(trainer: Trainer, rows: list[dict], network: Network) -> np.ndarray:
    """Simulated seconds of every step of a finished run on ``network``."""
    if isinstance(trainer.sync, DiLoCo):
        return trainer.sync.replay(rows, network)
    if trainer.cfg.sync:  # DreamDDP's layer-wise timeline of each step's group
        return np.array(
            [trainer.simulate_logged(None, network, r["step"] - 1, measured_s=0.0)[0] for r in rows]
        )
    return np.array([r["sim_compute_s"] + wire_time(r["wire"], network) for r in rows])


def main(argv: list[str] | None = None) -> int:
    """Run every method and seed, write the table and the plot."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/diloco")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--quick", action="store_true", help="40 steps, seed 0")
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    ap.add_argument(
        "--add",
        action="store_true",
        help="keep the record's runs of other seeds (same --steps) and add these seeds to it",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        record = json.loads((out / "experiments.json").read_text())
        (out / "experiments.md").write_text(render(record))
        return 0
    steps, seeds = (40, [0]) if args.quick else (args.steps, args.seeds)
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    nets = {k: Network.parse(v) for k, v in NETWORKS.items()}
    runs: dict[str, list[dict]] = {}
    earlier: list[dict] = []
    if args.add and (out / "experiments.json").exists():
        old = json.loads((out / "experiments.json").read_text())
        if old["steps"] != steps:
            ap.error(f"--add: the record has {old['steps']} steps, this sweep {steps}")
        earlier = [*old.get("earlier", []), old["meta"]]
        for method, rs in old["runs"].items():
            kept = [r for r in rs if r["seed"] not in seeds]
            if kept:
                runs[method] = kept
    jobs = [(m, s) for s in seeds for m in args.methods]  # seed-major: whole seeds first
    for method, seed in tqdm(jobs, desc="runs"):
        slug = method.lower().replace(" ", "_").replace("=", "").replace("+", "").replace("__", "_")
        cfg = config(slug, out, steps, seed, **METHODS[method])
        trainer = Trainer(cfg)
        summary = trainer.run()
        rows = read_metrics(cfg.run_dir / "metrics.jsonl")
        sent = np.array([r["sent_bytes"] for r in rows], np.float64)
        times = {n: seconds(trainer, rows, net) for n, net in nets.items()}
        valid = [(r["step"], r["valid_loss"]) for r in rows if "valid_loss" in r]
        runs.setdefault(method, [])
        runs[method] = sorted(
            [
                *runs[method],
                {
                    "seed": seed,
                    "valid_loss": summary["valid_loss"],
                    "train_loss": float(np.mean([r["loss"] for r in rows[-10:]])),
                    "total_bytes": float(sent.sum()),
                    "peak_bytes": float(sent.max()),
                    "sim_s": {n: float(t.sum()) for n, t in times.items()},
                    "valid_curve": [
                        (float(np.sum(times[TRAIN_NET][:step])), loss) for step, loss in valid
                    ],
                },
            ],
            key=lambda r: r["seed"],
        )
        shutil.rmtree(cfg.run_dir / "checkpoints", ignore_errors=True)
        # Written after every run: an interrupted sweep keeps the seeds it finished.
        record = {
            "meta": run_meta(argv, t0),
            "earlier": earlier,
            "steps": steps,
            "tokens": steps * 64 * 64,
            "seeds": sorted({r["seed"] for rs in runs.values() for r in rs}),
            "networks": NETWORKS,
            "methods": {m: METHODS[m] for m in runs},
            "runs": runs,
        }
        (out / "experiments.json").write_text(json.dumps(record, indent=2))
        plot(record, out / "loss_vs_time.png")
        (out / "experiments.md").write_text(render(record))
    print(render(record))
    return 0


def _mean(runs: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in runs]))


def render(record: dict) -> str:
    """The markdown table of a record."""
    meta, runs = record["meta"], record["runs"]
    dp = runs.get("DP")
    nets = list(record["networks"])
    lines = ["# DiLoCo family experiments", "",
             "**Withdrawn as a comparison of loss**: every method at one untuned setting "
             "(Adam at a constant lr, the paper's Nesterov outer step); the tuned comparison "
             "across sizes is `benchmarks/results/quality/quality.md` "
             "(`benchmarks/quality.py`). The bytes and simulated times stand.", ""]  # fmt: skip
    for m in [*record.get("earlier", []), meta]:
        lines.append(
            f"`{m['command']}` ({m['date']}, {m['machine']}, jax {m['jax']}, "
            f"{m.get('wall_s', 0) / 60:.0f} min)."
        )
    lines += [
        "",
        f"GPT (4 layers, width 128, 867K parameters) on the embedded Shakespeare text, 8 "
        f"workers, global batch 64, {record['steps']} steps ({record['tokens']:,} tokens), "
        f"inner Adam lr 3e-3, seeds {record['seeds']}; V100 roofline compute. Bytes are what "
        "one worker sent over the run (the busiest worker each step), from the logs that the "
        "contract suite checks against the compiled programs. Loss: validation loss of the "
        "final model (theta_sync for DiLoCo), mean over seeds (each seed in brackets).",
        "",
        "| method | valid loss | vs DP | total bytes / worker | x fewer than DP | peak bytes "
        "/ step | " + " | ".join(f"time @ {n} (s)" for n in nets) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(nets),
    ]
    for method, rs in runs.items():
        loss = _mean(rs, "valid_loss")
        each = ", ".join(f"{r['valid_loss']:.3f}" for r in rs)
        gap = f"{100 * (loss / _mean(dp, 'valid_loss') - 1):+.1f}%" if dp else "-"
        total = _mean(rs, "total_bytes")
        fewer = f"{_mean(dp, 'total_bytes') / total:,.0f}x" if dp and total else "-"
        times = " | ".join(f"{np.mean([r['sim_s'][n] for r in rs]):.1f}" for n in nets)
        lines.append(
            f"| {method} | {loss:.3f} ({each}) | {gap} | {total / 1e6:,.1f} MB | {fewer} | "
            f"{_mean(rs, 'peak_bytes') / 1e6:.2f} MB | {times} |"
        )
    if dp:
        fast = np.mean([r["sim_s"][nets[0]] for r in dp])
        lines += [
            "",
            f"DP at {nets[0]}: {fast:.1f} s simulated. Each method's time at "
            f"{TRAIN_NET} against it:",
            "",
        ]
        for method, rs in runs.items():
            slow = np.mean([r["sim_s"][TRAIN_NET] for r in rs])
            lines.append(f"- {method}: {slow / fast:.2f}x")
    return "\n".join(lines) + "\n"


def plot(record: dict, path: Path) -> None:
    """Validation loss against simulated time at 100 Mbps, one line per method (seed mean
    at each evaluation)."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, rs in record["runs"].items():
        curves = [np.asarray(r["valid_curve"]) for r in rs]
        n = min(len(c) for c in curves)
        t = np.mean([c[:n, 0] for c in curves], axis=0)
        loss = np.mean([c[:n, 1] for c in curves], axis=0)
        ax.plot(t, loss, marker=".", label=method)
    ax.set_xscale("log")
    ax.set_xlabel(f"simulated time at {TRAIN_NET} / 50 ms (s, log)")
    ax.set_ylabel("validation loss")
    ax.set_title("DiLoCo family vs data parallel, 8 workers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
