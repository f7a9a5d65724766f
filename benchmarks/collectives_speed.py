"""jaxcomm's ring and tree all-reduce against XLA's own all-reduce (``lax.psum``).

On 8 devices (simulated CPU devices unless an accelerator is present), for float32 vectors
of ``--sizes`` elements per device, times one all-reduce of each kind inside ``shard_map``:
``psum`` (XLA's collective; NCCL on a GPU), ``jaxcomm.collectives.ring_all_reduce`` (XLA's reduce-
scatter and all-gather of ``1/N`` segments), the same ring hop by hop (``hops=True``: ``2 (N
- 1)`` ``ppermute`` hops of ``1/N`` of the vector) and
``jaxcomm.collectives.tree_all_reduce`` (binomial
reduce and broadcast of the whole vector), and one hop of the ring alone (a ``ppermute`` of
``1/N`` of the vector: what one of the ring's ``2 (N - 1)`` hops costs on its own, dispatch
included). Each program is compiled ahead of time and called once untimed; then
``--repeats`` interleaved rounds time one call of each (wall clock around
``block_until_ready``), and each figure is the median of its rounds, as a ratio to ``psum``
in the same round. Every result is checked against ``psum``'s, and the bytes each device
sends are read from the compiled programs (:func:`jaxcomm.wire_audit`).

    python benchmarks/collectives_speed.py [--sizes 65536,262144,1048576,4194304] [--repeats 7]

Writes ``collectives.md`` / ``.json`` / ``.png`` under ``--out`` (default
``benchmarks/results/collectives``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _meta import run_meta  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import jaxcomm  # noqa: E402

N = 8
KINDS = {
    "psum": lambda v: jax.lax.psum(v, "data"),
    "ring": lambda v: jaxcomm.collectives.ring_all_reduce(v, "data"),
    "ring_hops": lambda v: jaxcomm.collectives.ring_all_reduce(v, "data", hops=True),
    "tree": lambda v: jaxcomm.collectives.tree_all_reduce(v, "data"),
}


def programs(d: int, mesh) -> tuple[jax.Array, dict]:
    """The input ``f32[N, d]`` (row ``w`` on device ``w``) and each kind compiled for it."""
    x = np.random.default_rng(0).standard_normal((N, d), dtype=np.float32)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    progs = {}
    for name, fn in KINDS.items():
        f = jax.shard_map(
            lambda v, fn=fn: fn(v[0])[None], mesh=mesh, in_specs=P("data"), out_specs=P("data")
        )
        progs[name] = jax.jit(f).lower(x).compile()
    # One hop of the ring alone: a ppermute of one segment (d / N elements) to the right.
    seg = -(-d // N)
    perm = [(j, (j + 1) % N) for j in range(N)]
    hop = jax.shard_map(
        lambda v: jax.lax.ppermute(v[:, :seg], "data", perm),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    progs["hop"] = jax.jit(hop).lower(x).compile()
    return x, progs


def measure(d: int, repeats: int, mesh) -> dict:
    """``{elements, bytes, <kind>_ms, <kind>_sent, <kind>_over_psum}`` for ``d`` per device."""
    x, progs = programs(d, mesh)
    want = np.asarray(progs["psum"](x))
    for name in KINDS:
        got = np.asarray(progs[name](x))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=name)
    times: dict[str, list[float]] = {name: [] for name in progs}
    for _ in range(repeats):
        for name, p in progs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(p(x))
            times[name].append(time.perf_counter() - t0)
    row: dict = {"elements": d, "bytes": 4 * d}
    for name, p in progs.items():
        row[f"{name}_ms"] = 1e3 * statistics.median(times[name])
        row[f"{name}_sent"] = int(jaxcomm.wire_audit(p).sent_bytes().max())
    for name in KINDS:
        ratios = [a / b for a, b in zip(times[name], times["psum"], strict=True)]
        row[f"{name}_over_psum"] = statistics.median(ratios)
    return row


def render(record: dict) -> str:
    """Markdown table of times and ratios to ``psum``."""
    meta, rows = record["meta"], record["rows"]
    lines = [
        "# Ring and tree all-reduce against psum",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}, backend {meta['backend']}, "
        f"{N} devices, jax {meta['jax']}).",
        "",
        "Median of interleaved rounds; `x psum` is the median of each round's ratio to psum. "
        "Bytes: the most any device sends, read from the compiled program.",
        "",
        "| elements/device | psum ms | ring ms | ring x psum | ring hops ms "
        "| ring hops x psum | tree ms | tree x psum | one ring hop ms | ring bytes sent "
        "| ring hops bytes sent | tree bytes sent |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['elements']:,} | {r['psum_ms']:.2f} | {r['ring_ms']:.2f} "
            f"| {r['ring_over_psum']:.2f} | {r['ring_hops_ms']:.2f} "
            f"| {r['ring_hops_over_psum']:.2f} | {r['tree_ms']:.2f} | {r['tree_over_psum']:.2f} "
            f"| {r['hop_ms']:.3f} | {r['ring_sent']:,} | {r['ring_hops_sent']:,} "
            f"| {r['tree_sent']:,} |"
        )
    lines.append("")
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    """Time against size, one line per kind."""
    rows = record["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["elements"] for r in rows]
    for name in KINDS:
        ax.plot(xs, [r[f"{name}_ms"] for r in rows], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("float32 elements per device")
    ax.set_ylabel("ms per all-reduce")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    """Measure, write the record, table and plot; returns the record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="65536,262144,1048576,4194304")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results/collectives")
    args = ap.parse_args(argv)
    if jax.device_count() < N:
        raise SystemExit(f"needs {N} devices, JAX sees {jax.device_count()}")
    t0 = time.time()
    mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = [measure(d, args.repeats, mesh) for d in tqdm(sizes, desc="sizes")]
    record = {"meta": run_meta(argv, t0, device=str(jax.devices()[0])), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "collectives.json").write_text(json.dumps(record, indent=2))
    (out / "collectives.md").write_text(render(record))
    plot(record, out / "collectives.png")
    print(render(record))
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
