"""Sparse against low-rank codes for AQ-SGD's activation deltas, at equal wire bytes.

A pipeline boundary sends, for a sample seen before, the change of its activation
``[T, W]`` since the last visit. This measures, on real deltas of the fine-tuning in
``benchmarks/aqsgd_experiments.py --frontier`` (its pre-trained GPT and its FP32 run's final
model, ``--runs``), the relative error ``||d - code(d)|| / ||d||`` of two codes of the same
size per element:

* chunk-wise top-k (:func:`jaxcomm.pipeline.topk_rows`: ``k`` of every 1,024 entries, 10-bit
  positions, 4-bit values, one float32 scale per chunk), as sent;
* rank ``r`` (the truncated SVD of the ``T x W`` delta, ``r (T + W)`` factor entries at 8
  bits with a float32 scale per factor column): its error is that of the exact truncated
  SVD, the factors' rounding left out (a lower bound, in low rank's favour).

The deltas are those between the two models' activations at each boundary of the 4- and
8-stage pipelines (after layers 2, 4, 6 and 1, 2, ..., 7) for ``--samples`` fine-tuning
samples: the change over a whole fine-tuning, larger than one epoch's, with the same
structure (what changes is the weights along the fine-tuning's direction).

It also measures the backward direction's counterpart, the activation gradient (of the
mean next-token loss) at each boundary: how far it moves over the fine-tuning against its
own norm (what a per-sample gradient memory would have to send), and the share of its norm
beyond rank 1, 2 and 4 (what a low-rank code of the gradient itself leaves out).

    python benchmarks/delta_lowrank.py [--runs benchmarks/results/aqsgd_frontier/runs]

Writes ``lowrank.md`` and ``lowrank.json`` beside ``--runs``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from _meta import run_meta

import jaxcomm
from models.gpt import Block, Embed, GPTConfig, Head
from train.checkpoint import load_model_params

MODEL = {"num_layers": 8, "width": 128, "num_heads": 4, "seq_len": 64}
BUDGETS = (0.14, 0.25, 0.5, 1.0)  # bits per element of the delta
CHUNK, VALUE_BITS, FACTOR_BITS = 1024, 4, 8


def hidden_states(params, cfg: GPTConfig, tokens: np.ndarray) -> list[np.ndarray]:
    """``[layers, B, T, W]``: the activation after each block (what a boundary sends)."""
    h = Embed(cfg).apply({"params": params["embed"]}, jnp.asarray(tokens))
    out = []
    for i in range(cfg.num_layers):
        h = Block(cfg).apply({"params": params[f"block_{i}"]}, h)
        out.append(np.asarray(h))
    return out


def activation_gradients(params, cfg: GPTConfig, tokens: np.ndarray) -> list[np.ndarray]:
    """``[layers - 1, B, T, W]``: the gradient of the mean next-token loss w.r.t. the
    activation after each block but the last (what a boundary sends back)."""
    labels = jnp.asarray(tokens[:, 1:])
    hs = hidden_states(params, cfg, tokens[:, :-1])
    out = []
    for layer in range(cfg.num_layers - 1):

        def rest(h, layer=layer):
            for i in range(layer + 1, cfg.num_layers):
                h = Block(cfg).apply({"params": params[f"block_{i}"]}, h)
            logits = Head(cfg).apply({"params": params["head"]}, h)
            logp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(logp, labels[..., None], -1).mean()

        out.append(np.asarray(jax.grad(rest)(jnp.asarray(hs[layer]))))
    return out


def beyond_rank(m: np.ndarray, r: int) -> float:
    """Mean over samples of the share of ``m[i]``'s norm beyond its best rank-``r`` part."""
    s = np.linalg.svd(m.astype(np.float64), compute_uv=False)
    return float(np.sqrt(np.maximum(0.0, 1.0 - (s[:, :r] ** 2).sum(1) / (s**2).sum(1))).mean())


def topk_k(budget: float) -> int:
    """Entries per chunk that fit ``budget`` bits per element."""
    index_bits = math.ceil(math.log2(CHUNK))
    return max(1, math.floor((budget * CHUNK - 32) / (index_bits + VALUE_BITS)))


def lowrank_r(budget: float, t: int, w: int) -> int:
    """Rank that fits ``budget`` bits per element (0: not even rank 1)."""
    per_rank = (t + w) * FACTOR_BITS + 2 * 32
    return math.floor(budget * t * w / per_rank)


