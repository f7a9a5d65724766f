"""Quality study: data parallelism against DiLoCo, Streaming DiLoCo, SparseLoCo, DiLoCo +
AR-Topk and MuLoCo, each tuned on the same grid shape and schedule, across model sizes.

Protocol (one command per stage; every run's result is kept, an interrupted stage resumes):

* **Data**: the complete works of Shakespeare shipped with the trainer
  (``dataset: shakespeare_complete``, 5.05 MB, see ``train/data.py``): settings are chosen on
  its ``valid`` split and reported on its ``test`` split (interleaved 64 KiB blocks, disjoint).
* **Sizes** (:data:`SIZES`): GPTs of growing width and depth, byte-level, context 128; each
  trains on about 20 tokens per parameter (:func:`budget`), global batch 64 sequences.
* **Schedule** (every method): AdamW (weight decay 0.1) or Muon for MuLoCo's inner steps,
  linear warm-up over 5% of the steps from 0, then cosine decay to 10% of the peak; the
  gradient clipped to global norm 1 (on each worker's own gradient inside DiLoCo).
* **Grids** (:data:`METHODS`): DP's lr {1e-3, 2e-3, 3e-3, 6e-3}; each DiLoCo-family
  method's inner lr on the same grid, crossed with the outer step (SGD 1.0, i.e. plain
  averaging, or Nesterov momentum 0.9 at lr {0.1, 0.3, 0.5, 0.7}) and a data-parallel warm
  start of 0 or 10% of the steps; MuLoCo's Muon lr {0.005, 0.01, 0.02, 0.04} in place of
  the inner lr. The ``tune`` stage runs the whole grid at the smallest size and, at each
  larger size, the grid points next to the previous size's choice (one grid step either
  way on every axis): a stated narrowing, since two CPU cores cannot run the full grid on
  the larger models.
* **Selection**: per size and method, the setting with the lowest validation loss (seed 0);
  the ``seeds`` stage runs it with seeds 1 and 2; the report gives the test loss's mean and
  spread over the three.
* **Bytes and time**: total and peak bytes a worker sent (the logs the contract suite checks
  against the compiled programs) and the simulated time on V100 compute at 100 Mbit/s /
  50 ms, 1 Gbit/s / 10 ms and 10 Gbit/s / 1 ms, replayed from each run's logged rows.

    python benchmarks/quality.py tune --size xs     # the grid at one size (resumes)
    python benchmarks/quality.py seeds --size xs    # the selected settings, seeds 1 and 2
    python benchmarks/quality.py report             # tables and plots from every kept run
    python benchmarks/quality.py tune --size xs --methods dp diloco_h30 --dry-run

Writes ``runs/<size>/<method>/<setting>_s<seed>.json`` (one per run), ``quality.md``,
``quality.json`` and the plots under ``--out`` (default ``benchmarks/results/quality``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

OUT = Path("benchmarks/results/quality")
NETWORKS = {"100 Mbps": "50ms,100Mbps", "1 Gbps": "10ms,1Gbps", "10 Gbps": "1ms,10Gbps"}
TRAIN_NET = "100 Mbps"
GLOBAL_BATCH = 64
SEQ_LEN = 128
TOKENS_PER_PARAM = 20

SIZES: dict[str, dict[str, int]] = {
    # The fast protocol test's size: a handful of steps.
    "tiny": {"num_layers": 1, "width": 32, "num_heads": 2, "seq_len": 32},
    "xs": {"num_layers": 2, "width": 64, "num_heads": 4, "seq_len": SEQ_LEN},
    "s": {"num_layers": 4, "width": 128, "num_heads": 4, "seq_len": SEQ_LEN},
    "m": {"num_layers": 6, "width": 192, "num_heads": 6, "seq_len": SEQ_LEN},
    "l": {"num_layers": 8, "width": 256, "num_heads": 8, "seq_len": SEQ_LEN},
}
ORDER = list(SIZES)

LRS = (1e-3, 2e-3, 3e-3, 6e-3)
MUON_LRS = (0.005, 0.01, 0.02, 0.04)
# (outer_lr, outer_momentum): plain averaging, then Nesterov at 0.9.
OUTERS = ((1.0, 0.0), (0.1, 0.9), (0.3, 0.9), (0.5, 0.9), (0.7, 0.9))
WARM = (0.0, 0.1)  # fraction of the steps run as data parallelism first


def _diloco(period: int, **sync: Any) -> dict[str, Any]:
    return {"aggregator": "none", "sync": {"method": "diloco", "period": period, **sync}}


# Each method: its fixed config and the axes of its grid ("lr" or "muon_lr", "outer",
# "warm"); "workers" comes from the command line (the same global batch).
METHODS: dict[str, dict[str, Any]] = {
    "dp": {"fixed": {"aggregator": "ring"}, "grid": {"lr": LRS}},
    "diloco_h30": {"fixed": _diloco(30), "grid": {"lr": LRS, "outer": OUTERS, "warm": WARM}},
    "diloco_h100": {"fixed": _diloco(100), "grid": {"lr": LRS, "outer": OUTERS, "warm": WARM}},
    "streaming_h30": {
        "fixed": _diloco(30, fragments=3, overlap=1, compress="int4"),
        "grid": {"lr": LRS, "outer": OUTERS, "warm": WARM},
    },
    "sparseloco_h30": {
        "fixed": _diloco(30, compress="sparseloco"),
        "grid": {"lr": LRS, "outer": OUTERS, "warm": WARM},
    },
    "ar_topk_h30": {
        "fixed": _diloco(30, compress="ar_topk"),
        "grid": {"lr": LRS, "outer": OUTERS, "warm": WARM},
    },
    "muloco_h30": {
        "fixed": {**_diloco(30, compress="statistical"), "optimizer": "muon"},
        "grid": {"muon_lr": MUON_LRS, "outer": OUTERS, "warm": WARM},
    },
    # One worker alone at the per-worker batch (8 of 64), for reference.
    "single": {
        "fixed": {"aggregator": "ring", "workers": 1, "global_batch": GLOBAL_BATCH // 8},
        "grid": {"lr": LRS},
    },
}


def param_count(size: str) -> int:
    """Parameters of the GPT of ``size`` (byte vocabulary)."""
    m = SIZES[size]
    w, layers, t = m["width"], m["num_layers"], m["seq_len"]
    block = 12 * w * w + 13 * w  # qkv, proj, fc, proj kernels and biases, two norms
    return layers * block + 256 * w + t * w + 2 * w + w * 256 + 256


def budget(size: str, tokens_per_param: float = TOKENS_PER_PARAM) -> int:
    """Steps of ``size``'s token budget: about ``tokens_per_param`` tokens a parameter, at
    64 sequences a step, rounded up to a multiple of 100 (two periods of H = 100 fit)."""
    per_step = GLOBAL_BATCH * SIZES[size]["seq_len"]
    return max(100, math.ceil(tokens_per_param * param_count(size) / per_step / 100) * 100)


def setting_key(setting: dict[str, Any]) -> str:
    """A file-name-safe, stable name of a grid point."""
    parts = []
    for k in sorted(setting):
        v = setting[k]
        v = "-".join(f"{x:g}" for x in v) if isinstance(v, (tuple, list)) else f"{v:g}"
        parts.append(f"{k}{v}")
    return "_".join(parts)


def grid(method: str, near: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The grid points of ``method``; with ``near`` (a chosen point) only those within one
    step of it on every axis."""
    axes = METHODS[method]["grid"]
    names = sorted(axes)
    points = []
    for values in itertools.product(*(axes[n] for n in names)):
        point = dict(zip(names, values, strict=True))
        if near is not None and not all(
            abs(list(axes[n]).index(_norm(point[n])) - list(axes[n]).index(_norm(near[n]))) <= 1
            for n in names
        ):
            continue
        points.append(point)
    return points


