"""Every figure the project claims for an accelerator, in one command.

On the machine's default JAX backend (a GPU when there is one), in this order:

1. **Codecs** (``benchmarks/codecs.py``): each wire codec's encode+decode time against a
   device copy, and its memory traffic (read ``x``, write and read the payload, write the
   decoded array) per second as a share of the device's HBM bandwidth from
   :data:`jaxcomm.compute.DEVICES` (goal: at least 50%); on a CPU, as a share of the copy's rate.
2. **Top-k selection** (``benchmarks/topk_selection.py``): every selection method against a
   copy, at the sizes given.
3. **Collectives** (``benchmarks/collectives_speed.py``): jaxcomm's ring and tree all-reduce
   against ``psum`` (NCCL on a GPU) from 1 MB to 256 MB per device; skipped, and said so,
   with fewer than 8 devices.
4. **The main job's step**: ``configs/dp_default.yaml`` on this machine's devices (one
   worker per device, up to 8), the measured step time beside the roofline's (the
   ``compute`` device named by ``--device``), and the fitted MFU: the roofline's MFU scaled
   by modelled / measured time (meaningful where the step's flops bound it).
5. **The tests** on this backend: ``pytest`` with ``--pytest-args`` (default ``-m quick``),
   the counts of passed, failed and skipped tests.

Writes ``README.md`` (the summary) and each part's files under ``--out`` (default
``benchmarks/results/gpu``). ``--small`` runs every part at CPU-sized inputs (the test of
this script uses it).

    python benchmarks/gpu.py [--device h100] [--out benchmarks/results/gpu] [--small]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "device_count" not in os.environ.get("XLA_FLAGS", ""):  # 8 CPU devices unless given
    _flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    os.environ["XLA_FLAGS"] = _flags.strip()
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the checkout's train/ and models/

import jax  # noqa: E402
from _meta import run_meta  # noqa: E402

import jaxcomm  # noqa: E402

ROOT = HERE.parent
# Sizes: (codec elements, top-k sizes in millions, collective elements per device).
FULL = (1 << 26, "1,16,64", "262144,1048576,4194304,16777216,67108864")
SMALL = (1 << 18, "0.25", "65536")


def _load(name: str):
    """A sibling benchmark script as a module (``codecs.py`` would shadow the stdlib)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def device_name(requested: str | None) -> str | None:
    """The :data:`jaxcomm.compute.DEVICES` key of this machine's accelerator (``--device`` wins);
    None on a CPU or an accelerator not in the table."""
    if requested:
        jaxcomm.compute.get_device(requested)  # an unknown name is an error that lists the known
        return requested.lower()
    if jax.default_backend() == "cpu":
        return None
    return match_device(jax.devices()[0].device_kind)


def match_device(kind: str) -> str | None:
    """The :data:`jaxcomm.compute.DEVICES` key of a JAX ``device_kind`` (e.g. ``NVIDIA H100 80GB
    HBM3`` -> ``h100``, ``NVIDIA GeForce RTX 2080 Ti`` -> ``rtx2080ti``); None for one not
    in the table. The table's H100 and H200 are SXM parts: a PCIe or NVL card, or a MIG
    slice, has other peaks and bandwidth, so it is not matched (name it with --device)."""
    kind = kind.lower()
    if re.search(r"pcie|nvl|mig", kind):
        return None
    squeezed = re.sub(r"[\s_-]", "", kind)
    for name in jaxcomm.compute.DEVICES:
        if re.search(rf"\b{name}\b", kind) or name in squeezed:
            return name
    return None


def codecs_part(out: Path, size: int, device: str | None) -> list[dict]:
    """Run the codec benchmark; rows ``{codec, time_x_copy, share, share_of}``."""
    _load("codecs").main(["--size", str(size), "--repeats", "5", "--out", str(out)])
    record = json.loads((out / "codecs.json").read_text())
    bandwidth = jaxcomm.compute.get_device(device).memory_bandwidth if device else None
    rows = []
    for r in record["results"]:
        n = r["fp32_bytes"] // 4
        traffic = 8 * n + 2 * r["payload_bytes"]  # bytes an encode+decode must move
        rate = traffic / r["codec_median_s"]
        rows.append(
            {
                "codec": r["name"],
                "time_x_copy": r["time_ratio"],
                "share": rate / bandwidth if bandwidth else r["memory_share"],
                "share_of": f"{device} HBM" if bandwidth else "the copy's rate",
            }
        )
    return rows


def step_part(device: str | None, steps: int) -> dict:
    """The main job on this machine's devices for ``steps`` steps: measured and modelled
    step times (medians after the first two steps) and the fitted MFU."""
    import tempfile

    from train.config import load_config
    from train.trainer import Trainer

    # One worker per device, up to 8, as many as divide the main job's global batch.
    batch = load_config(str(ROOT / "configs" / "dp_default.yaml")).global_batch
    workers = max(w for w in range(1, min(8, jax.device_count()) + 1) if batch % w == 0)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="jaxcomm-gpu-step-") as run_dir:
        overrides = [
            f"workers={workers}",
            f"steps={steps}",
            "checkpoint_every=0",
            "eval_every=0",
            "progress=false",
            f"compute={device or 'v100'}",
            f"out_dir={run_dir}",
        ]
        cfg = load_config(str(ROOT / "configs" / "dp_default.yaml"), overrides)
        Trainer(cfg).run(metrics_cb=rows.append)
    late = rows[2:] or rows
    measured = statistics.median(r["compute_s"] for r in late)
    modelled = statistics.median(r["sim_compute_s"] for r in late)
    assumed = jaxcomm.compute.roofline(device or "v100").mfu
    return {
        "workers": workers,
        "steps": steps,
        "measured_step_s": measured,
        "modelled_step_s": modelled if device else None,
        "assumed_mfu": assumed if device else None,
        "fitted_mfu": assumed * modelled / measured if device else None,
    }


