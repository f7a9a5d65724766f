"""Short runs of every shipped config (and the layouts x synchronisations the CLI composes),
recording each run's simulated time, final loss and bytes per step.

    python benchmarks/config_table.py --out benchmarks/results/config_table/after.json
    python benchmarks/config_table.py --compare before.json after.json   # a markdown table

Each row is ``python -m train`` on a config with a few overrides (a short step count, no
evaluation, no progress bar); the estimate-only configs (too large for a CPU) are compiled
from shapes by ``python -m train.estimate``. Compute is each config's roofline, so the
simulated time depends on the config alone and two source trees can be compared to the
digit, on one machine (XLA's CPU code, and so the last digits of a loss, differ between
machines: compare trees run on the same one). artopk_adaptive is the exception: its
controller times the top-k selection on the host, so its choices follow the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHORT = ["steps=10", "eval_every=0", "eval_batches=1", "progress=false", "checkpoint_every=5"]
PIPE = ["stages=2", "workers=4", "microbatches=2", "global_batch=16", "train_samples=32"]

# name -> (config, overrides); "estimate:" rows run train.estimate instead of a run.
ROWS: dict[str, tuple[str, list[str]]] = {
    "dp_default": ("configs/dp_default.yaml", SHORT),
    "artopk_default": ("configs/artopk_default.yaml", SHORT),
    "artopk_adaptive": (
        "configs/artopk_adaptive.yaml",
        [*SHORT, "steps=14", "adaptive.trial_steps=2", "adaptive.min_interval=6"],
    ),
    "dreamddp_default": ("configs/dreamddp_default.yaml", SHORT),
    # The shipped config times the host (compute: measured); a roofline makes it repeatable.
    "marsit_default": ("configs/marsit_default.yaml", [*SHORT, "steps=12", "compute=v100"]),
    "dp_stragglers": (
        "configs/dp_default.yaml",
        [*SHORT, "stragglers={seed: 1, compute_sigma: 0.2, latency_jitter: 0.5}"],
    ),
    "pipeline_aqsgd": (
        "configs/dp_default.yaml",
        [*SHORT, *PIPE, "boundary=aqsgd", "fw_bits=3", "bw_bits=6"],
    ),
    "pipeline_ec_quantized": (
        "configs/dp_default.yaml",
        [*SHORT, *PIPE, "aggregator=ec_quantized", "stragglers={seed: 2, compute_sigma: 0.1}"],
    ),
    # Combinations the composed trainer newly runs (refused before it).
    "pipeline_local_sgd": (
        "configs/dp_default.yaml",
        [*SHORT, *PIPE, "boundary=aqsgd", "aggregator=none", "sync={method: local_sgd, period: 4}"],
    ),
    "pipeline_dreamddp": (
        "configs/dp_default.yaml",
        [*SHORT, *PIPE, "boundary=aqsgd", "aggregator=none", "sync={method: dreamddp, period: 4}"],
    ),
    "pipeline_adaptive": (
        "configs/dp_default.yaml",
        [
            *SHORT,
            *PIPE,
            "boundary=aqsgd",
            "aggregator=ar_topk",
            "lr=0.001",
            "aggregator_args={select: star}",
            "adaptive={candidates: [0.1, 0.01], trial_steps: 1, min_interval: 4}",
        ],
    ),
    "local_sgd_stragglers": (
        "configs/dreamddp_default.yaml",
        [*SHORT, "stragglers={seed: 1, compute_sigma: 0.3, latency_jitter: 0.5}"],
    ),
    "diloco_default": (
        "configs/diloco_default.yaml",
        [*SHORT, "steps=12", "sync={method: diloco, period: 4}"],
    ),
    "diloco_streaming_int8": (
        "configs/diloco_default.yaml",
        [
            *SHORT,
            "steps=12",
            "sync={method: diloco, period: 4, fragments: 2, overlap: 1, compress: int8}",
        ],
    ),
    "diloco_sparseloco_warm": (
        "configs/diloco_default.yaml",
        [
            *SHORT,
            "steps=12",
            "sync={method: diloco, period: 4, compress: sparseloco}",
            "sync.warmup_steps=4",
        ],
    ),
    "dp_adamw_cosine_clip": (
        "configs/dp_default.yaml",
        [
            *SHORT,
            "optimizer=adamw",
            "lr_schedule=cosine",
            "lr_warmup_steps=3",
            "weight_decay=0.1",
            "clip_norm=0.5",
        ],
    ),
    "estimate:aqsgd_gpt2xl": ("configs/aqsgd_gpt2xl.yaml", []),
    "estimate:activations_100x": ("configs/activations_100x.yaml", []),
    "estimate:diloco_intellect1": ("configs/diloco_intellect1.yaml", []),
    "estimate:marsit_resnet50": (
        "configs/marsit_resnet50.yaml",
        ["workers=8", "global_batch=64", "branch:marsit_round=0"],
    ),
}


def _run(root: Path, config: str, overrides: list[str], out: Path, estimate: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    sets = [a for o in overrides if not o.startswith("branch:") for a in ("--set", o)]
    sets += [a for o in overrides if o.startswith("branch:") for a in ("--branch", o[7:])]
    if estimate:
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "train.estimate", "--config", config, *sets]
        cmd += ["--json", str(out / "estimate.json")]
    else:
        cmd = [sys.executable, "-m", "train", "--config", config, *sets, "--set", f"out_dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    if estimate:
        return {"estimate": json.loads((out / "estimate.json").read_text())}
    summary = json.loads((out / "summary.json").read_text())
    # From the log, so trees whose summaries name their bytes differently compare alike.
    sent = [json.loads(r)["sent_bytes"] for r in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "sim_time_s": summary["sim_time_s"],
        "final_loss": summary["final_loss"],
        "sent_bytes_mean": sum(sent) / len(sent),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def measure(root: Path, names: list[str], path: Path | None = None) -> dict:
    """Run every named row in source tree ``root``; ``{name: figures}``, also merged into
    the JSON file ``path`` after each row."""
    out: dict = json.loads(path.read_text()) if path is not None and path.exists() else {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            config, overrides = ROWS[name]
            estimate = name.startswith("estimate:")
            out[name] = _run(root, config, overrides, Path(tmp) / name.replace(":", "_"), estimate)
            print(name, out[name], flush=True)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(out, indent=1))
    return out


def compare(before: dict, after: dict) -> str:
    """A markdown table of two :func:`measure` results, row by row."""
    keys = ("sim_time_s", "final_loss", "sent_bytes_mean", "estimate")
    lines = [
        "| run | " + " | ".join(f"{k} before | after" for k in keys) + " | equal |",
        "|---|" + "---|---|" * len(keys) + "---|",
    ]
    for name in [*before, *(n for n in after if n not in before)]:
        b, a = _figures(before.get(name, {})), _figures(after.get(name, {}))
        cells = []
        for k in keys:
            cells += [_cell(b.get(k, "")), _cell(a.get(k, ""))]
        same = "new (refused before)" if not b else "yes" if b == a else "NO"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


def _figures(row: dict) -> dict:
    """A row's figures without its wall-clock times (which vary from run to run)."""
    out = {k: v for k, v in row.items() if not k.endswith("wall_s")}
    if "estimate" in out:
        est = out["estimate"]
        out["estimate"] = {k: est[k] for k in ("step_s", "sent_bytes_per_device") if k in est}
    return out


def _cell(value: object) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v!r}" for k, v in value.items())
    return repr(value) if value != "" else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=str(ROOT), help="source tree to run (default: this one)")
    p.add_argument("--out", help="write the figures to this JSON file")
    p.add_argument("--only", nargs="*", default=None, help="row names (default: all)")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = p.parse_args()
    if args.compare:
        before, after = (json.loads(Path(f).read_text()) for f in args.compare)
        print(compare(before, after))
        return
    measure(Path(args.root), args.only or list(ROWS), Path(args.out) if args.out else None)


if __name__ == "__main__":
    main()
