"""Time and size of the jaxcomm wire codecs against a plain device copy, in one run.

For a float32 array of ``--size`` elements drawn from a standard normal distribution (numpy,
seed 0), and for each codec case (stochastic quantization at every width 1-8 with 512-element
buckets, symmetric, and min/max at 2, 4 and 8 bits; nearest rounding at 4 and 8 bits;
signs without and with a scale; SSDM's
stochastic sign; one Marsit merge of sign words, m = 4; top-k at ratios 0.1, 0.01 and 0.001
with ``method="auto"`` (the default), ``"exact"``, ``"approx"`` and ``"threshold"``), this
script measures:

* **time**: ``jax.jit`` of ``x, key -> decode(encode(x, key))`` (signs and top-k ignore the
  key) and of ``encode`` alone, each compiled ahead of time (``.lower().compile()``) and
  called once untimed; then ``--repeats`` rounds, each timing one call of the copy, of
  ``encode`` and of ``encode+decode`` (wall clock around ``jax.block_until_ready``). Each
  figure is the median of its round times. Interleaving puts the copy and the codec under
  the same machine load, so the ratio ``codec median / copy median`` of a case compares like
  with like. A case whose untimed call of ``encode+decode`` takes longer than
  ``--slow-seconds`` is timed with ``min(--repeats, 2)`` rounds; the report says which.
* **copy**: ``jax.jit(jnp.copy)`` without donation. XLA cannot return a non-donated input
  buffer as an output, so it compiles to one HLO ``copy`` instruction that reads and writes
  the whole array (``x + 0.0``, ``x * 1.0`` and the identity compile to the same ``copy`` on
  this JAX version). The script checks that the compiled HLO contains a ``copy`` and that the
  output buffer is not the input buffer, and stops if either fails.
* **bytes**: ``jaxcomm.codecs.payload_bytes`` of the payload, checked against the formula
  (``ceil(n*b/8) + 4*ceil(n/512)`` for quantization, twice the scales for min/max,
  ``ceil(n/8)`` (+4 with a scale) for signs, ``8*k`` with ``k = ceil(ratio*n)`` for top-k);
  a mismatch stops the script.
* **memory share**: the least traffic an encode+decode needs (read ``x``, write and read the
  payload, write the decoded array: ``8n + 2 * payload bytes``) per second, as a share of
  the copy's ``8n`` bytes per second in the same round. On a GPU the copy runs near the
  HBM bandwidth, so this is the codec's fraction of it.
* **error**: relative L2 error ``||x_hat - x|| / ||x||`` of the decoded array, in float64.

Results go to ``--out``: ``codecs.json`` (raw times of every round, machine, command),
``codecs.md`` (table) and ``codecs.png`` (bytes ratio against time ratio). Times are of this
machine's default JAX backend, single process, at the time of the run; nothing here models the
network or other hardware.

    python benchmarks/codecs.py [--size 16777216] [--repeats 5] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from tqdm import tqdm

try:
    import jaxcomm
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import jaxcomm

BUCKET = 512


@dataclasses.dataclass(frozen=True)
class Case:
    """One codec configuration: how to encode, decode, and how many bytes it must send."""

    name: str
    encode: Callable[[jax.Array, jax.Array], Any]
    decode: Callable[[Any], jax.Array]
    expected_bytes: int
    formula: str


@dataclasses.dataclass
class Result:
    """Measurements of one case (times in seconds)."""

    name: str
    payload_bytes: int
    expected_bytes: int
    formula: str
    fp32_bytes: int
    bytes_ratio: float
    bits_per_element: float
    rel_error: float
    repeats: int
    reduced_repeats: bool
    compile_s: dict[str, float]
    first_call_s: float
    copy_s: list[float]
    encode_s: list[float]
    codec_s: list[float]
    copy_median_s: float
    encode_median_s: float
    codec_median_s: float
    time_ratio: float
    encode_time_ratio: float
    memory_share: float


def make_cases(n: int) -> list[Case]:
    """The benchmarked codec configurations for ``n`` elements."""
    cases: list[Case] = []
    for bits in range(1, 9):
        for symmetric in (True, False):
            if not symmetric and bits not in (2, 4, 8):
                continue

            def enc(x: jax.Array, key: jax.Array, bits: int = bits, sym: bool = symmetric) -> Any:
                return jaxcomm.codecs.quantize(
                    x, key, bits=bits, bucket_size=BUCKET, stochastic=True, symmetric=sym
                )

            scales = 1 if symmetric else 2
            cases.append(
                Case(
                    f"quantize {bits}-bit" + ("" if symmetric else " min/max"),
                    enc,
                    jaxcomm.codecs.dequantize,
                    -(-n * bits // 8) + 4 * scales * -(-n // BUCKET),
                    f"ceil(n*{bits}/8) + {4 * scales}*ceil(n/{BUCKET})",
                )
            )
    for bits in (4, 8):  # nearest rounding: ec_quantized's and the message buffer's

        def enc(x: jax.Array, key: jax.Array, bits: int = bits) -> Any:
            del key
            return jaxcomm.codecs.quantize(x, None, bits=bits, bucket_size=BUCKET, stochastic=False)

        cases.append(
            Case(
                f"quantize {bits}-bit nearest",
                enc,
                jaxcomm.codecs.dequantize,
                -(-n * bits // 8) + 4 * -(-n // BUCKET),
                f"ceil(n*{bits}/8) + 4*ceil(n/{BUCKET})",
            )
        )
    for scale in (False, True):

        def enc(x: jax.Array, key: jax.Array, scale: bool = scale) -> Any:
            del key
            return jaxcomm.codecs.sign_encode(x, scale=scale)

        cases.append(
            Case(
                "sign + scale" if scale else "sign",
                enc,
                jaxcomm.codecs.sign_decode,
                -(-n // 8) + (4 if scale else 0),
                "ceil(n/8) + 4" if scale else "ceil(n/8)",
            )
        )
    cases.append(
        Case(
            "stochastic sign (SSDM)",
            jaxcomm.codecs.stochastic_sign_encode,
            jaxcomm.codecs.sign_decode,
            -(-n // 8) + 4,
            "ceil(n/8) + 4",
        )
    )

    def merge(x: jax.Array, key: jax.Array) -> Any:
        # One Marsit hop: this worker's sign bits merged into received bits (the signs of
        # a shifted copy), m = 4 workers; the merged words are what the next hop sends.
        own = jaxcomm.codecs.pack_bits(x > 0)
        received = jaxcomm.codecs.pack_bits(jnp.roll(x, 1) > 0)
        return jaxcomm.codecs.SignCode(
            jaxcomm.collectives.sign_merge(received, own, key, 4), None, tuple(x.shape), "float32"
        )

    cases.append(
        Case("sign merge (Marsit, m=4)", merge, jaxcomm.codecs.sign_decode, -(-n // 8), "ceil(n/8)")
    )
    for ratio in (0.1, 0.01, 0.001):
        k = max(1, math.ceil(ratio * n))
        for method in ("auto", "exact", "approx", "threshold", "sample"):

            def enc(
                x: jax.Array, key: jax.Array, ratio: float = ratio, method: str = method
            ) -> Any:
                del key
                return jaxcomm.codecs.topk_encode(x, ratio=ratio, method=method)

            cases.append(
                Case(
                    f"top-k {ratio:g} {method}",
                    enc,
                    jaxcomm.codecs.topk_decode,
                    8 * k,
                    f"8*k, k=ceil({ratio:g}*n)={k}",
                )
            )
    return cases


def make_copy(x: jax.Array) -> Callable[[jax.Array], jax.Array]:
    """Compiled ``jnp.copy`` of ``x``; stops unless it really copies (see module docstring)."""
    compiled = jax.jit(jnp.copy).lower(x).compile()
    hlo = compiled.as_text()
    if " copy(" not in hlo:
        raise SystemExit(f"copy baseline: compiled HLO has no copy instruction:\n{hlo}")
    out = jax.block_until_ready(compiled(x))
    if out.unsafe_buffer_pointer() == x.unsafe_buffer_pointer():
        raise SystemExit("copy baseline: output aliases the input buffer; no copy happened")
    if not np.array_equal(np.asarray(out), np.asarray(x)):
        raise SystemExit("copy baseline: output differs from input")
    return compiled


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    """Wall-clock seconds of one call, blocking on every output leaf."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0, out