def errors(deltas: np.ndarray, budget: float) -> dict:
    """Mean relative error of each code of ``deltas`` ``[N, T, W]`` at ``budget``."""
    n, t, w = deltas.shape
    k = topk_k(budget)
    codec = jaxcomm.pipeline.topk_rows(CHUNK, k, bits=VALUE_BITS)
    d = jnp.asarray(deltas)
    sent = np.asarray(codec.decode(codec.encode(d, jax.random.key(0))))
    norms = np.linalg.norm(deltas.reshape(n, -1), axis=1)
    topk_err = np.linalg.norm((deltas - sent).reshape(n, -1), axis=1) / norms
    topk_bits = codec.nbytes(deltas.shape) * 8 / deltas.size
    r = lowrank_r(budget, t, w)
    return {
        "budget_bits": budget,
        "topk_k": k,
        "topk_bits": topk_bits,
        "topk_error": float(topk_err.mean()),
        "rank": r,
        "rank_bits": r * ((t + w) * FACTOR_BITS + 64) / (t * w),
        "rank_error": beyond_rank(deltas, r) if r else 1.0,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="benchmarks/results/aqsgd_frontier/runs")
    ap.add_argument("--samples", type=int, default=64)
    args = ap.parse_args(argv)
    t0 = time.time()
    runs = Path(args.runs)
    cfg = GPTConfig(**MODEL)
    from models import build_task
    from train.data import get_dataset

    task = build_task("gpt", **MODEL)
    data = get_dataset("shakespeare", "train", seq_len=cfg.seq_len)
    full = data.get(np.arange(args.samples))["tokens"]  # [N, T + 1]: inputs and labels
    tokens = full[:, :-1]
    template = task.init(jax.random.key(0), {"tokens": jnp.asarray(tokens[:1])})
    before = load_model_params(runs / "pretrain" / "params.msgpack", template)
    after = load_model_params(runs / "FP32_s4_seed0" / "params.msgpack", template)
    h0, h1 = hidden_states(before, cfg, tokens), hidden_states(after, cfg, tokens)
    rows = []
    for layer in range(cfg.num_layers - 1):
        deltas = h1[layer] - h0[layer]
        rel = float(np.linalg.norm(deltas) / np.linalg.norm(h0[layer]))
        for budget in BUDGETS:
            rows.append({"boundary_after_layer": layer + 1, "delta_vs_activation": rel,
                         **errors(deltas, budget)})  # fmt: skip
    g0, g1 = activation_gradients(before, cfg, full), activation_gradients(after, cfg, full)
    grads = []
    for layer in range(cfg.num_layers - 1):
        moved = np.linalg.norm((g1[layer] - g0[layer]).reshape(len(full), -1), axis=1)
        own = np.linalg.norm(g1[layer].reshape(len(full), -1), axis=1)
        grads.append({
            "boundary_after_layer": layer + 1,
            "moved_vs_gradient": float((moved / own).mean()),
            **{f"beyond_rank{r}": beyond_rank(g1[layer], r) for r in (1, 2, 4)},
        })  # fmt: skip
    record = {"meta": run_meta(argv, t0, samples=args.samples), "rows": rows, "gradients": grads}
    out = runs.parent
    (out / "lowrank.json").write_text(json.dumps(record, indent=2))
    (out / "lowrank.md").write_text(render(record))
    print(render(record))
    return record


def render(record: dict) -> str:
    meta, rows = record["meta"], record["rows"]
    lines = [
        "# Sparse against low-rank activation deltas at equal bytes",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}, jax {meta['jax']}); "
        f"{meta['samples']} samples.",
        "",
        "Relative error of each code of the delta (mean over samples), per boundary and "
        "budget in bits per element; rank r's error leaves the factors' 8-bit rounding out. "
        "|delta| / |activation|: how far the activations moved over the fine-tuning.",
        "",
        "| after layer | budget bits/elem | top-k (k/1024) | top-k error | rank | "
        "rank error | |delta| / |activation| |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['boundary_after_layer']} | {r['budget_bits']:g} | {r['topk_k']} "
            f"({r['topk_bits']:.3f} b) | {r['topk_error']:.3f} | {r['rank']} "
            f"({r['rank_bits']:.3f} b) | {r['rank_error']:.3f} | {r['delta_vs_activation']:.3f} |"
        )
    mean = {}
    for r in rows:
        mean.setdefault(r["budget_bits"], []).append((r["topk_error"], r["rank_error"]))
    lines += ["", "Mean over boundaries:", ""]
    for b, v in mean.items():
        tk, rk = np.mean([x[0] for x in v]), np.mean([x[1] for x in v])
        lines.append(f"- {b:g} bits/element: top-k {tk:.3f}, low rank {rk:.3f}")
    lines += [
        "",
        "## The activation gradients",
        "",
        "Per boundary, mean over samples: how far a sample's gradient moved over the "
        "fine-tuning, against its norm at the end; and the share of its norm beyond its "
        "best rank 1, 2 and 4 (exact SVD).",
        "",
        "| after layer | |moved| / |gradient| | beyond rank 1 | beyond rank 2 | beyond rank 4 |",
        "|---|---|---|---|---|",
    ]
    for g in record.get("gradients", []):
        lines.append(
            f"| {g['boundary_after_layer']} | {g['moved_vs_gradient']:.3f} | "
            f"{g['beyond_rank1']:.3f} | {g['beyond_rank2']:.3f} | {g['beyond_rank4']:.3f} |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
