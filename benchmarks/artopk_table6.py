"""The collective chooser against the AR-Topk paper's Table VI.

The paper measures, on 8 inter-node V100s at 1 ms latency and 10, 5 and 1 Gbps, the
communication time of AG top-k, ART-Ring and ART-Tree for ResNet18, ResNet50, AlexNet and
ViT at CR 0.1, 0.01 and 0.001 (gradients fused into 64 MB buckets). This script puts the
alpha-beta model's times (:func:`jaxcomm.network.collective_time`) and the winner that
:func:`jaxcomm.network.choose_collective` picks beside the measured ones, in two settings: the
whole model as one message, and one collective per 64 MB bucket (the paper's bucketing:
every bucket pays the latency terms again). No training runs here; it takes a second.

    python benchmarks/artopk_table6.py

Writes ``table6.md`` and ``table6.json`` under ``--out`` (default
``benchmarks/results/artopk``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from _meta import run_meta

import jaxcomm
from jaxcomm.network import Network

N = 8
BUCKET = 64 * 2**20  # bytes
# Parameters of the models the paper's published code builds (torchvision defaults, 1000
# classes; `flexible_compression/miscellaneous/models.py` in sahiltyagi4/ARTopk builds
# resnet18, resnet50, alexnet and vit_l_16). The paper's text does not name its ViT.
PARAMS = {
    "ResNet18": 11_689_512,
    "ResNet50": 25_557_032,
    "AlexNet": 61_100_840,
    "ViT": 304_326_632,  # vit_l_16
}
KINDS = {"AG": "ag_topk", "ART-Ring": "art_ring", "ART-Tree": "art_tree"}
CHOICE = {"allgather": "AG", "art_ring": "ART-Ring", "art_tree": "ART-Tree"}
# Table VI of the paper: model, Gbps, CR, then communication ms of AG, ART-Ring, ART-Tree
# at 1 ms latency.
_TABLE6 = """
ResNet18 10 0.1 54 35 43.2
ResNet18 10 0.01 7.66 18.1 12.2
ResNet18 10 0.001 3.28 16.7 9
ResNet18 5 0.1 107.76 52.5 76.3
ResNet18 5 0.01 13.83 20.8 16.1
ResNet18 5 0.001 4.25 17.9 10.1
ResNet18 1 0.1 526.3 194.7 345.6
ResNet18 1 0.01 51.93 34.1 41.9
ResNet18 1 0.001 8.86 19.5 12.8
ResNet50 10 0.1 115.1 52.9 83.4
ResNet50 10 0.01 14.35 20.3 15.9
ResNet50 10 0.001 4.65 18.1 10
ResNet50 5 0.1 232 94.7 156.2
ResNet50 5 0.01 28.1 26.1 24.2
ResNet50 5 0.001 5.3 17.8 10.5
ResNet50 1 0.1 1148 405.5 745
ResNet50 1 0.01 126.5 58.8 83.7
ResNet50 1 0.001 14.35 21 16.1
AlexNet 10 0.1 271.8 106.8 180.4
AlexNet 10 0.01 32.73 25.2 25.8
AlexNet 10 0.001 6 18.6 11.1
AlexNet 5 0.1 544.5 200.4 354.8
AlexNet 5 0.01 61.75 34.8 42.6
AlexNet 5 0.001 8.92 19.3 13.1
AlexNet 1 0.1 2718.7 964.4 1778
AlexNet 1 0.01 282.7 111.8 186.8
AlexNet 1 0.001 31.33 27 27.3
ViT 10 0.1 592.77 238.6 401.2
ViT 10 0.01 68.48 36.2 46.2
ViT 10 0.001 9.15 19.2 12.9
ViT 5 0.1 1206 424.3 779.1
ViT 5 0.01 127.45 58 86.2
ViT 5 0.001 15.3 21.4 16.9
ViT 1 0.1 5973 2047 3852
ViT 1 0.01 601.8 222.8 385.2
ViT 1 0.001 59.68 36.7 44.4
"""
PAPER: dict[tuple[str, int], dict[float, tuple[float, float, float]]] = {}
for _line in _TABLE6.strip().splitlines():
    _m, _g, _r, *_t = _line.split()
    PAPER.setdefault((_m, int(_g)), {})[float(_r)] = tuple(float(v) for v in _t)


def model_row(params: int, gbps: float, ratio: float, bucketed: bool) -> dict[str, float]:
    """Modelled ms of each collective, and the chooser's pick, for one Table VI cell."""
    net = Network(1e-3, gbps * 1e9)
    nbytes = 4 * params
    calls = math.ceil(nbytes / BUCKET) if bucketed else 1
    times = {
        name: 1e3 * jaxcomm.network.collective_time(kind, nbytes, N, net, ratio=ratio, calls=calls)
        for name, kind in KINDS.items()
    }
    # Every bucket is its own message of the same size, so the pick is the per-bucket one.
    pick = CHOICE[jaxcomm.network.choose_collective(nbytes / calls, N, ratio, net)]
    assert times[pick] == min(times.values())
    return {**times, "pick": pick, "calls": calls}