def compile_fn(fn: Callable[..., Any], *args: Any) -> tuple[float, Callable[..., Any]]:
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - t0, compiled


def run_case(
    case: Case,
    x: jax.Array,
    x64: np.ndarray,
    key: jax.Array,
    copy: Callable[[jax.Array], jax.Array],
    repeats: int,
    slow_s: float,
) -> Result:
    n = x.size
    t_enc_c, enc = compile_fn(case.encode, x, key)
    t_full_c, full = compile_fn(lambda x, key: case.decode(case.encode(x, key)), x, key)

    _, payload = timed(enc, x, key)
    nbytes = jaxcomm.codecs.payload_bytes(payload)
    if nbytes != case.expected_bytes:
        raise SystemExit(
            f"{case.name}: payload_bytes = {nbytes}, formula {case.formula} gives "
            f"{case.expected_bytes} for n = {n}"
        )
    del payload
    first_s, x_hat = timed(full, x, key)
    if x_hat.shape != x.shape or x_hat.dtype != x.dtype:
        raise SystemExit(f"{case.name}: decoded {x_hat.shape} {x_hat.dtype}, want {x.shape}")
    diff = np.asarray(x_hat).astype(np.float64) - x64
    rel_error = float(np.linalg.norm(diff) / np.linalg.norm(x64))
    del x_hat, diff

    reduced = first_s > slow_s and repeats > 2
    reps = min(repeats, 2) if reduced else repeats
    copy_s, enc_s, codec_s = [], [], []
    for _ in range(reps):
        copy_s.append(timed(copy, x)[0])
        enc_s.append(timed(enc, x, key)[0])
        codec_s.append(timed(full, x, key)[0])
    copy_m, enc_m, codec_m = (statistics.median(v) for v in (copy_s, enc_s, codec_s))
    return Result(
        name=case.name,
        payload_bytes=nbytes,
        expected_bytes=case.expected_bytes,
        formula=case.formula,
        fp32_bytes=4 * n,
        bytes_ratio=nbytes / (4 * n),
        bits_per_element=8 * nbytes / n,
        rel_error=rel_error,
        repeats=reps,
        reduced_repeats=reduced,
        compile_s={"encode": t_enc_c, "encode+decode": t_full_c},
        first_call_s=first_s,
        copy_s=copy_s,
        encode_s=enc_s,
        codec_s=codec_s,
        copy_median_s=copy_m,
        encode_median_s=enc_m,
        codec_median_s=codec_m,
        time_ratio=codec_m / copy_m,
        encode_time_ratio=enc_m / copy_m,
        memory_share=(8 * n + 2 * nbytes) / (8 * n) * copy_m / codec_m,
    )


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_info() -> dict[str, Any]:
    return {
        "platform.processor": platform.processor(),
        "platform.machine": platform.machine(),
        "platform.platform": platform.platform(),
        "cpu_model": cpu_model(),
        "os.cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
    }


