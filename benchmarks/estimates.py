"""Step-time estimates at the papers' model sizes, beside the papers' own figures.

AQ-SGD (GPT2-XL, 8 stages of 6 layers on V100s, micro-batch 1, macro-batch 32): FP32,
DirectQ and AQ-SGD at fw2/bw4, fw3/bw6 and fw4/bw8, at 10 Gbps .. 100 Mbps (1 ms latency),
estimated by ``train.estimate`` (the step compiled from shapes; compute from its flops and
memory bytes on the V100 roofline, communication from its audited wire bytes), each next to
the paper's measured sequences per second (its Table 2, GPT2-1.5B on arXiv).

    python benchmarks/estimates.py        # ~5 min on 2 CPU cores

Writes ``benchmarks/results/estimates/aqsgd.md`` and ``aqsgd.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _meta import run_meta  # noqa: E402

from train.config import load_config  # noqa: E402
from train.estimate import estimates  # noqa: E402

BANDWIDTHS = ("10Gbps", "1Gbps", "500Mbps", "300Mbps", "100Mbps")
SETTINGS = [  # label, boundary, fw_bits, bw_bits
    ("FP32", "fp32", 4, 0),
    ("DirectQ fw2/bw4", "directq", 2, 4),
    ("DirectQ fw3/bw6", "directq", 3, 6),
    ("DirectQ fw4/bw8", "directq", 4, 8),
    ("AQ-SGD fw2/bw4", "aqsgd", 2, 4),
    ("AQ-SGD fw3/bw6", "aqsgd", 3, 6),
    ("AQ-SGD fw4/bw8", "aqsgd", 4, 8),
]
# The AQ-SGD paper's throughput table (GPT2-1.5B on arXiv; sequences / s at 10 Gbps, 1 Gbps,
# 500 Mbps, 300 Mbps, 100 Mbps): FP32, and the range of its four compressed columns (DirectQ
# and AQ-SGD at two bit settings each; the column headers did not survive in the text copy
# of the paper, so no setting is matched to a column here).
PAPER_FP32 = (3.8, 3.2, 2.7, 1.8, 0.5)
PAPER_COMPRESSED = ((4.0, 4.1), (3.9, 4.0), (3.9, 3.9), (3.8, 3.9), (3.0, 3.5))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compute", default="v100", help="device of the roofline")
    p.add_argument("--latency", default="1ms")
    p.add_argument("--out", default="benchmarks/results/estimates")
    args = p.parse_args(argv)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    nets = [f"{args.latency},{b}" for b in BANDWIDTHS]
    rows = []
    for label, boundary, fw, bw in SETTINGS:
        cfg = load_config(
            "configs/aqsgd_gpt2xl.yaml",
            [
                f"compute={args.compute}",
                f"boundary={boundary}",
                f"fw_bits={fw}",
                f"bw_bits={bw}",
            ],
        )
        for est in estimates(cfg, nets):
            rows.append({"method": label, **est})
        print(f"{label}: {[round(r['samples_per_s'], 2) for r in rows[-len(nets) :]]}")
    meta = run_meta(argv, t0, compute=args.compute, latency=args.latency)
    (out / "aqsgd.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    _table(out / "aqsgd.md", rows, meta)
    return 0


def _table(path: Path, rows: list[dict], meta: dict) -> None:
    by = {(r["method"], r["network"].split(",")[1]): r for r in rows}
    lines = [
        "# AQ-SGD at the paper's scale: estimated vs measured sequences / s",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine (compiling only): {meta['machine']}, JAX {meta['jax']}, {meta['date']}; "
        f"wall {meta['wall_s']:.0f} s.  ",
        "Model: `configs/aqsgd_gpt2xl.yaml` (GPT2-XL, 48 layers x 1600, 25 heads, sequence "
        "1024, vocabulary 50,257; 8 stages of 6 layers; 1 replica; 32 microbatches of 1). "
        f"Compute: the {meta['compute']} roofline of each stage's compiled step (FP32 matrix "
        "peak 15.7 TFLOP/s at the calibrated MFU 0.605, memory 900 GB/s at 0.8); "
        f"communication: the step's audited bytes over {meta['latency']} latency and the "
        "bandwidth; no overlap. Steady state (AQ-SGD: every sample seen). Paper: its throughput "
        "table (GPT2-1.5B on arXiv, 8 V100 instances): FP32, and for the compressed methods "
        "the range of its four compressed columns (DirectQ and AQ-SGD at two bit settings; "
        "the headers that say which is which are lost in the text copy of the paper).",
        "",
        "| method | " + " | ".join(f"{b} est. / paper" for b in BANDWIDTHS) + " |",
        "|---|" + "---|" * len(BANDWIDTHS),
    ]
    for label, *_ in SETTINGS:
        cells = []
        for i, b in enumerate(BANDWIDTHS):
            est = by[(label, b)]["samples_per_s"]
            if label == "FP32":
                paper = f"{PAPER_FP32[i]:.1f}"
            else:
                lo, hi = PAPER_COMPRESSED[i]
                paper = f"{lo:.1f}" if lo == hi else f"{lo:.1f}-{hi:.1f}"
            cells.append(f"{est:.2f} / {paper}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per step (steady state): compute and communication seconds at 10 Gbps and 100 Mbps, "
        "bytes the busiest device sends.",
        "",
        "| method | compute s | comm s @10Gbps | comm s @100Mbps | bytes / step |",
        "|---|---|---|---|---|",
    ]
    for label, *_ in SETTINGS:
        hi, lo = by[(label, "10Gbps")], by[(label, "100Mbps")]
        lines.append(
            f"| {label} | {hi['compute_s']:.2f} | {hi['comm_s']:.3f} | {lo['comm_s']:.2f} "
            f"| {hi['sent_bytes_per_device']:,} |"
        )
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
