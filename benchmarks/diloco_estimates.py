"""DiLoCo at paper scale, by estimate: compute utilisation and bandwidth of an
INTELLECT-1-like run (``configs/diloco_intellect1.yaml``) beside data parallelism.

Each setting's step is compiled from shapes and costed by ``train.estimate`` (H100 tf32
roofline, the alpha-beta network): every kind of step apart, then DiLoCo's link clock over
a period (an overlapped fragment's transfer hides behind the next inner steps). Settings:

- DP: the gradients averaged by a float32 ring all-reduce every step (``aggregator:
  ring``, no sync);
- DiLoCo H = 100, int8 (INTELLECT-1's);
- Streaming DiLoCo H = 100, 4 strided fragments, overlap tau = 5, 4-bit.

Networks (the node's WAN link): 100 ms / 1 Gbps (intercontinental) and 20 ms / 10 Gbps
(one continent). INTELLECT-1 reports 83-96% compute utilisation; Streaming DiLoCo about
400x less peak bandwidth than data parallelism.

    python benchmarks/diloco_estimates.py     # ~10 min on 2 CPU cores (three compiles)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=14")

from _meta import run_meta  # noqa: E402

from train.config import load_config  # noqa: E402
from train.estimate import estimates  # noqa: E402

NETWORKS = {"intercontinental": "100ms,1Gbps", "one continent": "20ms,10Gbps"}
SETTINGS = {
    "DP (fp32 ring every step)": ["aggregator=ring", "sync={}", "optimizer.name=adamw"],
    "DiLoCo H=100 int8": [],
    "Streaming DiLoCo H=100 F=4 tau=5 int4": [
        "sync={method: diloco, period: 100, fragments: 4, overlap: 5, compress: int4}"
    ],
}


def main(argv: list[str] | None = None) -> int:
    """Estimate every setting on every network; write ``estimates.md`` and ``.json``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    ap.add_argument("--out", default="benchmarks/results/diloco")
    ap.add_argument("--config", default="configs/diloco_intellect1.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    if args.render:
        record = json.loads((Path(args.out) / "estimates.json").read_text())
        (Path(args.out) / "estimates.md").write_text(render(record))
        return 0
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, sets in SETTINGS.items():
        cfg = load_config(args.config, [*args.overrides, *sets])
        rows = estimates(cfg, list(NETWORKS.values()))
        results[name] = dict(zip(NETWORKS, rows, strict=True))
        print(name, {n: round(r["step_s"], 3) for n, r in results[name].items()}, flush=True)
    record = {"meta": run_meta(argv, t0), "networks": NETWORKS, "results": results}
    (out / "estimates.json").write_text(json.dumps(record, indent=2))
    (out / "estimates.md").write_text(render(record))
    print(render(record))
    return 0


def render(record: dict) -> str:
    """The markdown table of a record."""
    meta, res = record["meta"], record["results"]
    dp = res["DP (fp32 ring every step)"]
    lines = [
        "# DiLoCo at paper scale (estimates)",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}, jax {meta['jax']}, "
        f"{meta.get('wall_s', 0) / 60:.0f} min).",
        "",
        "9.5B-parameter GPT (42 layers, width 4096, sequence 8192), 14 nodes of 8 H100s, "
        "one simulated device per node: it computes one GPU's 8 sequences, and its ring "
        "all-reduce of the whole pseudo-gradient over the node's link stands for the "
        "node's 8 GPUs each sending 1/8 of it on 1/8 of the link (same time), so bytes are "
        "per node. H100 tf32 roofline (the models compute in float32); intra-node traffic "
        "not modelled. Utilisation: inner compute over wall time, steady state of a period.",
        "",
        "| setting | network | step (s, mean) | compute utilisation | peak bytes / step "
        "/ node | bytes / 100 steps / node | peak vs DP | bytes vs DP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, per in res.items():
        for net, r in per.items():
            d = r.get("diloco")
            util = d["compute_utilisation"] if d else r["compute_s"] / r["step_s"]
            peak = d["peak_sent_bytes_per_device"] if d else r["sent_bytes_per_device"]
            period = d["sent_bytes_per_period"] if d else 100 * r["sent_bytes_per_device"]
            base = dp[net]["sent_bytes_per_device"]
            lines.append(
                f"| {name} | {record['networks'][net]} | {r['step_s']:.2f} | {100 * util:.1f}% "
                f"| {peak / 1e9:.3f} GB | {period / 1e9:.2f} GB | {base / peak:,.0f}x | "
                f"{100 * base / period:,.0f}x |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