def platform_name() -> str:
    """This backend's name as ``JAX_PLATFORMS`` takes it (``cuda``, not ``gpu``: ``gpu``
    asks for every GPU platform, and one that is not installed is an error)."""
    backend = jax.default_backend()
    if backend == "gpu":
        version = jax.devices()[0].client.platform_version.lower()
        return "rocm" if "rocm" in version else "cuda"
    return backend


def tests_part(pytest_args: str, timeout_s: int = 300) -> dict:
    """``pytest`` on this backend; the counts from its last line."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = platform_name()
    # This process holds the accelerator already: without this, JAX in the tests (and the
    # processes they start) would each try to take 75% of its memory.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args.split()]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"command": " ".join(["pytest", "-q", *pytest_args.split()]), "rc": None,
                "summary": f"stopped after {timeout_s} s (--tests-timeout)"}  # fmt: skip
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", last)}
    return {"command": " ".join(["pytest", "-q", *pytest_args.split()]), "rc": proc.returncode,
            "summary": last.strip("= "), **counts}  # fmt: skip


def render(meta: dict, parts: dict) -> str:
    """The summary page."""
    lines = [
        "# Accelerator figures",
        "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}, backend {meta['backend']}, "
        f"device {meta['device']}, jax {meta['jax']}, {meta['wall_s']:.0f} s).",
        "",
        "## Codecs: encode+decode",
        "",
        "| codec | time x copy | memory traffic share | of |",
        "|---|---|---|---|",
    ]
    for r in parts["codecs"]:
        lines.append(
            f"| {r['codec']} | {r['time_x_copy']:.2f} | {100 * r['share']:.0f}% | {r['share_of']} |"
        )
    lines += ["", "## Top-k selection", "", "See `topk_selection.md` beside this page.", ""]
    lines += ["## Collectives", ""]
    if parts["collectives"] is None:
        lines.append(f"Skipped: {jax.device_count()} device(s); the ring needs 8.")
    else:
        lines.append("| elements/device | psum ms | ring x psum | ring hops x psum | tree x psum |")
        lines.append("|---|---|---|---|---|")
        for r in parts["collectives"]:
            lines.append(
                f"| {r['elements']:,} | {r['psum_ms']:.2f} | {r['ring_over_psum']:.2f} "
                f"| {r['ring_hops_over_psum']:.2f} | {r['tree_over_psum']:.2f} |"
            )
    s = parts["step"]
    lines += ["", "## The main job's step", ""]
    lines.append(
        f"{s['workers']} worker(s), {s['steps']} steps: measured {1e3 * s['measured_step_s']:.2f}"
        " ms a step (median after two)"
    )
    if s["fitted_mfu"] is not None:
        lines.append(
            f"; the roofline models {1e3 * s['modelled_step_s']:.2f} ms at MFU "
            f"{s['assumed_mfu']:.3f}; fitted MFU {s['fitted_mfu']:.3f} (the roofline's MFU "
            "scaled by modelled / measured time: the device's MFU only where the step's flops "
            "bound it, which a model this small may not reach)."
        )
    else:
        lines.append("; no roofline for a CPU (name an accelerator with --device to compare).")
    t = parts["tests"]
    lines += ["", "## Tests on this backend", "", f"`{t['command']}`: {t['summary']}"]
    if meta["backend"] != "cpu":
        lines.append(
            "(with JAX_PLATFORMS set to this backend alone: tests that need 8 devices fail or "
            "skip on fewer)"
        )
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run every part; write the summary and each part's files; returns the record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device", default=None, help="a jaxcomm.compute.DEVICES key (default: detected)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    ap.add_argument("--small", action="store_true", help="CPU-sized inputs")
    ap.add_argument("--steps", type=int, default=30, help="steps of the main job")
    ap.add_argument("--pytest-args", default="-m quick")
    ap.add_argument("--tests-timeout", type=int, default=300, help="seconds for the tests part")
    args = ap.parse_args(argv)
    t0 = time.time()
    device = device_name(args.device)
    size, topk_sizes, coll_sizes = SMALL if args.small else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    parts: dict = {"codecs": codecs_part(args.out, size, device)}
    _load("topk_selection").main(["--sizes", topk_sizes, "--out", str(args.out)])
    parts["collectives"] = None
    if jax.device_count() >= 8:
        coll = _load("collectives_speed").main(["--sizes", coll_sizes, "--out", str(args.out)])
        parts["collectives"] = coll["rows"]
    parts["step"] = step_part(device, args.steps)
    parts["tests"] = tests_part(args.pytest_args, args.tests_timeout)
    meta = run_meta(argv, t0, device=jax.devices()[0].device_kind, devices=jax.device_count())
    record = {"meta": meta, **parts}
    (args.out / "gpu.json").write_text(json.dumps(record, indent=2))
    (args.out / "README.md").write_text(render(meta, parts))
    print(render(meta, parts))
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
