"""Quality study: data parallelism against DiLoCo, Streaming DiLoCo, SparseLoCo, DiLoCo +
AR-Topk, MuLoCo and DeMo, each tuned on the same grid shape and schedule, across model sizes.

Protocol (one command per stage; every run's result is kept, an interrupted stage resumes):

* **Data**: the complete works of Shakespeare shipped with the trainer
  (``dataset: shakespeare_complete``, 5.05 MB, see ``train/data.py``): settings are chosen on
  its ``valid`` split and reported on its ``test`` split (interleaved 64 KiB blocks,
  disjoint); every method is evaluated on the same first 1,024 windows of each split.
* **Sizes** (:data:`SIZES`): GPTs of growing width and depth, byte-level, context 128. The
  train split holds 4.7M tokens, which bounds the sizes that two CPU cores can train
  without repeating the text many times: each size's budget is 20 tokens per parameter
  rounded up to a whole multiple of 300 steps (:func:`budget`; periods of H = 30 and 100
  complete), which gives 41, 35 and 26 tokens a parameter at xxs, xs and s; global batch 64
  sequences (1,024 tokens a worker at 8 workers); the report states each size's tokens and
  epochs.
* **Schedule** (every method): AdamW (weight decay 0.1), or Muon for MuLoCo's hidden
  matrices, linear warm-up over 5% of the steps from 0, then cosine decay to 10% of the
  peak; the gradient clipped to global norm 1 (on each worker's own gradient inside
  DiLoCo, as its inner optimizer steps on it).
* **Grids** (:data:`METHODS`): DP's lr {1e-3, 2e-3, 3e-3, 6e-3}; each DiLoCo-family
  method's inner lr on the same grid, crossed with the outer step (SGD 1.0, i.e. plain
  averaging, or Nesterov momentum 0.9 at lr {0.1, 0.3, 0.5, 0.7}); the ``_warm`` variants
  first run a quarter of their steps (rounded down to whole periods: 60 of 300 at xxs) as
  data parallelism, as
  the DiLoCo paper starts from a trained model;
  MuLoCo's Muon lr {0.005, 0.01, 0.02, 0.04} with its AdamW lr at {2e-3, 6e-3}, and
  ``dp_muon`` (data parallelism with the same Muon and AdamW, MuLoCo's baseline) on the
  same grid; DeMo's
  sign step {5e-4, 1e-3, 2e-3, 4e-3} (64 x 64 blocks, 32 coefficients each, and momentum
  decay 0.999, the paper's, not tuned; weight decay 0.1 times the step; each worker's
  gradient clipped to norm 1 before it; the schedule multiplies its step, while its
  momentum adds the unweighted gradient, where the authors' code weights each gradient by
  its step's rate); ``demo_k8`` and ``demo_k2`` the same with 8 and 2
  coefficients a block; ``muloco_h30_2p``
  MuLoCo's compressor exchanged in two phases (about 2 / N of the all-gather's bytes),
  its grid Muon lr {0.01, 0.02, 0.04} x AdamW lr {0.012, 0.024} x plain averaging, the
  neighbourhood of ``muloco_h30``'s choice at xxs. At the smallest size the ``tune``
  stage runs the declared grid, then the points next to its choice on the axes as
  extended, again whenever a neighbour wins (until MuLoCo's third axis made it 150 points,
  it ran the whole product of the extended axes: the methods tuned before hold those
  runs, all kept and chosen from, so at xxs MuLoCo alone was tuned by the narrower rule).
  Where the chosen step size sits at an end of its axis, the ``tune`` stage extends that
  axis one step further (x2 or /2) and runs the new points, until the choice is inside. At each
  larger size, once the smaller size's grid is complete, it runs the grid points next to
  that choice (one step either way on every axis; the outer axis in the order above) and
  that choice with the DiLoCo paper's outer step (Nesterov 0.7 / 0.9): a stated narrowing,
  since two CPU cores cannot run the full grid on every size. A size's axes grow only by
  the extensions made at it and below it. The outer axis grows past its ends the same way:
  plain averaging chosen runs outer SGD at lr 1.5, then 2.0 (a step beyond the workers'
  mean); Nesterov 0.7 / 0.9 chosen runs Nesterov at lr 1.0 (:data:`OUTER_PAST`).
* **Selection and report**: per size and method, the setting with the lowest validation
  loss at seed 0 is chosen; the ``seeds`` stage runs it with seeds 1, 2 and 3, and the
  report gives the test loss's mean and spread over those three fresh seeds only (the
  chosen seed-0 run is not in the mean: it won the choice, and with it a lucky draw).
* **Time to DP's loss**: the ``extend`` stage runs the chosen settings of the low-byte
  methods (:data:`LOW_BYTE`) with a schedule three times as long (seed 1); the report gives
  the tokens and simulated time at which each first reaches DP's final validation loss
  (the mean of its fresh seeds; curve and target on the same split), beside DP's time at
  100 Mbit/s and at 10 Gbit/s.
* **Worker count**: the ``workers`` stage runs each method's chosen setting (tuned at 8
  workers) with 2 and 4 workers at the same global batch (seed 1, paired with the 8-worker
  run of seed 1); the report gives each count's test loss and its gap to DP's at that count.
* **Bytes and time**: total and peak bytes a worker sent (the logs the contract suite checks
  against the compiled programs) and the simulated time on V100 compute at 100 Mbit/s /
  50 ms, 1 Gbit/s / 10 ms and 10 Gbit/s / 1 ms, replayed from each run's logged rows, which
  are kept (gzipped) beside its record. At these sizes a step's V100 compute is about
  0.15 ms, so the times are those of the collectives: their latency rounds and bytes. DP
  runs a ring all-reduce, 2 (N - 1) = 14 rounds a step; the report prices it at the faster
  of the ring and a tree (6 rounds of the whole message) on each network, re-priced from
  its kept rows (:func:`dense_at_best`), as a user would choose for the link. DiLoCo's
  float32 outer all-reduce stays a ring (against the low-byte methods). The all-gathers of
  DeMo and the compressed outer steps take 3 rounds (recursive doubling).

    python benchmarks/quality.py tune --size xs     # the grid at one size (resumes)
    python benchmarks/quality.py seeds --size xs    # the selected settings, seeds 1, 2 and 3
    python benchmarks/quality.py extend --size xs   # low-byte methods to 3x the budget
    python benchmarks/quality.py workers --size xs  # the chosen settings at 2 and 4 workers
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
EVAL_WINDOWS = 1024  # the first windows of the valid and test splits, for every method
FRESH_SEEDS = (1, 2, 3)
PERIODS = 300  # budgets are whole multiples: every period of H = 30 and 100 completes

SIZES: dict[str, dict[str, int]] = {
    # The fast protocol test's size: a handful of steps.
    "tiny": {"num_layers": 1, "width": 32, "num_heads": 2, "seq_len": 32},
    "xxs": {"num_layers": 1, "width": 48, "num_heads": 4, "seq_len": SEQ_LEN},
    "xs": {"num_layers": 2, "width": 64, "num_heads": 4, "seq_len": SEQ_LEN},
    "s": {"num_layers": 3, "width": 80, "num_heads": 4, "seq_len": SEQ_LEN},
    "m": {"num_layers": 4, "width": 112, "num_heads": 4, "seq_len": SEQ_LEN},
}
ORDER = list(SIZES)

LRS = (1e-3, 2e-3, 3e-3, 6e-3)
MUON_LRS = (0.005, 0.01, 0.02, 0.04)
DEMO_LRS = (5e-4, 1e-3, 2e-3, 4e-3)  # DeMo's sign step (the paper: 4e-4 at 300M-1B)
# (outer_lr, outer_momentum): plain averaging, then Nesterov at 0.9, in that order.
OUTERS = ((1.0, 0.0), (0.1, 0.9), (0.3, 0.9), (0.5, 0.9), (0.7, 0.9))
PAPER_OUTER = (0.7, 0.9)  # DiLoCo's Nesterov step: run at every size beside the neighbours
# The outer axis past its ends: plain SGD above lr 1 (beyond the workers' mean), Nesterov
# at lr 1.0; a choice at an end runs the next value (the axis keeps this order).
OUTER_PAST = {(1.0, 0.0): (1.5, 0.0), (1.5, 0.0): (2.0, 0.0), (0.7, 0.9): (1.0, 0.9)}
OUTER_ORDER = ((2.0, 0.0), (1.5, 0.0), *OUTERS, (1.0, 0.9))
STEP_AXES = ("lr", "muon_lr")  # step sizes: extended past an end when chosen there
#: The worker counts of the ``workers`` stage (beside the study's 8), at the same global batch.
WORLDS = (2, 4)
MIN_FIT_SIZES = 3  # a scaling fit needs this many sizes (with DP's at the same sizes)
MAX_CROSS = 1e15  # a fitted crossing beyond this many parameters is reported as none
CAP = 3  # the extend stage runs the low-byte methods to this many times the budget
WARM_FRACTION = 0.25  # the _warm variants' data-parallel start, a share of the steps
LOW_BYTE = ("diloco_h30", "sparseloco_h30", "muloco_h30", "demo")


def warm_steps(steps: int, period: int, fraction: float) -> int:
    """Data-parallel steps before a DiLoCo run: ``fraction`` of ``steps``, rounded down to
    whole periods (so that every later period completes)."""
    return int(steps * fraction) // period * period


def _diloco(period: int, **sync: Any) -> dict[str, Any]:
    return {"aggregator": "none", "sync": {"method": "diloco", "period": period, **sync}}


def _family(period: int, warm: bool = False, **sync: Any) -> dict[str, Any]:
    return {
        "fixed": _diloco(period, **sync),
        "grid": {"lr": LRS, "outer": OUTERS},
        "warm": WARM_FRACTION if warm else 0.0,
    }


# Each method: its fixed config, the axes of its grid ("lr", "muon_lr", "outer") and the
# share of its steps it starts with as data parallelism.
METHODS: dict[str, dict[str, Any]] = {
    "dp": {"fixed": {"aggregator": "ring"}, "grid": {"lr": LRS}},
    # Data parallelism with MuLoCo's inner optimizer (Muon on the hidden matrices, AdamW on
    # the rest), on MuLoCo's grid: the baseline the MuLoCo paper measures against.
    "dp_muon": {
        "fixed": {"aggregator": "ring", "optimizer": "muon"},
        "grid": {"muon_lr": MUON_LRS, "lr": (2e-3, 6e-3)},
    },
    "diloco_h30": _family(30),
    "diloco_h30_warm": _family(30, warm=True),
    "diloco_h100": _family(100),
    "streaming_h30": _family(30, fragments=3, overlap=1, compress="int4"),
    "sparseloco_h30": _family(30, compress="sparseloco"),
    "sparseloco_h30_warm": _family(30, warm=True, compress="sparseloco"),
    # Each entry averaged over the workers that sent it (the authors' code), not all N.
    "sparseloco_h30_senders": _family(30, compress={"name": "sparseloco", "average": "senders"}),
    "ar_topk_h30": _family(30, compress="ar_topk"),
    "muloco_h30": {
        "fixed": {**_diloco(30, compress="statistical"), "optimizer": "muon"},
        "grid": {"muon_lr": MUON_LRS, "lr": (2e-3, 6e-3), "outer": OUTERS},
    },
    # MuLoCo's compressor in two phases (each worker averages one segment and re-encodes it
    # before the all-gather: about 2 / N of the gather's bytes; not the paper's exchange),
    # on a grid narrowed to the neighbourhood of muloco_h30's choice at xxs.
    "muloco_h30_2p": {
        "fixed": {
            **_diloco(30, compress={"name": "statistical_quantized", "exchange": "two_phase"}),
            "optimizer": "muon",
        },
        "grid": {"muon_lr": (0.01, 0.02, 0.04), "lr": (0.012, 0.024), "outer": ((1.0, 0.0),)},
    },
    # DeMo: a sign step, so its own step-size grid; the same schedule multiplies its step
    # and its decoupled weight decay (0.1, as AdamW's); clipping before it, as the others.
    "demo": {
        "fixed": {
            "aggregator": {"name": "demo", "chunk": 64, "k": 32, "weight_decay": 0.1},
            "optimizer": "none",
        },
        "grid": {"lr": DEMO_LRS},
    },
    # DeMo keeping 8 coefficients a block: its all-gather puts N - 1 copies of each payload
    # on the wire, so on 64 x 64 blocks at N = 8 k = 32 is at most 21x below DP's ring and
    # k = 8 85x; on these narrow models (mostly partial blocks) measured 9-12x and 35x.
    "demo_k8": {
        "fixed": {
            "aggregator": {"name": "demo", "chunk": 64, "k": 8, "weight_decay": 0.1},
            "optimizer": "none",
        },
        "grid": {"lr": DEMO_LRS},
    },
    # DeMo keeping 2 coefficients a block: at least 85x below DP's ring on the wire at every
    # size here (136-194x), where k = 8 is 34-49x.
    "demo_k2": {
        "fixed": {
            "aggregator": {"name": "demo", "chunk": 64, "k": 2, "weight_decay": 0.1},
            "optimizer": "none",
        },
        "grid": {"lr": DEMO_LRS},
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
    """Steps of ``size``'s token budget: about ``tokens_per_param`` tokens a parameter at 64
    sequences a step, rounded up to whole multiples of :data:`PERIODS` steps."""
    per_step = GLOBAL_BATCH * SIZES[size]["seq_len"]
    return max(
        PERIODS, math.ceil(tokens_per_param * param_count(size) / per_step / PERIODS) * PERIODS
    )


def setting_key(setting: dict[str, Any]) -> str:
    """A file-name-safe, stable name of a grid point."""
    parts = []
    for k in sorted(setting):
        v = setting[k]
        v = "-".join(f"{x:g}" for x in v) if isinstance(v, (tuple, list)) else f"{v:g}"
        parts.append(f"{k}{v}")
    return "_".join(parts)


def _norm(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def axes(method: str, recs: Iterable[dict[str, Any]] = ()) -> dict[str, tuple]:
    """The axes of ``method``'s grid, step-size axes extended by the kept runs' extra
    points (values beyond the declared ends, run by :func:`plan`)."""
    out = {k: tuple(_norm(v) for v in vs) for k, vs in METHODS[method]["grid"].items()}
    for r in recs:
        if r["method"] != method:
            continue
        for k in STEP_AXES:
            if k in out and r["setting"].get(k) is not None and r["setting"][k] not in out[k]:
                out[k] = tuple(sorted({*out[k], r["setting"][k]}))
        outer = _norm(r["setting"].get("outer"))
        if "outer" in out and outer in OUTER_ORDER and outer not in out["outer"]:
            have = {*out["outer"], outer}
            out["outer"] = tuple(v for v in OUTER_ORDER if v in have)
    return out


def grid(method: str, near: dict[str, Any] | None = None, recs: Iterable = ()) -> list[dict]:
    """The grid points of ``method``; with ``near`` (a chosen point) only those within one
    step of it on every axis, and the chosen point with the DiLoCo paper's outer step
    (:data:`PAPER_OUTER`) where the grid has an outer axis."""
    ax = axes(method, recs)
    names = sorted(ax)
    points = []
    for values in itertools.product(*(ax[n] for n in names)):
        point = dict(zip(names, values, strict=True))
        if near is not None and not all(
            abs(ax[n].index(point[n]) - ax[n].index(_norm(near[n]))) <= 1 for n in names
        ):
            continue
        points.append(point)
    if near is not None and PAPER_OUTER in ax.get("outer", ()):
        anchor = {**{n: _norm(near[n]) for n in names}, "outer": PAPER_OUTER}
        if anchor not in points:
            points.append(anchor)
    return points


def config(size: str, method: str, setting: dict[str, Any], seed: int, steps: int, out: Path,
           workers: int = 8) -> Any:  # fmt: skip
    """The trainer config of one run."""
    from train.config import Config

    spec = METHODS[method]
    fixed = json.loads(json.dumps(spec["fixed"]))
    optimizer: dict[str, Any] = {
        "name": fixed.pop("optimizer", "adamw"),
        "lr": setting.get("lr", 3e-3),
        "schedule": {"name": "cosine", "warmup_steps": max(1, steps // 20), "floor": 0.1},
        "weight_decay": 0.1,
        "clip_norm": 1.0,
    }
    if "muon_lr" in setting:
        optimizer["muon_lr"] = setting["muon_lr"]
    if optimizer["name"] == "none":  # a whole optimizer: its own lr, the schedule its factor
        fixed["aggregator"]["lr"] = optimizer.pop("lr")
        del optimizer["weight_decay"]  # the aggregator's own (fixed above)
    kw: dict[str, Any] = dict(
        name=f"{method}_{setting_key(setting)}_s{seed}",
        model={"name": "gpt", **SIZES[size]},
        dataset="shakespeare_complete",
        workers=workers,
        global_batch=GLOBAL_BATCH,
        steps=steps,
        seed=seed,
        optimizer=optimizer,
        network=NETWORKS[TRAIN_NET],
        compute="v100",
        eval_every=max(steps // 20, 1),
        checkpoint_every=max(steps // 2, 1),
        out_dir=str(out),
        progress=False,
    )
    sync = fixed.pop("sync", None)
    kw.update(fixed)
    kw["eval_batches"] = max(1, EVAL_WINDOWS // kw["global_batch"])
    if sync is not None:
        outer_lr, outer_mu = _norm(setting["outer"])
        sync.update(outer_lr=outer_lr, outer_momentum=outer_mu)
        sync["warmup_steps"] = warm_steps(steps, sync["period"], spec.get("warm", 0.0))
        kw["sync"] = sync
    return Config(**kw)


def run_path(out: Path, size: str, method: str, setting: dict[str, Any], seed: int,
             steps: int, workers: int = 8) -> Path:  # fmt: skip
    """Where one run's record is kept (its steps in the name: a shorter trial never stands
    in for a budget run)."""
    tag = "" if workers == 8 else f"_w{workers}"
    return out / "runs" / size / method / f"{setting_key(setting)}{tag}_n{steps}_s{seed}.json"


TRAIN_TOKENS = 72 * 65_536  # the train split of the complete works (72 of 78 blocks)


def run_one(size: str, method: str, setting: dict[str, Any], seed: int, steps: int, out: Path,
            workers: int = 8) -> dict[str, Any]:  # fmt: skip
    """Train one grid point (continuing its checkpoints if a run was cut short) and keep its
    record and its per-step rows; a kept record is returned without training."""
    path = run_path(out, size, method, setting, seed, steps, workers)
    if path.exists():
        return json.loads(path.read_text())
    import gzip

    from jaxcomm.network import Network
    from train.plot import read_metrics
    from train.trainer import Trainer, nothing_to_resume

    scratch = out / "scratch" / path.relative_to(out / "runs").with_suffix("")
    cfg = config(size, method, setting, seed, steps, scratch, workers)
    resume = cfg.run_dir.is_dir() and nothing_to_resume(cfg) is None
    if not resume:  # nothing saved yet (or never started): start clean
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
    trainer = Trainer(cfg)
    t0 = time.time()
    summary = trainer.run(resume=resume)
    rows = read_metrics(cfg.run_dir / "metrics.jsonl")
    sent = np.array([r["sent_bytes"] for r in rows], np.float64)
    times = {n: _seconds(trainer, rows, Network.parse(v)) for n, v in NETWORKS.items()}
    per_step = cfg.global_batch * SIZES[size]["seq_len"]  # tokens a step
    record = {
        "size": size,
        "method": method,
        "setting": setting,
        "seed": seed,
        "workers": cfg.workers,
        "world": workers,  # the study's worker count (8, or the 2 and 4 of the ablation)
        "global_batch": cfg.global_batch,
        "steps": steps,
        "tokens": steps * per_step,
        "epochs": steps * per_step / TRAIN_TOKENS,
        "params": summary["params"],
        "valid_loss": summary["valid_loss"],
        "test_loss": summary["test_loss"],
        "train_loss": float(np.mean([r["loss"] for r in rows[-10:]])),
        "total_bytes": float(sent.sum()),
        "peak_bytes": float(sent.max()),
        "sim_s": {n: float(t.sum()) for n, t in times.items()},
        # (tokens, simulated seconds on each network, validation loss) at each evaluation
        "valid_curve": [
            (
                r["step"] * per_step,
                {n: float(np.sum(t[: r["step"]])) for n, t in times.items()},
                r["valid_loss"],
            )
            for r in rows
            if "valid_loss" in r
        ],  # fmt: skip
        "wall_s": time.time() - t0,
        "finite": bool(np.isfinite(summary["valid_loss"])),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    rows_path = path.with_suffix(".metrics.jsonl.gz")
    rows_path.write_bytes(gzip.compress((cfg.run_dir / "metrics.jsonl").read_bytes(), mtime=0))
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)  # the record last: a run counts once its rows are beside it
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
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
    """Every kept run record under ``out`` (``_rows``: where its per-step rows are kept)."""
    out_recs = []
    for p in sorted((out / "runs").glob("*/*/*_s*.json")):
        rec = json.loads(p.read_text())
        rec["_rows"] = str(p.with_suffix(".metrics.jsonl.gz"))
        out_recs.append(rec)
    return out_recs


def dense_at_best(rows: list[dict[str, Any]], network: Any) -> float:
    """Simulated seconds of a run's steps on ``network`` with each logged ring all-reduce
    priced at the faster of the ring and a tree all-reduce of the same message (2 ceil(log2
    N) rounds, each carrying the whole message): DP's collective as a user would choose it
    for that link (the ring's 2 (N - 1) latency rounds dominate on slow links)."""
    from jaxcomm.network import collective_cost

    total = 0.0
    for r in rows:
        total += r["sim_compute_s"]
        for kind, calls, message, _, rounds, path in r["wire"]:
            ring = network.wire_seconds(rounds, path)
            if kind == "ring_allreduce" and calls:
                n = int(round(rounds / calls / 2)) + 1  # the ring's 2 (N - 1) rounds a call
                a, b = collective_cost("tree_allreduce", n)
                ring = min(ring, network.wire_seconds(calls * a, calls * b * message))
            total += ring
    return total


def _mine(recs: Iterable[dict], size: str, method: str, steps: int, seeds: Iterable[int],
          workers: int = 8) -> list[dict]:  # fmt: skip
    seeds = set(seeds)
    return [r for r in recs if (r["size"], r["method"], r["steps"], r["world"]) ==
            (size, method, steps, workers) and r["seed"] in seeds]  # fmt: skip


def select(recs: Iterable[dict[str, Any]], size: str, method: str, steps: int) -> dict | None:
    """The grid point of ``method`` at ``size`` (``steps`` steps) with the lowest validation
    loss at seed 0 (finite); None before any ran. Ties go to the earlier grid point."""
    recs = list(recs)
    pool = [r for r in _mine(recs, size, method, steps, (0,)) if r["finite"]]
    if not pool:
        return None
    order = {setting_key(p): i for i, p in enumerate(grid(method, recs=recs))}
    return min(pool, key=lambda r: (r["valid_loss"], order.get(setting_key(r["setting"]), 1e9)))


def pending(size: str, method: str, steps: int, recs: list[dict], sizes_steps: dict) -> list:
    """The tune stage's grid points of ``method`` at ``size`` not run yet: at the smallest
    size the declared grid, then the neighbours of its choice (of each new choice, while a
    neighbour wins); at a larger size the
    neighbours of the previous size's choice (once that size is complete); neighbours are
    within one value on every axis, on the axes as extended so far. Then, once those ran,
    the next point past an end of the values this size tried on a step-size axis where the
    choice sits there: the axis's next value, or twice or half the end past the axis (while
    within 8x of the declared axis). (Until MuLoCo's third axis made it 150 points, the
    smallest size ran the whole product of its extended axes: the xxs runs of the methods
    tuned before hold more points than this rule asks, all kept and all chosen from.)"""
    prev = [z for z in ORDER[: ORDER.index(size)] if z != "tiny" and z in sizes_steps]
    # Extensions made at a larger size do not reopen this size's grid.
    recs = [r for r in recs if ORDER.index(r["size"]) <= ORDER.index(size)]
    near = None
    if prev:
        z = prev[-1]
        if pending(z, method, sizes_steps[z], recs, sizes_steps):
            return [None]  # the smaller size first
        best = select(recs, z, method, sizes_steps[z])
        near = None if best is None else {k: _norm(v) for k, v in best["setting"].items()}
    done = {setting_key(r["setting"]) for r in _mine(recs, size, method, steps, (0,))}
    if near is None:  # no smaller size to start from: the declared grid, then neighbours
        todo = [p for p in grid(method) if setting_key(p) not in done]
        first = select(recs, size, method, steps) if not todo else None
        if first is not None:
            near = {k: _norm(v) for k, v in first["setting"].items()}
    if near is not None:  # on the axes as extended so far
        todo = [p for p in grid(method, near, recs) if setting_key(p) not in done]
    if todo:
        return todo
    best = select(recs, size, method, steps)
    if best is None:
        return []
    ax, declared = axes(method, recs), METHODS[method]["grid"]
    mine = _mine(recs, size, method, steps, (0,))
    extra = []
    for k in STEP_AXES:
        if k not in ax:
            continue
        v = best["setting"][k]
        tried = {r["setting"][k] for r in mine}
        if v == max(tried):
            past = [x for x in ax[k] if x > v]
            nxt = min(past) if past else v * 2.0
        elif v == min(tried):
            past = [x for x in ax[k] if x < v]
            nxt = max(past) if past else v * 0.5
        else:
            continue
        if not min(declared[k]) / 8 <= nxt <= max(declared[k]) * 8:
            continue
        point = {**{kk: _norm(vv) for kk, vv in best["setting"].items()}, k: _norm(nxt)}
        if setting_key(point) not in done:
            extra.append(point)
    nxt = OUTER_PAST.get(_norm(best["setting"].get("outer")))
    if "outer" in ax and nxt is not None and len(ax["outer"]) > 1:
        point = {**{kk: _norm(vv) for kk, vv in best["setting"].items()}, "outer": nxt}
        if setting_key(point) not in done:
            extra.append(point)
    return extra


def plan(stage: str, size: str, methods: list[str], steps: int, out: Path) -> list[tuple]:
    """The runs a stage needs next: ``(method, setting, seed, workers)``."""
    recs = records(out)
    # Each size's budget, for the sizes below this one (the narrowing reads their choice).
    sizes_steps = {z: budget(z) for z in ORDER[: ORDER.index(size)] if z != "tiny"}
    sizes_steps[size] = steps
    jobs: list[tuple] = []
    for method in methods:
        if stage == "tune":
            todo = pending(size, method, steps, recs, sizes_steps)
            if todo == [None]:
                raise SystemExit(
                    f"tune {size}: finish {method}'s tuning at the smaller sizes first"
                )
            jobs += [(method, p, 0, 8) for p in todo]
        elif stage == "extend":  # the chosen setting, run CAP times as long, one fresh seed
            best = select(recs, size, method, steps // CAP)
            if best is None:
                raise SystemExit(f"extend: {method} at {size} has no tuned setting yet (run tune)")
            jobs.append((method, {k: _norm(v) for k, v in best["setting"].items()}, 1, 8))
        elif stage == "workers":  # the chosen setting at fewer workers, same global batch
            best = select(recs, size, method, steps)
            if best is None:
                raise SystemExit(f"workers: {method} at {size} has no tuned setting yet (run tune)")
            setting = {k: _norm(v) for k, v in best["setting"].items()}
            jobs += [(method, setting, FRESH_SEEDS[0], w) for w in WORLDS]
        else:  # seeds
            best = select(recs, size, method, steps)
            if best is None:
                raise SystemExit(f"seeds: {method} at {size} has no tuned setting yet (run tune)")
            setting = {k: _norm(v) for k, v in best["setting"].items()}
            jobs += [(method, setting, seed, 8) for seed in FRESH_SEEDS]
    return jobs


def _left(recs: list[dict[str, Any]], size: str, method: str, steps: int) -> int:
    """Grid points the ``tune`` stage would still run for ``method`` at ``size`` (its choice
    is provisional until none are left; -1: a smaller size's tuning is not complete)."""
    sizes_steps = {z: budget(z) for z in ORDER[: ORDER.index(size)] if z != "tiny"}
    todo = pending(size, method, steps, recs, {**sizes_steps, size: steps})
    return -1 if todo == [None] else len(todo)


def _dp_seconds(rec: dict[str, Any]) -> dict[str, float]:
    """A DP run's simulated seconds on each network with its all-reduce at the faster of
    ring and tree (:func:`dense_at_best`); as logged where its rows are not kept."""
    import gzip

    from jaxcomm.network import Network

    path = Path(rec.get("_rows", ""))
    if not path.is_file():
        return rec["sim_s"]
    rows = [json.loads(x) for x in gzip.decompress(path.read_bytes()).splitlines() if x.strip()]
    rows = [r for r in rows if "wire" in r]
    return {n: dense_at_best(rows, Network.parse(v)) for n, v in NETWORKS.items()}


def summarise(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size and method: the chosen setting, its test loss over the fresh seeds (mean and
    standard deviation; the choosing seed-0 run left out), its gap to DP's (paired by seed:
    mean, min and max), bytes and simulated times."""
    out: dict[str, Any] = {}
    for size in ORDER:
        steps_at = sorted({r["steps"] for r in recs if r["size"] == size})
        for steps in steps_at:
            for method in METHODS:
                best = select(recs, size, method, steps)
                if best is None:
                    continue
                key = setting_key(best["setting"])
                fresh = sorted(
                    (r for r in _mine(recs, size, method, steps, FRESH_SEEDS)
                     if setting_key(r["setting"]) == key),
                    key=lambda r: r["seed"],
                )  # fmt: skip
                tests = np.array([r["test_loss"] for r in fresh])
                out.setdefault(size, {})[method] = {
                    "setting": best["setting"],
                    "steps": steps,
                    "seeds": [r["seed"] for r in fresh],
                    "test_by_seed": {r["seed"]: r["test_loss"] for r in fresh},
                    "test_loss": float(tests.mean()) if len(tests) else None,
                    "test_loss_std": float(tests.std(ddof=1)) if len(tests) > 1 else None,
                    "valid_loss": best["valid_loss"],
                    "params": best["params"],
                    "tokens": best["tokens"],
                    "epochs": best["epochs"],
                    "total_bytes": best["total_bytes"],
                    "peak_bytes": best["peak_bytes"],
                    "sim_s": _dp_seconds(best) if method == "dp" else best["sim_s"],
                    "grid_points": len(_mine(recs, size, method, steps, (0,))),
                    "tuning_left": _left(recs, size, method, steps),
                }
    for methods in out.values():
        dp = methods.get("dp")
        for m in methods.values():
            if not dp:
                continue
            paired = [m["test_by_seed"][s] / dp["test_by_seed"][s] - 1
                      for s in m["test_by_seed"] if s in dp["test_by_seed"]]  # fmt: skip
            if paired:
                m["gap_vs_dp"] = float(np.mean(paired))
                m["gap_vs_dp_range"] = (float(min(paired)), float(max(paired)))
            total = m["total_bytes"]
            m["bytes_vs_dp"] = dp["total_bytes"] / total if total else None
    for size, methods in out.items():
        dp = methods.get("dp")
        if not dp or not dp["seeds"]:
            continue
        target = float(np.mean([r["valid_loss"] for r in _mine(recs, size, "dp", dp["steps"],
                                FRESH_SEEDS) if setting_key(r["setting"]) ==
                                setting_key(dp["setting"])]))  # fmt: skip
        dp_run = next(r for r in _mine(recs, size, "dp", dp["steps"], dp["seeds"][:1])
                      if setting_key(r["setting"]) == setting_key(dp["setting"]))  # fmt: skip
        reach = {"target_valid_loss": target, "dp_sim_s": _dp_seconds(dp_run),
                 "dp_tokens": dp_run["tokens"], "methods": {}}  # fmt: skip
        for method, m in methods.items():
            long = [r for r in _mine(recs, size, method, CAP * m["steps"], (1,))
                    if setting_key(r["setting"]) == setting_key(m["setting"])]  # fmt: skip
            if not long:
                continue
            hit = next((c for c in long[0]["valid_curve"] if c[2] <= target), None)
            reach["methods"][method] = (
                {"tokens": hit[0], "sim_s": hit[1]} if hit else {"tokens": None, "cap": CAP}
            )
        methods["_time_to_dp"] = reach
    for size, methods in out.items():
        worlds: dict[str, Any] = {}
        for method, m in methods.items():
            if method.startswith("_"):
                continue
            seed, key = FRESH_SEEDS[0], setting_key(m["setting"])
            runs = {w: [r for r in _mine(recs, size, method, m["steps"], (seed,), w)
                        if setting_key(r["setting"]) == key]
                    for w in (*WORLDS, 8)}  # fmt: skip
            if any(runs[w] for w in WORLDS):
                worlds[method] = {str(w): rs[0]["test_loss"] for w, rs in runs.items() if rs}
        if worlds:
            methods["_workers"] = {"seed": FRESH_SEEDS[0], "methods": worlds}
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 1e5 else f"{n:,.0f} B"


def render(summary: dict[str, Any], meta: list[dict[str, Any]]) -> str:
    """The markdown report."""
    lines = ["# Quality study", ""]
    for m in meta:
        lines.append(f"`{m['command']}` ({m['date']}, {m['machine']}, jax {m['jax']}).")
    sizes = " ".join(z for z in summary if z != "tiny")
    lines += [
        "",
        "The stages above are those whose last command completed here (earlier stages ran "
        "in earlier sessions; each run's record under `runs/` holds its setting, seed and "
        f"wall time). To reproduce every run: `for S in {sizes}; do python "
        "benchmarks/quality.py tune --size $S && python benchmarks/quality.py seeds --size "
        "$S; done`, then the `extend` and `workers` stages, then `report`.",
        "",
        "Protocol: see the docstring of `benchmarks/quality.py`.",
        "",
    ]
    for size, methods in summary.items():
        reach, worlds = methods.get("_time_to_dp"), methods.get("_workers")
        methods = {k: v for k, v in methods.items() if not k.startswith("_")}
        ref = methods.get("dp") or next(iter(methods.values()))
        lines += [
            f"## {size}: {ref['params']:,} parameters, {ref['steps']} steps, "
            f"{ref['tokens']:,} tokens ({ref['epochs']:.2f} epochs of the train split)",
            "",
            "| method | chosen setting (provisional while grid points are left) | grid points "
            "| test loss (fresh seeds) | vs DP (paired) "
            "| bytes / worker | x fewer than DP | "
            + " | ".join(f"time @ {n} (s)" for n in NETWORKS) + " |",
            "|---|---|---|---|---|---|---|" + "---|" * len(NETWORKS),
        ]  # fmt: skip
        for method, m in methods.items():
            if m["test_loss"] is None:
                loss = f"(seeds pending; valid {m['valid_loss']:.3f})"
            else:
                std = f" ± {m['test_loss_std']:.3f}" if m["test_loss_std"] is not None else ""
                loss = f"{m['test_loss']:.3f}{std} ({len(m['seeds'])})"
            gap = "-"
            if "gap_vs_dp" in m:
                lo, hi = m["gap_vs_dp_range"]
                gap = f"{100 * m['gap_vs_dp']:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]"
            fewer = f"{m['bytes_vs_dp']:,.0f}x" if m.get("bytes_vs_dp") else "-"
            times = " | ".join(f"{m['sim_s'][n]:.1f}" for n in NETWORKS)
            points = f"{m['grid_points']}"
            if m.get("tuning_left"):
                left = m["tuning_left"]
                points += f" ({left} left)" if left > 0 else " (smaller size unfinished)"
            lines.append(
                f"| {method} | `{setting_key(m['setting'])}` | {points} | {loss} | "
                f"{gap} | {_mb(m['total_bytes'])} | {fewer} | {times} |"
            )
        lines.append("")
        if reach and reach["methods"]:
            dp_s = reach["dp_sim_s"]
            lines += [
                f"Time to DP's final validation loss ({reach['target_valid_loss']:.3f}, the "
                f"mean of its fresh seeds): each method's chosen setting run {CAP}x as long "
                f"(seed 1), the first evaluation at or below it. DP needs "
                f"{dp_s[TRAIN_NET]:.1f} s at {TRAIN_NET} and {dp_s['10 Gbps']:.1f} s at 10 Gbps "
                "(DP's times, here and above: its all-reduce at the faster of ring and tree).",
                "",
                f"| method | tokens (x DP's) | time @ {TRAIN_NET} (s) | vs DP @ 10 Gbps |",
                "|---|---|---|---|",
            ]
            for method, r in reach["methods"].items():
                if r["tokens"] is None:
                    lines.append(f"| {method} | not within {CAP}x | - | - |")
                    continue
                t = r["sim_s"][TRAIN_NET]
                lines.append(
                    f"| {method} | {r['tokens']:,} ({r['tokens'] / reach['dp_tokens']:.2f}x) | "
                    f"{t:.1f} | {t / dp_s['10 Gbps']:.2f}x |"
                )
            lines.append("")
        if worlds:
            lines += _render_worlds(worlds)
    return "\n".join(lines)


def _render_worlds(worlds: dict[str, Any]) -> list[str]:
    """The worker-count table: each method's chosen setting at 2, 4 and 8 workers (the same
    global batch, seed ``worlds["seed"]``), its test loss and its gap to DP's at the same
    count."""
    counts = [str(w) for w in (*WORLDS, 8)]
    dp = worlds["methods"].get("dp", {})
    lines = [
        f"Worker count (the same global batch; each method's chosen setting, seed "
        f"{worlds['seed']}): test loss, and vs DP at the same count.",
        "",
        "| method | " + " | ".join(f"{w} workers" for w in counts) + " |",
        "|---|" + "---|" * len(counts),
    ]
    for method, by in worlds["methods"].items():
        cells = []
        for w in counts:
            if w not in by:
                cells.append("-")
                continue
            gap = f" ({100 * (by[w] / dp[w] - 1):+.1f}%)" if method != "dp" and w in dp else ""
            cells.append(f"{by[w]:.3f}{gap}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def render_fits(fits: dict[str, Any]) -> str:
    """The scaling fits as markdown ("none ahead": the fits do not cross beyond the sizes
    run, or only past :data:`MAX_CROSS` parameters)."""
    if not fits:
        return (
            f"\nScaling fits: fewer than {MIN_FIT_SIZES} sizes with fresh seeds of a method "
            "and of DP yet (a law through two points fits them exactly).\n"
        )
    lines = ["", "## Loss against size", "", "| method | sizes | L(N) = a N^-alpha | meets DP at |",
             "|---|---|---|---|"]  # fmt: skip
    for method, f in fits.items():
        meet = f"{f['meets_dp_at']:,.0f} parameters" if f["meets_dp_at"] else "none ahead"
        meet = "-" if method == "dp" else meet
        lines.append(f"| {method} | {f['sizes']} | {f['a']:.3f} N^-{f['alpha']:.4f} | {meet} |")
    return "\n".join(lines) + "\n"


def _power_law(pts: list[tuple[int, float]]) -> tuple[float, float]:
    """``(a, alpha)`` of ``L = a N^-alpha`` fitted to ``(N, L)`` by least squares in logs."""
    n, loss = np.log([p[0] for p in pts]), np.log([p[1] for p in pts])
    slope, intercept = np.polyfit(n, loss, 1)
    return float(np.exp(intercept)), float(-slope)


def scaling_fit(summary: dict[str, Any]) -> dict[str, Any]:
    """Per method, a power law ``L(N) = a N^-alpha`` fitted (least squares in log-log) to
    its test loss at the sizes with fresh seeds, as the DiLoCo scaling-law study fits each
    method, with DP's law fitted over the same sizes (``dp_a``, ``dp_alpha``); and the size
    at which the two laws meet (``N*``: ``(a_m / a_dp) ** (1 / (alpha_m - alpha_dp))``;
    None when they do not cross ahead). Only over :data:`MIN_FIT_SIZES` sizes or more: a
    law through two points fits them exactly and says nothing of a trend."""
    points: dict[str, dict[int, float]] = {}
    for methods in summary.values():
        for method, m in methods.items():
            if not method.startswith("_") and m.get("test_loss") is not None:
                points.setdefault(method, {})[m["params"]] = m["test_loss"]
    dp_pts = points.get("dp", {})
    fits = {}
    for method, pts in points.items():
        sizes = sorted(n for n in pts if n in dp_pts)
        if len(sizes) < MIN_FIT_SIZES:
            continue
        a, alpha = _power_law([(n, pts[n]) for n in sizes])
        a_dp, alpha_dp = _power_law([(n, dp_pts[n]) for n in sizes])
        f = {"a": a, "alpha": alpha, "sizes": len(sizes), "dp_a": a_dp, "dp_alpha": alpha_dp}
        f["meets_dp_at"] = None
        if method != "dp" and alpha > alpha_dp:
            # In logs: with nearly equal exponents the crossing is astronomically far.
            log_cross = math.log(a / a_dp) / (alpha - alpha_dp)
            # Only a crossing ahead of the sizes run (approached from above, and before
            # MAX_CROSS parameters) is a meeting.
            if math.log(sizes[-1]) < log_cross < math.log(MAX_CROSS):
                f["meets_dp_at"] = math.exp(log_cross)
        fits[method] = f
    return fits


def plot(recs: list[dict[str, Any]], summary: dict[str, Any], fits: dict, out: Path) -> None:
    """``curves_<size>.png``: validation loss of each method's chosen setting (its first
    fresh seed, else the choosing run) against tokens and against simulated time at 100
    Mbit/s and at 1 Gbit/s; ``gap_vs_size.png``: each method's test loss against size with
    its fitted power law, beside DP's, and its gap to DP (paired by seed) against size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for size, methods in summary.items():
        fig, axs = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
        for method, m in methods.items():
            if method.startswith("_"):
                continue
            key = setting_key(m["setting"])
            runs = [r for r in _mine(recs, size, method, m["steps"], (*FRESH_SEEDS, 0))
                    if setting_key(r["setting"]) == key]  # fmt: skip
            run = min(runs, key=lambda r: (r["seed"] == 0, r["seed"]))
            curve = run["valid_curve"]
            loss = [c[2] for c in curve]
            axs[0].plot([c[0] for c in curve], loss, marker=".", label=method)
            for ax, net in ((axs[1], TRAIN_NET), (axs[2], "1 Gbps")):
                ax.plot([c[1][net] for c in curve], loss, marker=".", label=method)
        axs[0].set_xlabel("tokens")
        axs[1].set_xlabel(f"simulated time at {TRAIN_NET} / 50 ms (s, log)")
        axs[2].set_xlabel("simulated time at 1 Gbps / 10 ms (s, log)")
        for ax in axs[1:]:
            ax.set_xscale("log")
        axs[0].set_ylabel("validation loss")
        axs[0].legend(fontsize=7)
        for ax in axs:
            ax.grid(alpha=0.3)
        fig.suptitle(f"{size}: the chosen setting of each method")
        fig.tight_layout()
        fig.savefig(out / f"curves_{size}.png", dpi=110)
        plt.close(fig)
    if not fits:
        return
    fig, (ax, gx) = plt.subplots(1, 2, figsize=(13, 4.5))
    tab = matplotlib.colormaps["tab20"]
    colour = {m: tab(i % 20) for i, m in enumerate(METHODS)}  # one colour a method
    for method in METHODS:
        if method == "dp":
            continue
        pts = sorted(
            (m["params"], m["gap_vs_dp"], *m["gap_vs_dp_range"])
            for methods in summary.values()
            for name, m in methods.items()
            if name == method and m.get("gap_vs_dp") is not None
        )
        if pts:
            ns, gap = [p[0] for p in pts], np.array([100 * p[1] for p in pts])
            err = [gap - [100 * p[2] for p in pts], [100 * p[3] for p in pts] - gap]
            gx.errorbar(ns, gap, yerr=err, marker="o", capsize=3, label=method,
                        color=colour[method])  # fmt: skip
    gx.axhline(0.0, color="k", lw=0.8)
    _size_axes(gx, "test loss above DP's (%, paired by seed)",
               "the gap to data parallelism (bars: the seeds' range)")  # fmt: skip
    for method, f in fits.items():
        pts = sorted(
            (m["params"], m["test_loss"])
            for methods in summary.values()
            for name, m in methods.items()
            if name == method and m.get("test_loss")
        )
        ns = np.array([p[0] for p in pts], float)
        line = ax.plot(ns, [p[1] for p in pts], marker="o", label=method, color=colour[method])[0]
        grid_n = np.geomspace(ns.min(), ns.max() * 4, 50)
        ax.plot(grid_n, f["a"] * grid_n ** -f["alpha"], ls=":", color=line.get_color())
    ax.set_yscale("log")
    _size_axes(ax, "test loss (fresh seeds' mean)",
               "loss against size, with each method's power-law fit (dotted)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "gap_vs_size.png", dpi=110)
    plt.close(fig)


def _size_axes(ax: Any, ylabel: str, title: str) -> None:
    """One panel against model size: log parameters, labels, grid and legend."""
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _compilation_cache(folder: Path) -> None:
    """Keep compiled programs on disk: the runs of one size share most of their programs
    (evaluation, host reads; a grid point's step differs only in its constants). A cache
    the environment already names (``JAX_COMPILATION_CACHE_DIR``) is kept."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv: list[str] | None = None) -> int:
    """Run a stage of the study (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=["tune", "seeds", "extend", "workers", "report"])
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
        fits = scaling_fit(summary)
        (out / "quality.json").write_text(json.dumps({**summary, "_fits": fits}, indent=2))
        text = render(summary, meta) + render_fits(fits)
        (out / "quality.md").write_text(text)
        plot(recs, summary, fits, out)
        print(text)
        return 0
    steps = args.steps or budget(args.size)
    if args.stage == "extend":
        steps *= CAP
        args.methods = [m for m in args.methods if m in LOW_BYTE] or list(LOW_BYTE)
    if args.stage == "workers":  # a method of a fixed worker count has nothing to vary
        args.methods = [m for m in args.methods if "workers" not in METHODS[m]["fixed"]]
    # The benchmarks' folder (_meta) and the checkout (train/, models/) on the path.
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]
    _compilation_cache(out / "scratch" / "xla_cache")
    t0 = time.time()
    while True:  # an extension past an axis's end makes more runs once a choice is known
        jobs = plan(args.stage, args.size, args.methods, steps, out)
        todo = [j for j in jobs if not run_path(out, args.size, *j[:3], steps, j[3]).exists()]
        print(f"{args.stage} {args.size}: {len(todo)} runs of {steps} steps to train",
              file=sys.stderr)  # fmt: skip
        if args.dry_run:
            for method, setting, seed, workers in todo:
                print(f"{method} {setting_key(setting)} seed {seed} workers {workers}")
            return 0
        if not todo:
            break
        import jax
        from tqdm.auto import tqdm

        for i, (method, setting, seed, workers) in enumerate(
            tqdm(todo, desc=f"{args.stage} {args.size}")
        ):
            run_one(args.size, method, setting, seed, steps, out, workers)
            if i + 1 == len(todo) or todo[i + 1][0] != method:
                # A method's runs share their traced and compiled programs in memory; the
                # next method's are others: free these.
                jax.clear_caches()
    from _meta import run_meta

    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else []
    meta.append(run_meta(argv, t0))
    with tempfile.NamedTemporaryFile("w", dir=out, delete=False) as f:
        f.write(json.dumps(meta, indent=2))
    os.replace(f.name, meta_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