def fitted_params(model: str) -> int:
    """The parameter count whose modelled times best fit the paper's row of ``model`` (least
    squares of log times over its 27 cells, on a 0.1% grid)."""
    best, err = 0, math.inf
    for p in (int(1e6 * 1.001**i) for i in range(7000)):
        e = 0.0
        for (m, gbps), cells in PAPER.items():
            if m != model:
                continue
            for ratio, measured in cells.items():
                row = model_row(p, gbps, ratio, False)
                e += sum(math.log(row[k] / t) ** 2 for k, t in zip(KINDS, measured, strict=True))
        if e < err:
            best, err = p, e
    return best


def main(argv: list[str] | None = None) -> dict:
    """Write the comparison; returns the JSON record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/artopk")
    args = ap.parse_args(argv)
    t0 = time.time()
    fits = {m: fitted_params(m) for m in PARAMS}
    rows = []
    for (model, gbps), cells in PAPER.items():
        for ratio, measured in cells.items():
            paper = dict(zip(KINDS, measured, strict=True))
            row = {
                "model": model,
                "params": PARAMS[model],
                "fitted_params": fits[model],
                "fitted": model_row(fits[model], gbps, ratio, False),
                "gbps": gbps,
                "ratio": ratio,
                "paper": paper,
                "paper_pick": min(paper, key=paper.get),
                "fused": model_row(PARAMS[model], gbps, ratio, False),
                "bucketed": model_row(PARAMS[model], gbps, ratio, True),
            }
            rows.append(row)
    agree = {
        s: sum(r[s]["pick"] == r["paper_pick"] for r in rows)
        for s in ("fused", "bucketed", "fitted")
    }
    record = {
        "meta": run_meta(argv, t0),
        "workers": N,
        "rows": rows,
        "agree": agree,
        "fitted_params": fits,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table6.json").write_text(json.dumps(record, indent=2))
    (out / "table6.md").write_text(render(record))
    print(render(record))
    return record


def render(record: dict) -> str:
    """The Markdown table of a :func:`main` record."""
    meta, rows = record["meta"], record["rows"]
    lines = [
        "# Collective chooser vs the AR-Topk paper's Table VI",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}, jax {meta['jax']}).",
        "",
        "Communication ms at 1 ms latency, 8 workers. *paper*: measured on 8 inter-node V100s "
        "(Table VI). *model*: `jaxcomm.network.collective_time` (Eqs. 4a, 4b and the AG cost), the "
        "model as one fused message and, in brackets, as one collective per 64 MB bucket "
        "like the paper's PyTorch bucketing. Parameters are the torchvision models that the "
        "paper's published code builds (sahiltyagi4/ARTopk, "
        "`flexible_compression/miscellaneous/models.py`: ViT = vit_l_16; the paper's text "
        "does not name its ViT). Winner: lowest time; bold where the model's pick differs "
        "from the measured one.",
        "",
        "| model | Gbps | CR | AG paper | AG model | ART-Ring paper | ART-Ring model | "
        "ART-Tree paper | ART-Tree model | winner paper | winner model |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = []
        for name in KINDS:
            fused, bucketed = r["fused"][name], r["bucketed"][name]
            model = (
                f"{fused:.1f}" if r["bucketed"]["calls"] == 1 else f"{fused:.1f} [{bucketed:.1f}]"
            )
            cells += [f"{r['paper'][name]:g}", model]
        pick = r["fused"]["pick"]
        if r["bucketed"]["pick"] != pick:
            pick += f" [{r['bucketed']['pick']}]"
        if r["fused"]["pick"] != r["paper_pick"] or r["bucketed"]["pick"] != r["paper_pick"]:
            pick = f"**{pick}**"
        lines.append(
            f"| {r['model']} | {r['gbps']} | {r['ratio']} | {' | '.join(cells)} | "
            f"{r['paper_pick']} | {pick} |"
        )
    n = len(rows)
    fits = record["fitted_params"]
    misses = [r for r in rows if r["fused"]["pick"] != r["paper_pick"]]
    bucket_misses = [r for r in rows if r["bucketed"]["pick"] != r["paper_pick"]]
    worst = max(
        (abs(r["fused"][k] / r["paper"][k] - 1), r["model"], r["gbps"], r["ratio"], k)
        for r in rows
        if r["model"] != "ViT"
        for k in KINDS
    )
    lines += [
        "",
        f"The model picks the measured winner in {record['agree']['fused']} of {n} cells as "
        f"one fused message and in {record['agree']['bucketed']} of {n} with 64 MB buckets. "
        f"For ResNet18, ResNet50 and AlexNet its times are within {100 * worst[0]:.0f}% of "
        f"the measured ones (the largest gap: {worst[1]} at {worst[2]} Gbps, CR {worst[3]}, "
        f"{worst[4]}).",
        "",
        "Where they disagree, and why:",
        "",
    ]
    for r in misses:
        t = r["fused"]
        lines.append(
            f"- One fused message, {r['model']} {r['gbps']} Gbps CR {r['ratio']}: the paper "
            f"measures {r['paper_pick']} first ({r['paper'][r['paper_pick']]:g} ms vs "
            f"{r['paper'][t['pick']]:g} ms for {t['pick']}); the model puts {t['pick']} at "
            f"{t[t['pick']]:.1f} ms and {r['paper_pick']} at {t[r['paper_pick']]:.1f} ms. "
            "The paper's ViT times are those of a smaller model than vit_l_16: at CR 0.1, "
            "where bandwidth dominates, every measured ViT time is 0.43-0.50 of the model's "
            "for 304M parameters, and the size that fits the whole row best is "
            f"{fits['ViT'] / 1e6:.0f}M parameters. A hypothesis, not a fact we can check: the "
            "runs behind the table used another ViT configuration than the published code."
        )
    cells = ", ".join(f"{r['model']} {r['gbps']} Gbps CR {r['ratio']}" for r in bucket_misses)
    lines += [
        f"- With 64 MB buckets ({len(bucket_misses)} cells: {cells}): each bucket pays the "
        "collective's latency terms again (for ART-Ring `2 (N - 1) + log N` latencies), so "
        "at low CR the model makes ART-Ring and ART-Tree several buckets' latencies slower "
        "and picks AG. The measured times do not show that: ResNet50's ART-Ring at CR 0.001 "
        "takes 17.8-21 ms, one call's 17 latencies plus its bytes, although its 102 MB of "
        "gradients fill two buckets. AR-Topk selects its top-k over the whole fused gradient "
        "(Algorithm 1), so the compressed values cross as one message whatever the dense "
        "bucketing is; the fused setting is the one that matches what runs.",
        "",
        "Parameter counts fitted to the paper's times (least squares, one fused message; a "
        "fit, so agreement with them is expected, not evidence): "
        + ", ".join(f"{m} {fits[m] / 1e6:.1f}M (torchvision {PARAMS[m] / 1e6:.1f}M)" for m in fits)
        + f"; with them the model picks the measured winner in {record['agree']['fitted']} "
        f"of {n} cells.",
    ]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