def _norm(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def config(size: str, method: str, setting: dict[str, Any], seed: int, steps: int, out: Path,
           workers: int = 8) -> Any:  # fmt: skip
    """The trainer config of one run."""
    from train.config import Config

    fixed = json.loads(json.dumps(METHODS[method]["fixed"]))
    kw: dict[str, Any] = dict(
        name=f"{method}_{setting_key(setting)}_s{seed}",
        task="gpt",
        model=dict(SIZES[size]),
        dataset="shakespeare_complete",
        workers=workers,
        global_batch=GLOBAL_BATCH,
        steps=steps,
        seed=seed,
        optimizer="adamw",
        lr=3e-3,
        lr_schedule="cosine",
        lr_warmup_steps=max(1, steps // 20),
        lr_floor=0.1,
        weight_decay=0.1,
        clip_norm=1.0,
        network=NETWORKS[TRAIN_NET],
        compute="v100",
        eval_every=max(steps // 10, 1),
        eval_batches=16,
        checkpoint_every=max(steps // 4, 1),
        out_dir=str(out),
        progress=False,
    )
    sync = fixed.pop("sync", None)
    kw.update(fixed)
    if "lr" in setting:
        kw["lr"] = setting["lr"]
    if "muon_lr" in setting:
        kw["muon_lr"] = setting["muon_lr"]
    if sync is not None:
        outer_lr, outer_mu = setting.get("outer", (0.7, 0.9))
        sync.update(outer_lr=outer_lr, outer_momentum=outer_mu)
        sync["warmup_steps"] = int(round(setting.get("warm", 0.0) * steps))
        kw["sync"] = sync
    return Config(**kw)


def run_path(out: Path, size: str, method: str, setting: dict[str, Any], seed: int,
             workers: int = 8) -> Path:  # fmt: skip
    """Where one run's record is kept."""
    tag = "" if workers == 8 else f"_w{workers}"
    return out / "runs" / size / method / f"{setting_key(setting)}{tag}_s{seed}.json"


def run_one(size: str, method: str, setting: dict[str, Any], seed: int, steps: int, out: Path,
            workers: int = 8) -> dict[str, Any]:  # fmt: skip
    """Train one grid point (resuming its checkpoints if a run was cut short) and keep its
    record; a kept record is returned without training."""
    path = run_path(out, size, method, setting, seed, workers)
    if path.exists():
        return json.loads(path.read_text())
    import jax

    from jaxcomm import Network
    from train.plot import read_metrics
    from train.trainer import Trainer

    scratch = out / "scratch" / path.relative_to(out / "runs").with_suffix("")
    cfg = config(size, method, setting, seed, steps, scratch, workers)
    trainer = Trainer(cfg)
    resume = (cfg.run_dir / "checkpoints").is_dir()
    t0 = time.time()
    summary = trainer.run(resume=resume)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    sent = np.array([r["sent_bytes"] for r in rows], np.float64)
    times = {n: _seconds(trainer, rows, Network.parse(v)) for n, v in NETWORKS.items()}
    tokens = cfg.global_batch * SIZES[size]["seq_len"]  # a step's
    record = {
        "size": size,
        "method": method,
        "setting": setting,
        "seed": seed,
        "workers": workers,
        "steps": steps,
        "tokens": steps * tokens,
        "params": summary["params"],
        "valid_loss": summary["valid_loss"],
        "test_loss": summary["test_loss"],
        "train_loss": float(np.mean([r["loss"] for r in rows[-10:]])),
        "total_bytes": float(sent.sum()),
        "peak_bytes": float(sent.max()),
        "sim_s": {n: float(t.sum()) for n, t in times.items()},
        # (tokens, simulated seconds at TRAIN_NET, validation loss) at each evaluation
        "valid_curve": [
            (r["step"] * tokens, float(np.sum(times[TRAIN_NET][: r["step"]])), r["valid_loss"])
            for r in rows
            if "valid_loss" in r
        ],
        "wall_s": time.time() - t0,
        "finite": bool(np.isfinite(summary["valid_loss"])),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
    jax.clear_caches()
    return record


def _seconds(trainer: Any, rows: list[dict], network: Any) -> np.ndarray:
    """Simulated seconds of every step of a finished run on ``network`` (DiLoCo's link
    clock replayed; otherwise each step's compute plus its logged collectives)."""
    from train.clock import wire_time
    from train.diloco import DiLoCo

    if isinstance(trainer.sync, DiLoCo):
        return trainer.sync.replay(rows, network)
    return np.array([r["sim_compute_s"] + wire_time(r["wire"], network) for r in rows])


def records(out: Path) -> list[dict[str, Any]]:
    """Every kept run record under ``out``."""
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*/*/*.json"))]


def select(recs: Iterable[dict[str, Any]], size: str, method: str) -> dict[str, Any] | None:
    """The grid point of ``method`` at ``size`` with the lowest validation loss (seed 0, 8
    workers, finite); None before any ran. Ties go to the earlier grid point."""
    pool = [r for r in recs if (r["size"], r["method"], r["seed"], r["workers"]) ==
            (size, method, 0, 8) and r["finite"]]  # fmt: skip
    if not pool:
        return None
    order = {setting_key(p): i for i, p in enumerate(grid(method))}
    return min(pool, key=lambda r: (r["valid_loss"], order.get(setting_key(r["setting"]), 0)))


def plan(stage: str, size: str, methods: list[str], out: Path) -> list[tuple]:
    """The runs a stage needs: ``(method, setting, seed, workers)``."""
    recs = records(out)
    jobs: list[tuple] = []
    for method in methods:
        if stage == "tune":
            below = ORDER[: ORDER.index(size)]
            prev = [s for s in below if s != "tiny" and select(recs, s, method) is not None]
            near = select(recs, prev[-1], method)["setting"] if prev else None
            if near is not None:
                near = {k: _norm(v) for k, v in near.items()}
            jobs += [(method, p, 0, 8) for p in grid(method, near)]
        else:  # seeds
            best = select(recs, size, method)
            if best is None:
                raise SystemExit(f"seeds: {method} at {size} has no tuned setting yet (run tune)")
            setting = {k: _norm(v) for k, v in best["setting"].items()}
            jobs += [(method, setting, seed, 8) for seed in (1, 2)]
    return jobs


def summarise(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size and method: the selected setting, its test loss over seeds (mean and
    standard deviation), its gap to DP's, bytes and simulated times."""
    out: dict[str, Any] = {}
    for size in ORDER:
        for method in METHODS:
            best = select(recs, size, method)
            if best is None:
                continue
            same = [r for r in recs if (r["size"], r["method"], r["workers"]) == (size, method, 8)
                    and setting_key(r["setting"]) == setting_key(best["setting"])]  # fmt: skip
            tests = np.array([r["test_loss"] for r in same])
            grid_runs = [r for r in recs if (r["size"], r["method"], r["seed"]) ==
                         (size, method, 0)]  # fmt: skip
            out.setdefault(size, {})[method] = {
                "setting": best["setting"],
                "seeds": sorted(r["seed"] for r in same),
                "test_loss": float(tests.mean()),
                "test_loss_std": float(tests.std(ddof=1)) if len(tests) > 1 else None,
                "valid_loss": best["valid_loss"],
                "params": best["params"],
                "tokens": best["tokens"],
                "total_bytes": best["total_bytes"],
                "peak_bytes": best["peak_bytes"],
                "sim_s": best["sim_s"],
                "grid_points": len(grid_runs),
            }
    for methods in out.values():
        dp = methods.get("dp")
        for m in methods.values():
            if dp:
                m["gap_vs_dp"] = m["test_loss"] / dp["test_loss"] - 1
                m["bytes_vs_dp"] = (
                    dp["total_bytes"] / m["total_bytes"] if m["total_bytes"] else None
                )
    return out


def render(summary: dict[str, Any], meta: list[dict[str, Any]]) -> str:
    """The markdown report."""
    lines = ["# Quality study", ""]
    for m in meta:
        lines.append(f"`{m['command']}` ({m['date']}, {m['machine']}, jax {m['jax']}).")
    lines += ["", "Protocol: see the docstring of `benchmarks/quality.py`.", ""]
    for size, methods in summary.items():
        first = next(iter(methods.values()))
        lines += [
            f"## {size}: {first['params']:,} parameters, {first['tokens']:,} tokens",
            "",
            "| method | chosen setting | grid points | test loss (seeds) | vs DP | bytes / worker "
            "| x fewer than DP | " + " | ".join(f"time @ {n} (s)" for n in NETWORKS) + " |",
            "|---|---|---|---|---|---|---|" + "---|" * len(NETWORKS),
        ]
        for method, m in methods.items():
            std = f" ± {m['test_loss_std']:.3f}" if m["test_loss_std"] is not None else ""
            gap = f"{100 * m['gap_vs_dp']:+.1f}%" if "gap_vs_dp" in m else "-"
            fewer = f"{m['bytes_vs_dp']:,.0f}x" if m.get("bytes_vs_dp") else "-"
            times = " | ".join(f"{m['sim_s'][n]:.1f}" for n in NETWORKS)
            lines.append(
                f"| {method} | `{setting_key(m['setting'])}` | {m['grid_points']} | "
                f"{m['test_loss']:.3f}{std} ({len(m['seeds'])}) | {gap} | "
                f"{m['total_bytes'] / 1e6:,.2f} MB | {fewer} | {times} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run a stage of the study (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["tune", "seeds", "report"])
    ap.add_argument("--size", choices=ORDER, default="xs")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    ap.add_argument("--steps", type=int, default=None, help="instead of the size's budget")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--dry-run", action="store_true", help="list the runs, train nothing")
    args = ap.parse_args(argv)
    out: Path = args.out
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.stage == "report":
        recs = records(out)
        if not recs:
            ap.error(f"no runs kept under {out / 'runs'}: run the tune stage first")
        summary = summarise(recs)
        meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else []
        (out / "quality.json").write_text(json.dumps(summary, indent=2))
        (out / "quality.md").write_text(render(summary, meta))
        print(render(summary, meta))
        return 0
    steps = args.steps or budget(args.size)
    jobs = plan(args.stage, args.size, args.methods, out)
    todo = [j for j in jobs if not run_path(out, args.size, j[0], j[1], j[2], j[3]).exists()]
    print(f"{args.stage} {args.size}: {len(jobs)} runs of {steps} steps, {len(todo)} to train",
          file=sys.stderr)  # fmt: skip
    if args.dry_run:
        for method, setting, seed, workers in todo:
            print(f"{method} {setting_key(setting)} seed {seed} workers {workers}")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _meta import run_meta
    from tqdm.auto import tqdm

    t0 = time.time()
    for method, setting, seed, workers in tqdm(todo, desc=f"{args.stage} {args.size}"):
        run_one(args.size, method, setting, seed, steps, out, workers)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else []
    meta.append(run_meta(argv, t0))
    with tempfile.NamedTemporaryFile("w", dir=out, delete=False) as f:
        f.write(json.dumps(meta, indent=2))
    os.replace(f.name, meta_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
