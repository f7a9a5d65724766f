"""One Marsit all-reduce round vs a dense fp32 ring all-reduce vs ``lax.psum``.

On 8 devices (simulated CPU devices unless a GPU is present), for vectors of 1M..64M float32
elements per device, measures in one run:

- bytes each device sends per round, read from the compiled programs by
  :func:`jaxcomm.wire_audit` (Marsit: packed sign words plus the one-byte non-finite flag of
  every hop message; dense ring: float32 segments), and their ratio (1/32 up to the flag
  bytes and padding);
- median wall time of one round of each, as ratios to ``psum`` of the same array.

    python benchmarks/marsit_allreduce.py [--sizes 1,4,16,64] [--repeats 5]

Writes ``marsit_allreduce.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from _meta import run_meta  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import jaxcomm  # noqa: E402
from jaxcomm._src.marsit import sign_all_reduce  # noqa: E402

N = 8


def _timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(d: int, repeats: int, mesh) -> dict:
    """Times and bytes of the three all-reduces of ``d`` float32 elements per device."""
    x = jax.device_put(
        jax.random.normal(jax.random.key(0, impl="rbg"), (N, d)), NamedSharding(mesh, P("data"))
    )
    key = jax.random.key(1)

    def marsit(v, k):
        return sign_all_reduce(v[0], "data", k).bits[None]

    def ring(v):
        return jaxcomm.collectives.ring_all_reduce(v[0], "data")[None]

    def psum(v):
        return jax.lax.psum(v[0], "data")[None]

    spec = dict(mesh=mesh, out_specs=P("data"))
    f_marsit = jax.jit(jax.shard_map(marsit, in_specs=(P("data"), P()), **spec))
    f_ring = jax.jit(jax.shard_map(ring, in_specs=P("data"), **spec))
    f_psum = jax.jit(jax.shard_map(psum, in_specs=P("data"), **spec))
    t_psum = _timed(f_psum, x, repeats=repeats)
    t_ring = _timed(f_ring, x, repeats=repeats)
    t_marsit = _timed(f_marsit, x, key, repeats=repeats)
    sent = {
        "marsit": int(jaxcomm.wire_audit(f_marsit.lower(x, key)).sent_bytes().max()),
        "ring": int(jaxcomm.wire_audit(f_ring.lower(x)).sent_bytes().max()),
    }
    return {
        "elements": d,
        "marsit_bytes": sent["marsit"],
        "ring_bytes": sent["ring"],
        "bytes_ratio": sent["marsit"] / sent["ring"],
        "psum_ms": 1e3 * t_psum,
        "ring_ms": 1e3 * t_ring,
        "marsit_ms": 1e3 * t_marsit,
        "ring_over_psum": t_ring / t_psum,
        "marsit_over_psum": t_marsit / t_psum,
        "marsit_over_ring": t_marsit / t_ring,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,4,16,64", help="millions of elements per device")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if jax.device_count() < N:
        raise SystemExit(f"needs {N} devices, JAX sees {jax.device_count()}")
    mesh = jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])
    sizes = [int(float(s) * 2**20) for s in args.sizes.split(",")]
    rows = [measure(d, args.repeats, mesh) for d in tqdm(sizes, desc="sizes", unit="size")]
    for r in rows:
        seg = math.ceil(r["elements"] / N)
        # 2 (N - 1) hops of packed sign words plus the one-byte flag; fp32 segments.
        expect = (2 * (N - 1) * (math.ceil(seg / 8) + 1), 2 * (N - 1) * seg * 4)
        if (r["marsit_bytes"], r["ring_bytes"]) != expect:
            raise AssertionError(f"byte counts {r} differ from the formula {expect}")
    meta = run_meta(argv, devices=N)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "marsit_allreduce.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "# One Marsit round vs dense ring all-reduce vs psum",
        "",
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}, backend {meta['backend']} ({N} devices), "
        f"JAX {meta['jax']}, {meta['date']}. Median of {args.repeats} rounds after one warm-up.",
        "",
        "| elements/device | Marsit bytes/device | ring fp32 bytes/device | bytes ratio "
        "| psum ms | ring ms | Marsit ms | ring/psum | Marsit/psum | Marsit/ring |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['elements']:,} | {r['marsit_bytes']:,} | {r['ring_bytes']:,} "
            f"| 1/{1 / r['bytes_ratio']:.2f} | {r['psum_ms']:.1f} | {r['ring_ms']:.1f} "
            f"| {r['marsit_ms']:.1f} | {r['ring_over_psum']:.2f} | {r['marsit_over_psum']:.2f} "
            f"| {r['marsit_over_ring']:.2f} |"
        )
    (out / "marsit_allreduce.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["elements"] for r in rows]
    for key, label in (("psum_ms", "psum"), ("ring_ms", "ring fp32"), ("marsit_ms", "Marsit")):
        ax.plot(xs, [r[key] for r in rows], "o-", label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("elements per device")
    ax.set_ylabel("ms per round (this machine)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "marsit_allreduce.png", dpi=110)
    plt.close(fig)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
