"""The trainer's per-step host overhead, with and without lagged (asynchronous) steps.

For each case (a tiny MLP whose step is short, so the host's share is large; the README's
GPT with dense ring all-reduce; local SGD, whose divergence is also read every step), on 8
devices (simulated CPU devices unless a GPU is present), this script measures in
interleaved rounds:

- **device loop**: the trainer's own compiled step called ``--steps`` times back to back
  on batches already on the devices, waiting only at the end: the step time with no host
  work at all (a lower bound for any loop);
- **synchronous**: ``Trainer.run`` with ``async_steps: false`` (the host waits for every
  step, reads its metrics, then dispatches the next);
- **lagged**: ``Trainer.run`` with ``async_steps: true`` (step ``t + 1`` is dispatched
  before step ``t`` is read; batches are prefetched).

A run's step time is the spread of the host's metrics callbacks over its steps,
``(t_last - t_first) / (steps - 1)``, so compilation, the final evaluation and the files
written at the end are left out. Checkpoints and evaluations are off (they drain the queue
by design). Overhead is ``(loop step - device step) / loop step``: the share of a step the
devices spend waiting for the host. Each figure is the median over ``--rounds`` rounds.

    python benchmarks/step_overhead.py [--steps 40] [--rounds 3] [--out benchmarks/results]

Writes ``step_overhead.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _meta import run_meta  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train.config import Config  # noqa: E402
from train.trainer import Trainer  # noqa: E402

GPT = {"num_layers": 4, "width": 128, "num_heads": 4, "seq_len": 64}
CASES = {
    "mlp psum (tiny step)": (
        Trainer,
        dict(model={"name": "mlp", "features": [32]}, dataset="digits", aggregator="psum"),
    ),
    "gpt ring (README model)": (
        Trainer,
        dict(
            model={"name": "gpt", **GPT},
            dataset="shakespeare",
            global_batch=64,
            aggregator="ring",
        ),
    ),
    "mlp local SGD (H=4)": (
        Trainer,
        dict(
            model={"name": "mlp", "features": [32]},
            dataset="digits",
            aggregator="none",
            optimizer={"name": "sgd", "lr": 0.05},
            sync={"method": "local_sgd", "period": 4},
        ),
    ),
}


def _config(kw: dict, steps: int, lagged: bool, out: str) -> Config:
    base = dict(
        name="overhead",
        workers=8,
        global_batch=32,
        steps=steps,
        checkpoint_every=0,
        eval_every=0,
        progress=False,
        compute="measured",
        out_dir=out,
        async_steps=lagged,
    )
    return Config(**{**base, **kw})


def loop_step_s(cls: type, kw: dict, steps: int, lagged: bool) -> float:
    """Seconds per step of ``Trainer.run`` between its first and last metrics callback."""
    stamps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        trainer = cls(_config(kw, steps, lagged, tmp))
        trainer.run(metrics_cb=lambda _: stamps.append(time.perf_counter()))
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def device_step_s(cls: type, kw: dict, steps: int) -> float:
    """Seconds per step of the compiled step alone, batches on the devices beforehand."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = cls(_config(kw, steps, False, tmp))
        program = trainer.layout.compiled_step(trainer.ctx)
        batches = [trainer.layout.batch_at(trainer.ctx, p) for p in range(steps + 1)]
        params, opt_state = trainer.params, trainer.opt_state
        params, opt_state, *_ = program(params, opt_state, batches[0])  # warm up
        jax.block_until_ready((params, opt_state))
        t0 = time.perf_counter()
        for b in batches[1:]:
            params, opt_state, *_ = program(params, opt_state, b)
        jax.block_until_ready((params, opt_state))
        return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        p.error("--steps must be >= 3 and --rounds >= 1")
    t0 = time.time()
    times = {name: {"device": [], "sync": [], "lagged": []} for name in CASES}
    bar = tqdm(total=len(CASES) * args.rounds * 3, desc="step overhead", unit="run")
    for _ in range(args.rounds):
        for name, (cls, kw) in CASES.items():
            times[name]["device"].append(device_step_s(cls, kw, args.steps))
            bar.update()
            times[name]["sync"].append(loop_step_s(cls, kw, args.steps, lagged=False))
            bar.update()
            times[name]["lagged"].append(loop_step_s(cls, kw, args.steps, lagged=True))
            bar.update()
    bar.close()
    rows = []
    for name, t in times.items():
        dev, sync, lag = (statistics.median(t[k]) for k in ("device", "sync", "lagged"))
        rows.append(
            {
                "case": name,
                "device_ms": 1e3 * dev,
                "sync_ms": 1e3 * sync,
                "lagged_ms": 1e3 * lag,
                "sync_overhead": (sync - dev) / sync,
                "lagged_overhead": (lag - dev) / lag,
                "speedup": sync / lag,
                "rounds": t,
            }
        )
    meta = run_meta(argv, t0, steps=args.steps, rounds=args.rounds, devices=jax.device_count())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_overhead.json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    lines = [
        "# Trainer host overhead per step: synchronous vs lagged",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; JAX {meta['jax']} "
        f"({meta['backend']}, {meta['devices']} devices)",
        f"- {args.steps} steps per run, median of {args.rounds} interleaved rounds",
        "",
        "| case | device loop ms/step | synchronous ms/step | lagged ms/step "
        "| overhead, synchronous | overhead, lagged | synchronous / lagged |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['device_ms']:.2f} | {r['sync_ms']:.2f} | {r['lagged_ms']:.2f} "
            f"| {100 * r['sync_overhead']:.0f}% | {100 * r['lagged_overhead']:.0f}% "
            f"| {r['speedup']:.2f} |"
        )
    lines += [
        "",
        "Device loop: the compiled step called back to back on batches already on the "
        "devices, one wait at the end. Overhead: `(loop - device loop) / loop`, the share "
        "of each step the devices wait for the host (negative values are noise: the two "
        "are separate runs). Loop step times are the spread of the metrics callbacks over "
        "the run, so compilation and the end-of-run files are excluded; checkpoints and "
        "evaluations are off.",
        "",
        "![step times](step_overhead.png)",
        "",
    ]
    (args.out / "step_overhead.md").write_text("\n".join(lines))
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["case"] for r in rows]
    y = range(len(rows))
    for off, key, label in (
        (-0.25, "device_ms", "device loop"),
        (0, "sync_ms", "synchronous"),
        (0.25, "lagged_ms", "lagged"),
    ):
        ax.barh([i + off for i in y], [r[key] for r in rows], height=0.25, label=label)
    ax.set_yticks(list(y), names)
    ax.set_xscale("log")
    ax.set_xlabel("ms per step (log)")
    ax.set_title(f"trainer step time, {meta['backend']}, {meta['devices']} devices", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "step_overhead.png", dpi=120)
    table = lines.index("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(lines[table - 1 : table + 1 + len(rows)]))
    print(f"wrote {args.out}/step_overhead.{{json,md,png}}")


if __name__ == "__main__":
    main()