def write_json(path: Path, meta: dict[str, Any], results: list[Result]) -> None:
    doc = {**meta, "results": [dataclasses.asdict(r) for r in results]}
    path.write_text(json.dumps(doc, indent=2) + "\n")


def write_md(path: Path, meta: dict[str, Any], results: list[Result]) -> None:
    m = meta["machine"]
    a = meta["args"]
    load0, load1 = meta["loadavg_start"], meta["loadavg_end"]
    lines = [
        "# jaxcomm codec benchmark",
        "",
        f"- command: `{meta['command']}`",
        f"- date (UTC): {meta['date_utc']}; measured in {meta['wall_s']:.1f} s "
        "(from the start of `main` to the last timing; excludes imports)",
        f"- machine: {m['cpu_model'] or m['platform.processor'] or m['platform.machine']}, "
        f"{m['os.cpu_count']} CPUs (`os.cpu_count()`), {m['platform.platform']}",
        f"- JAX {m['jax']} (jaxlib {m['jaxlib']}), backend `{m['backend']}`, Python {m['python']}",
        f"- load average (1/5/15 min) at start {load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, "
        f"at end {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}",
        f"- input: float32[{a['size']}] standard normal (numpy seed 0); "
        f"fp32 bytes = {4 * a['size']}; PRNG key for quantization: "
        f"`jax.random.key(0, impl={a['key_impl']!r})`",
        "",
        "| codec | payload bytes | bytes ratio vs fp32 | bits/elem | encode ms "
        "| encode+decode ms | copy ms | encode / copy | encode+decode / copy "
        "| memory share | relative error | repeats |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        reps = f"{r.repeats} (reduced)" if r.reduced_repeats else str(r.repeats)
        lines.append(
            f"| {r.name} | {r.payload_bytes:,} | {r.bytes_ratio:.5f} | {r.bits_per_element:.3f} "
            f"| {1e3 * r.encode_median_s:.1f} | {1e3 * r.codec_median_s:.1f} "
            f"| {1e3 * r.copy_median_s:.1f} | {r.encode_time_ratio:.2f} | {r.time_ratio:.2f} "
            f"| {r.memory_share:.2f} | {r.rel_error:.4f} | {reps} |"
        )
    copies = [t for r in results for t in r.copy_s]
    reduced = [r.name for r in results if r.reduced_repeats]
    lines += [
        "",
        "Times are medians over the rounds (`repeats`); each round times one copy, one encode "
        "and one encode+decode call, interleaved, after ahead-of-time compilation and one "
        "untimed call. Ratios divide by the copy median of the same case. The copy is "
        "`jax.jit(jnp.copy)` without donation (checked to compile to an HLO `copy` into a "
        "new buffer). Payload bytes are `jaxcomm.codecs.payload_bytes` and were checked against "
        "the formulas (quantize `ceil(n*b/8) + 4*ceil(n/512)`, twice the scales for min/max, "
        "sign `ceil(n/8)` (+4 with a scale), top-k `8*k`). Relative error is "
        "`||x_hat - x|| / ||x||` in float64. Memory share: `(8n + 2 * payload bytes) / "
        "(encode+decode time)` over `8n / (copy time)`, the codec's least traffic per second "
        "as a share of the copy's.",
        "",
        f"Copy rounds over the whole run: median {1e3 * statistics.median(copies):.1f} ms, "
        f"range {1e3 * min(copies):.1f}-{1e3 * max(copies):.1f} ms ({len(copies)} rounds); "
        "read the ratios with that spread in mind.",
        "",
    ]
    if reduced:
        lines.append(
            f"Timed with fewer rounds (first encode+decode call over {a['slow_seconds']} s): "
            + ", ".join(reduced)
            + "."
        )
    else:
        lines.append(
            f"Every case, top-k exact included, was timed with the full {a['repeats']} rounds "
            f"(no first encode+decode call exceeded {a['slow_seconds']} s)."
        )
    lines += ["", "![bytes ratio against time ratio](codecs.png)", ""]
    path.write_text("\n".join(lines))


def write_png(path: Path, meta: dict[str, Any], results: list[Result]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    bx = [r.bytes_ratio for r in results]
    ax.scatter(bx, [r.time_ratio for r in results], label="encode+decode / copy", zorder=3)
    ax.scatter(
        bx,
        [r.encode_time_ratio for r in results],
        marker="x",
        color="tab:gray",
        label="encode / copy",
        zorder=2,
    )
    # Codecs with (nearly) the same payload size share an x: their labels go right and left
    # of the point. Other labels alternate above and below, in order of x, so neighbours on
    # the log axis do not overlap.
    ordered = sorted(results, key=lambda r: (r.bytes_ratio, r.time_ratio))
    twins = {
        r.name: [q.name for q in ordered if _close(q.bytes_ratio, r.bytes_ratio)] for r in ordered
    }
    alone = [r.name for r in ordered if len(twins[r.name]) == 1]
    for r in results:
        group = twins[r.name]
        if len(group) > 1:
            left = group.index(r.name) % 2 == 1
            offset, ha, va = (-6 if left else 6, 0), "right" if left else "left", "center"
        else:
            below = alone.index(r.name) % 2 == 1
            offset, ha, va = (0, -7 if below else 7), "center", "top" if below else "bottom"
        ax.annotate(
            r.name,
            (r.bytes_ratio, r.time_ratio),
            textcoords="offset points",
            xytext=offset,
            ha=ha,
            va=va,
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(min(bx) / 4, max(bx) * 4)  # room for the labels on both sides
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_xlabel("payload bytes / float32 bytes")
    ax.set_ylabel("codec time / device copy time (same run)")
    m = meta["machine"]
    ax.set_title(
        f"jaxcomm codecs, n={meta['args']['size']:,}, {m['backend']} "
        f"({m['os.cpu_count']} CPUs), JAX {m['jax']}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 0.02 * max(a, b)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=int, default=2**24, help="elements (default 2**24)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per case")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    p.add_argument(
        "--slow-seconds",
        type=float,
        default=5.0,
        help="time a case with min(repeats, 2) rounds when its first call takes longer",
    )
    p.add_argument(
        "--key-impl",
        default="threefry2x32",
        choices=("threefry2x32", "rbg", "unsafe_rbg"),
        help="PRNG implementation of the quantization key (JAX's default: threefry2x32)",
    )
    args = p.parse_args(argv)
    if args.size < 1 or args.repeats < 1:
        p.error("--size and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    date = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()
    command = shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))

    n = args.size
    x64 = np.random.default_rng(0).standard_normal(n)
    x = jax.device_put(x64.astype(np.float32))
    x64 = np.asarray(x).astype(np.float64)  # the float32 values, for the error
    key = jax.random.key(0, impl=args.key_impl)
    copy = make_copy(x)

    results: list[Result] = []
    cases = make_cases(n)
    bar = tqdm(cases, desc="codecs", unit="case")
    for case in bar:
        bar.set_postfix_str(case.name)
        results.append(run_case(case, x, x64, key, copy, args.repeats, args.slow_seconds))

    meta = {
        "command": command,
        "date_utc": date,
        "wall_s": time.perf_counter() - t_start,
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "args": {
            "size": n,
            "repeats": args.repeats,
            "out": str(args.out),
            "slow_seconds": args.slow_seconds,
            "key_impl": args.key_impl,
            "bucket_size": BUCKET,
        },
        "machine": machine_info(),
        "copy_baseline": "jax.jit(jnp.copy), no donation; HLO copy into a new buffer (checked)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "codecs.json", meta, results)
    write_md(args.out / "codecs.md", meta, results)
    write_png(args.out / "codecs.png", meta, results)

    width = max(len(r.name) for r in results)
    print(f"{'codec':<{width}}  bytes ratio  enc/copy  enc+dec/copy  rel err")
    for r in results:
        print(
            f"{r.name:<{width}}  {r.bytes_ratio:11.5f}  {r.encode_time_ratio:8.2f}  "
            f"{r.time_ratio:12.2f}  {r.rel_error:7.4f}"
        )
    print(f"wrote {args.out}/codecs.{{json,md,png}} in {meta['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
