"""Step times on a real shaped network against the alpha-beta model's prediction.

Builds ``--processes`` namespaced test hosts joined by veth links (``train.netns``; root,
``ip`` and ``tc`` needed), runs one ``python -m train`` process per host (one CPU device each,
gloo collectives over the links), and for each method (data parallel over every host: dense
fp32 ring all-reduce, Marsit, ec_quantized 4-bit, AR-Topk STAR over a ring; and an AQ-SGD
pipeline with one GPT stage per host, 4-bit forward deltas, 8-bit backward) and each link
rate (``--rates``, Mbit/s each way, shaped with ``tc tbf``; ``0`` = unshaped) records:

- **measured**: the median of the run's ``compute_s`` over steps 3 .. ``--steps``: the
  time of the step's programs, their collectives over the links included (the host
  loop's own per-step all-gather of metrics is not part of it);
- **wire**: the busiest device's rounds and critical-path bytes per step, from the run's
  metrics (the audited payload sizes);
- **ping-pong**: per rate, TCP message times between two hosts, giving a latency ``alpha``
  (1-byte message) and a bandwidth (slope over the 1, 4 and 8 MB messages);
- **predicted**: the unshaped run's step minus its own modelled communication (the compute
  and host work), plus ``rounds * alpha + path_bytes * 8 / rate`` with ``rate`` the nominal
  link rate (*nominal*) or the ping-pong bandwidth (*calibrated*); ``alpha`` is the
  ping-pong latency in both.

Latency: the kernel here has no ``netem``, so links add no propagation delay; the measured
alpha is the veth's (tens of microseconds). What a 1 ms or 50 ms link would add is the
model's ``rounds * latency``, which this benchmark cannot check.

    sudo python benchmarks/realnet.py [--processes 4] [--rates 0,100,1000] [--steps 8]

Writes ``table.md``, ``results.json`` and ``ratios.png`` under ``--out``
(default ``benchmarks/results/realnet``).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _meta import run_meta  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from train.launch import free_port, launch  # noqa: E402
from train.netns import NetnsCluster, address, available, ping_pong  # noqa: E402

METHODS = {
    "dense fp32 ring": ["aggregator=ring", "optimizer=adam"],
    "Marsit (1-bit)": [
        "optimizer=none",
        "aggregator={name: marsit, local_lr: 0.1, global_lr: 0.002, full_sync_every: 100000}",
    ],
    "ec_quantized 4-bit": ["aggregator=ec_quantized", "optimizer=adam"],
    "AR-Topk STAR 1% ring": [
        "optimizer=momentum",
        "optimizer.lr=0.05",
        "aggregator={name: ar_topk, ratio: 0.01, select: star, reduce: ring}",
    ],
    # One stage per process: every boundary message crosses a link. 32 training samples
    # and 16 per step: from step 3 every sample has a previous message, so the forward
    # messages are 4-bit deltas (the steady state AQ-SGD runs in).
    "AQ-SGD pipeline (4 stages; fw 4 / bw 8 bits)": [
        "workers=1",
        "stages=4",
        "boundary={name: aqsgd, forward: {name: quantize, bits: 4}, "
        "backward: {name: quantize, bits: 8}}",
        "global_batch=16",
        "microbatches=4",
        "train_samples=32",
    ],
}


def run_method(
    cluster: NetnsCluster, overrides: list[str], steps: int, out: Path, log: Path
) -> list[dict]:
    """One training run, one process per test host; its metrics rows."""
    p = cluster.n
    args = ["--config", "configs/dp_default.yaml", "--no-progress"]
    for s in [
        f"workers={p}",
        f"global_batch={16 * p}",
        *overrides,  # after the defaults, so a method may change them
        f"steps={steps}",
        "compute=measured",
        "checkpoint_every=0",
        "eval_every=0",
        "eval_batches=1",
        f"out_dir={out}",
    ]:
        args += ["--set", s]
    commands = [[*cluster.exec_prefix(i), sys.executable, "-m", "train", *args] for i in range(p)]
    stdout = sys.stdout
    with open(log, "a") as f:
        sys.stdout = f
        try:
            rc = launch(p, args, devices_per_process=1, commands=commands, host=address(0),
                        port=free_port())  # fmt: skip
        finally:
            sys.stdout = stdout
    if rc:
        raise SystemExit(f"run {overrides} failed with exit code {rc}; see {log}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict]) -> dict:
    """Median measured step over steps 3.., and the busiest device's wire figures."""
    steady = rows[2:] if len(rows) > 3 else rows
    wire = steady[-1]["wire"]
    return {
        "measured_s": statistics.median(r["compute_s"] for r in steady),
        "rounds": int(sum(w[4] for w in wire)),
        "path_bytes": int(sum(w[5] for w in wire)),
        "sent_bytes": int(steady[-1]["sent_bytes"]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--rates", default="0,100,1000", help="Mbit/s each way; 0 = unshaped")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/realnet"))
    args = p.parse_args(argv)
    why = available()
    if why:
        raise SystemExit(f"realnet: {why}")
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"--methods: unknown {sorted(unknown)}; choose from {list(METHODS)}")

    # SIGTERM (e.g. a timeout) unwinds like an exception, so the namespaces are torn down.
    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(f"realnet: stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    rates = [float(r) for r in args.rates.split(",")]
    if 0 not in rates:
        rates = [0.0, *rates]  # the unshaped run gives each method's compute
    methods = [m for m in METHODS if m in args.methods.split(",")]
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "runs.log"
    log.write_text("")
    results: dict = {"calibration": {}, "runs": []}
    bar = tqdm(total=len(rates) * (len(methods) + 1), desc="realnet", unit="run")
    with NetnsCluster(args.processes, None) as cluster, tempfile.TemporaryDirectory() as tmp:
        for rate in rates:
            cluster.shape(rate or None)
            results["calibration"][str(rate)] = ping_pong(cluster)
            bar.update()
            for name in methods:
                out = Path(tmp) / f"{name.replace(' ', '_')}_{rate:g}"
                rows = run_method(cluster, METHODS[name], args.steps, out, log)
                results["runs"].append({"method": name, "rate_mbit": rate, **summarize(rows)})
                bar.update()
    bar.close()
    table = build_table(results, methods, [r for r in rates if r])
    meta = run_meta(argv, t0, processes=args.processes, steps=args.steps)
    (args.out / "results.json").write_text(
        json.dumps({**meta, **results, "table": table}, indent=2)
    )
    write_md(args.out / "table.md", meta, results, table)
    write_png(args.out / "ratios.png", table)
    print((args.out / "table.md").read_text())


def build_table(results: dict, methods: list[str], rates: list[float]) -> list[dict]:
    runs = {(r["method"], r["rate_mbit"]): r for r in results["runs"]}
    cal = results["calibration"]
    base_cal = cal["0.0"]
    out = []
    for name in methods:
        base = runs[(name, 0.0)]
        local = base["measured_s"] - (
            base["rounds"] * base_cal["alpha_s"] + base["path_bytes"] * base_cal["beta_s_per_byte"]
        )
        for rate in rates:
            r, c = runs[(name, rate)], cal[str(rate)]
            lat = r["rounds"] * c["alpha_s"]
            nominal = local + lat + r["path_bytes"] * 8 / (rate * 1e6)
            calibrated = local + lat + r["path_bytes"] * c["beta_s_per_byte"]
            out.append(
                {
                    "method": name,
                    "rate_mbit": rate,
                    "sent_bytes": r["sent_bytes"],
                    "rounds": r["rounds"],
                    "path_bytes": r["path_bytes"],
                    "local_s": local,
                    "measured_s": r["measured_s"],
                    "predicted_nominal_s": nominal,
                    "ratio_nominal": r["measured_s"] / nominal,
                    "predicted_calibrated_s": calibrated,
                    "ratio_calibrated": r["measured_s"] / calibrated,
                    # The network's part alone: measured step minus compute + host.
                    "comm_measured_s": r["measured_s"] - local,
                    "comm_predicted_s": calibrated - local,
                }
            )
    return out


def write_md(path: Path, meta: dict, results: dict, table: list[dict]) -> None:
    lines = [
        "# Step time on a real shaped network vs the alpha-beta model",
        "",
        f"- command: `{meta['command']}` (as root)",
        f"- date: {meta['date']}; machine: {meta['machine']}; JAX {meta['jax']}",
        f"- {meta['processes']} processes, one per network namespace, one CPU device each; "
        "links shaped with `tc tbf` each way; no added latency (no `netem` in this kernel)",
        f"- model: the README's GPT (867K parameters), {meta['steps']} steps per run, "
        "median of steps 3 onwards; links carry MTU-sized packets (GSO off) through a "
        "token bucket of max(2 frames, 0.25 ms at the rate)",
        "",
        "Ping-pong calibration (host 0 to host 1, TCP, median of 5):",
        "",
        "| link | alpha (1-byte message, round trip) | bandwidth (slope over 1, 4, 8 MB) |",
        "| --- | ---: | ---: |",
    ]
    for rate, c in results["calibration"].items():
        link = "unshaped" if float(rate) == 0 else f"{float(rate):g} Mbit/s"
        lines.append(
            f"| {link} | {1e6 * c['alpha_s']:.0f} us | {c['bandwidth_bps'] / 1e6:.0f} Mbit/s |"
        )
    lines += [
        "",
        "| method | link | bytes sent / step | rounds | critical-path bytes | compute + host (s) "
        "| measured step (s) | predicted, nominal rate (s) | measured / predicted "
        "| predicted, calibrated (s) | measured / calibrated | network part: measured / "
        "predicted (s) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in table:
        lines.append(
            f"| {t['method']} | {t['rate_mbit']:g} Mbit/s | {t['sent_bytes']:,} | {t['rounds']} "
            f"| {t['path_bytes']:,} | {t['local_s']:.3f} | {t['measured_s']:.3f} "
            f"| {t['predicted_nominal_s']:.3f} | {t['ratio_nominal']:.2f} "
            f"| {t['predicted_calibrated_s']:.3f} | {t['ratio_calibrated']:.2f} "
            f"| {t['comm_measured_s']:.3f} / {t['comm_predicted_s']:.3f} |"
        )
    lines += [
        "",
        "Compute + host: the unshaped run's measured step minus its modelled communication at "
        "the unshaped ping-pong figures. Predicted: that plus `rounds * alpha + "
        "critical-path bytes / rate`, with the nominal rate or the ping-pong bandwidth. "
        "Network part: the measured step minus compute + host, beside the calibrated "
        "prediction's communication; where it is small against the compute, the step's "
        "run-to-run noise (a few ms) is of its size.",
        "",
        "![measured / predicted](ratios.png)",
        "",
    ]
    path.write_text("\n".join(lines))


def write_png(path: Path, table: list[dict]) -> None:
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{t['method']}\n{t['rate_mbit']:g} Mbit/s" for t in table]
    x = range(len(table))
    ax.bar([i - 0.2 for i in x], [t["ratio_nominal"] for t in table], 0.4, label="nominal rate")
    ax.bar([i + 0.2 for i in x], [t["ratio_calibrated"] for t in table], 0.4, label="calibrated")
    ax.axhline(1.0, color="k", lw=0.8)
    for y in (0.75, 1.25):
        ax.axhline(y, color="k", lw=0.6, ls=":")
    ax.set_xticks(list(x), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("measured / predicted step time")
    ax.set_title("real shaped network vs alpha-beta model", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
