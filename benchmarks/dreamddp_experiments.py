"""DreamDDP experiments: S-SGD, FLSGD, PLSGD-ENP and DreamDDP on the embedded text.

The GPT of the main job (4 layers, width 128, 867K parameters; its layers for the schedules
are ``embed``, ``block_0..3``, ``head``) on 8 workers, global batch 64, Adam at one step
size for every method, V100 compute (the roofline of the compiled step), at periods H = 5
and 3:

- S-SGD: the gradients averaged by a ring all-reduce every step (``aggregator: ring``);
- FLSGD: local Adam, every layer averaged at the last step of each period, one all-reduce
  per layer (each can leave after its own backward, as DreamDDP's layers do); *FLSGD
  (fused)*: the whole model as one all-reduce after the whole backward (one message pays
  the latency terms once);
- PLSGD-ENP: local Adam, the equal-number partition (one group per step);
- DreamDDP: local Adam, the schedule of the profiled per-layer backward and averaging
  times on each network (Algorithm 2 with bubble filling).

The training trajectory of S-SGD, FLSGD and PLSGD-ENP does not depend on the network, so
each runs once and its simulated time is recomputed per network (S-SGD: compute + the
alpha-beta time of each step's wire record; the local methods: DreamDDP's iteration
timeline of each step's group); DreamDDP runs once per distinct schedule. Networks: 10 Gbps,
1 Gbps and 100 Mbps, each at 0.1 ms latency.

Writes to ``--out`` (default ``benchmarks/results/dreamddp``): ``experiments.md`` and
``experiments.json`` (the iteration-time table like the paper's Table 1, time to a target
validation loss like its Table 2, final losses), ``loss.png`` (loss against step, and
against simulated time per network), ``divergence.png`` (model divergence over steps for
full and partial synchronisation, the paper's Fig. 5b), and every run under ``runs/``.

    python benchmarks/dreamddp_experiments.py            # ~20 min on 2 CPU cores
    python benchmarks/dreamddp_experiments.py --quick    # 40 steps, a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _meta import run_meta  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm.network import Network  # noqa: E402
from train.config import Config  # noqa: E402
from train.localsgd import LocalSGD  # noqa: E402
from train.plot import read_metrics  # noqa: E402
from train.trainer import Trainer, wire_time  # noqa: E402

NETWORKS = {"10 Gbps": "0.1ms,10Gbps", "1 Gbps": "0.1ms,1Gbps", "100 Mbps": "0.1ms,100Mbps"}
PERIODS = (5, 3)
LOCAL = {
    "FLSGD": "local_sgd",
    "FLSGD (fused)": "local_sgd",
    "PLSGD-ENP": "enp",
    "DreamDDP": "dreamddp",
}


SEED = [0]  # set from --seed


def config(name: str, out: Path, steps: int, **kw) -> Config:
    """One run's config; ``kw`` overrides."""
    run_dir = out / "runs" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    base = dict(
        name=name,
        model={"name": "gpt", "num_layers": 4, "width": 128, "num_heads": 4, "seq_len": 64},
        dataset="shakespeare",
        workers=8,
        global_batch=64,
        steps=steps,
        seed=SEED[0],
        optimizer={"name": "adam", "lr": 3e-3},
        aggregator="ring",
        network=NETWORKS["1 Gbps"],
        compute="v100",
        eval_every=max(steps // 60, 1),
        eval_batches=4,
        checkpoint_every=0,
        out_dir=str(run_dir),
        progress=False,
    )
    base.update(kw)
    return Config(**base)


def step_seconds(trainer: Trainer, rows: list[dict], network: Network) -> np.ndarray:
    """Simulated seconds of every step of a finished run, re-modelled on ``network``."""
    if isinstance(trainer.sync, LocalSGD):
        return np.array(
            [trainer.simulate_logged(None, network, r["step"] - 1, measured_s=0.0)[0] for r in rows]
        )
    return np.array([r["sim_compute_s"] + wire_time(r["wire"], network) for r in rows])


def main(argv: list[str] | None = None) -> int:
    """Run every method, write the tables and plots."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/dreamddp")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--quick", action="store_true", help="40 steps")
    ap.add_argument("--seed", type=int, default=0, help="seeds the init and the data order")
    ap.add_argument(
        "--render", action="store_true", help="rewrite experiments.md from experiments.json"
    )
    args = ap.parse_args(argv)
    if args.render:
        record = json.loads((Path(args.out) / "experiments.json").read_text())
        (Path(args.out) / "experiments.md").write_text(render(record))
        return 0
    steps = 40 if args.quick else args.steps
    SEED[0] = args.seed
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nets = {k: Network.parse(v) for k, v in NETWORKS.items()}

    jobs = [("S-SGD", None, None)]
    for h in PERIODS:
        jobs += [(name, h, None) for name in ("FLSGD", "FLSGD (fused)", "PLSGD-ENP")]
        jobs += [("DreamDDP", h, net) for net in NETWORKS]
    runs: dict[str, dict] = {}
    schedules: dict[tuple, str] = {}  # DreamDDP schedules already trained
    times: dict[tuple[str, str], np.ndarray] = {}  # (label, network) -> step seconds
    for name, h, net in tqdm(jobs, desc="runs"):
        label = name if h is None else f"{name} H={h}"
        if name == "S-SGD":
            cfg = config("ssgd", out, steps)
        else:
            fused = name == "FLSGD (fused)"
            sync = {"method": LOCAL[name], "period": h, **({"fused": True} if fused else {})}
            network = NETWORKS[net or "1 Gbps"]
            slug = f"{LOCAL[name]}{'_fused' * fused}_h{h}"
            slug += f"_{net.replace(' ', '')}" if net else ""
            cfg = config(slug, out, steps, aggregator="none", sync=sync, network=network)
        trainer = Trainer(cfg)
        if name == "DreamDDP":
            key = (h, trainer.sync.sync_schedule.groups)
            if key in schedules:  # the same schedule trains the same model
                src = schedules[key]
                runs[src]["networks"].append(net)
                times[(src, net)] = step_seconds(runs[src]["trainer"], runs[src]["rows"], nets[net])
                continue
            label = f"{label} ({net})"
            schedules[key] = label
        summary = trainer.run()
        rows = read_metrics(cfg.run_dir / "metrics.jsonl")
        runs[label] = {
            "trainer": trainer,
            "rows": rows,
            "summary": summary,
            "period": h,
            "method": name,
            "networks": [net] if net else list(NETWORKS),
            "schedule": str(getattr(trainer.sync, "sync_schedule", "")),
        }
        for n in runs[label]["networks"]:
            times[(label, n)] = step_seconds(trainer, rows, nets[n])

    record = summarise(runs, times)
    record["meta"] = run_meta(argv, t0)
    record["steps"] = steps
    record["seed"] = args.seed
    record["networks"] = NETWORKS
    record["profile"] = profile_record(runs)
    for run in runs.values():  # the checkpoints are large and not results
        shutil.rmtree(run["trainer"].cfg.run_dir / "checkpoints", ignore_errors=True)
    (out / "experiments.json").write_text(json.dumps(record, indent=2, default=str))
    plot_loss(runs, times, out / "loss.png")
    plot_divergence(runs, out / "divergence.png")
    (out / "experiments.md").write_text(render(record))
    print(render(record))
    return 0


def _valid(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "valid_loss" in r]


def summarise(runs: dict, times: dict) -> dict:
    """Iteration times, time to target, final losses."""
    best = {label: min(r["valid_loss"] for r in _valid(run["rows"])) for label, run in runs.items()}
    target = max(best.values())  # every run reaches it
    iteration, to_target, final = {}, {}, {}
    for (label, net), sec in times.items():
        rows = runs[label]["rows"]
        iteration.setdefault(label, {})[net] = float(np.mean(sec))
        clock = np.cumsum(sec)
        hit = next(r["step"] for r in _valid(rows) if r["valid_loss"] <= target)
        to_target.setdefault(label, {})[net] = {"step": hit, "seconds": float(clock[hit - 1])}
    for label, run in runs.items():
        rows = run["rows"]
        final[label] = {
            "train_loss": float(np.mean([r["loss"] for r in rows[-10:]])),
            "valid_loss": run["summary"]["valid_loss"],
            "best_valid_loss": best[label],
            "mean_divergence": float(np.mean([r.get("divergence", 0.0) for r in rows])),
            "bytes_per_step": float(np.mean([r["sent_bytes"] for r in rows])),
            "schedule": run["schedule"],
            "period": run["period"],
            "method": run["method"],
            "networks": run["networks"],
        }
    return {"target_loss": target, "iteration_s": iteration, "to_target": to_target, "final": final}


def profile_record(runs: dict) -> dict:
    """The per-layer profile and the modelled S-SGD with WFBP (per-layer all-reduce started
    after each layer's backward: the iteration timeline with every layer in the group)."""
    trainer = next(r["trainer"] for r in runs.values() if isinstance(r["trainer"].sync, LocalSGD))
    prof = trainer.sync.profile
    compute = float(np.mean([r["sim_compute_s"] for r in runs["S-SGD"]["rows"]]))
    forward = compute - sum(prof.backward_s)
    wfbp = {}
    for net, text in NETWORKS.items():
        comm = prof.comm_s(Network.parse(text), trainer.n)
        wfbp[net] = jaxcomm.schedules.iteration_time(
            range(prof.num_layers), forward, list(prof.backward_s), comm
        )
    return {
        "layers": list(prof.names),
        "method": prof.method,
        "forward_s": forward,
        "backward_s": list(prof.backward_s),
        "param_bytes": list(prof.param_bytes),
        "comm_s": {n: prof.comm_s(Network.parse(t), trainer.n) for n, t in NETWORKS.items()},
        "wfbp_s": wfbp,
    }


def render(record: dict) -> str:
    """Markdown tables of a record."""
    meta, it, tt, final = (record[k] for k in ("meta", "iteration_s", "to_target", "final"))
    prof = record["profile"]
    nets = list(record["networks"])
    lines = [
        "# DreamDDP experiments",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}, jax {meta['jax']}, "
        f"{meta.get('wall_s', 0) / 60:.0f} min).",
        "",
        f"GPT (4 layers, width 128, 867K parameters) on the embedded Shakespeare text, 8 "
        f"workers, global batch 64, Adam lr 3e-3, {record['steps']} steps, seed "
        f"{record.get('seed', 0)}; simulated time on "
        "V100s (the roofline of the compiled step) and the alpha-beta model of each network "
        "at 0.1 ms latency. Local methods follow DreamDDP's iteration timeline (each "
        "averaged layer's all-reduce starts after its backward and after the previous "
        "all-reduce); S-SGD adds its fused ring all-reduce after the backward.",
        "",
        "Per-layer profile (V100 roofline of the compiled backward prefixes, one worker's "
        f"batch): forward {1e3 * prof['forward_s']:.3f} ms; backward "
        + ", ".join(
            f"{n} {1e3 * b:.3f}" for n, b in zip(prof["layers"], prof["backward_s"], strict=True)
        )
        + " ms; averaging one layer (ring all-reduce) "
        + "; ".join(
            f"{net}: " + ", ".join(f"{1e3 * c:.2f}" for c in prof["comm_s"][net]) + " ms"
            for net in nets
        )
        + ".",
        "",
        "## Iteration time (the paper's Table 1)",
        "",
        "Mean simulated ms per iteration. S1 = S-SGD / DreamDDP, S2 = FLSGD / DreamDDP and "
        "S2' = FLSGD (fused) / DreamDDP (same H). *S-SGD (WFBP)* is modelled, not run: "
        "every layer's gradient all-reduce starts after its own backward (the overlap "
        "ASC-WFBP builds on); with one message per layer it pays a ring's latencies per "
        "layer, which the fused S-SGD pays once.",
        "",
        "| method | " + " | ".join(nets) + " |",
        "|---|" + "---|" * len(nets),
    ]
    lines.append(
        "| S-SGD (WFBP, modelled) | "
        + " | ".join(f"{1e3 * prof['wfbp_s'][n]:.2f}" for n in nets)
        + " |"
    )

    def label_for(method, h, net):
        for label, f in final.items():
            if f["method"] == method and f["period"] == h and net in f["networks"]:
                return label
        return None

    rows = [("S-SGD", None)] + [(m, h) for h in PERIODS for m in LOCAL]
    for method, h in rows:
        cells = []
        for net in nets:
            label = label_for(method, h, net)
            cells.append(f"{1e3 * it[label][net]:.2f}")
        name = method if h is None else f"{method} H={h}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for h in PERIODS:
        s1, s2 = [], []
        for net in nets:
            dream = it[label_for("DreamDDP", h, net)][net]
            s1.append(f"{it[label_for('S-SGD', None, net)][net] / dream:.2f}x")
            s2.append(f"{it[label_for('FLSGD', h, net)][net] / dream:.2f}x")
        s3 = [
            f"{it[label_for('FLSGD (fused)', h, n)][n] / it[label_for('DreamDDP', h, n)][n]:.2f}x"
            for n in nets
        ]
        lines.append(f"| S1 (H={h}) | " + " | ".join(s1) + " |")
        lines.append(f"| S2 (H={h}) | " + " | ".join(s2) + " |")
        lines.append(f"| S2' (H={h}) | " + " | ".join(s3) + " |")
    lines += [
        "",
        f"## Time to validation loss {record['target_loss']:.3f} (the paper's Table 2)",
        "",
        "The target is the largest of the runs' best validation losses, so every run "
        "reaches it; step and simulated seconds at the first evaluation at or below it.",
        "",
        "| method | " + " | ".join(nets) + " |",
        "|---|" + "---|" * len(nets),
    ]
    for method, h in rows:
        cells = []
        for net in nets:
            hit = tt[label_for(method, h, net)][net]
            cells.append(f"{hit['seconds']:.2f} s (step {hit['step']})")
        name = method if h is None else f"{method} H={h}"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Runs",
        "",
        "| run | networks | final train loss | final valid loss | best valid loss | "
        "mean divergence | bytes / step | schedule |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, f in final.items():
        lines.append(
            f"| {label} | {', '.join(f['networks'])} | {f['train_loss']:.3f} | "
            f"{f['valid_loss']:.3f} | {f['best_valid_loss']:.3f} | "
            f"{f['mean_divergence']:.2e} | {f['bytes_per_step']:,.0f} | {f['schedule'] or '-'} |"
        )
    lines += ["", "![loss](loss.png)", "", "![divergence](divergence.png)", ""]
    return "\n".join(lines)


def plot_loss(runs: dict, times: dict, path: Path) -> None:
    """Per period H (a row): loss against step, and against simulated time per network."""
    nets = list(NETWORKS)
    fig, axes = plt.subplots(
        len(PERIODS), 1 + len(nets), figsize=(4.2 * (1 + len(nets)), 3.6 * len(PERIODS))
    )

    def smooth(x, w=10):
        return np.convolve(x, np.ones(w) / w, mode="valid")

    for i, h in enumerate(PERIODS):
        ax = axes[i, 0]
        for label, run in runs.items():
            if run["period"] not in (None, h):
                continue
            loss = smooth([r["loss"] for r in run["rows"]])
            ax.plot(np.arange(len(loss)) + 10, loss, label=label, lw=1)
        ax.set_title(f"H = {h}")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (10-step mean)")
        ax.legend(fontsize=6)
        for j, net in enumerate(nets):
            ax = axes[i, 1 + j]
            for label, run in runs.items():
                if run["period"] not in (None, h) or (label, net) not in times:
                    continue
                loss = smooth([r["loss"] for r in run["rows"]])
                clock = np.cumsum(times[(label, net)])[9:]
                ax.plot(clock, loss, label=label, lw=1)
            ax.set_title(f"H = {h}, {net}")
            ax.set_xlabel("simulated time (s)")
            ax.set_xscale("log")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_divergence(runs: dict, path: Path) -> None:
    """Model divergence ``mean_k ||w_k - mean(w)||^2`` over steps (the paper's Fig. 5b)."""
    fig, axes = plt.subplots(1, len(PERIODS), figsize=(5.5 * len(PERIODS), 3.8), sharey=True)
    for ax, h in zip(axes, PERIODS, strict=True):
        for label, run in runs.items():
            if run["period"] != h:
                continue
            rows = run["rows"][: 12 * h]
            ax.plot([r["step"] for r in rows], [r["divergence"] for r in rows], label=label)
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.set_title(f"H = {h}, first {12 * h} steps")
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("model divergence")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
