"""Step time without training: ``python -m train.estimate --config C``.

The step is compiled from abstract shapes (no parameters, optimizer state or message buffers
are allocated), its compute cost read with :func:`jaxcomm.audit.program_cost` and its wire bytes
with :func:`jaxcomm.wire_audit`, and the config's ``compute`` device and ``network`` turn
them into seconds: per device, ``compute = roofline(flops, memory bytes)`` and ``comm =
rounds * latency + path bytes / bandwidth``; the step takes ``compute + comm`` on the slowest
device (``max`` of the two with ``overlap: true``). A pipeline's step follows GPipe's
timeline (:func:`jaxcomm.pipeline.gpipe_timeline`): per microbatch, each stage's forward and
backward
compute (its program's tick ops on the roofline) and each boundary message, with the
bubbles, then the data-parallel collectives; exactly ``compute + comm`` without overlap.
For AQ-SGD the steady state (every sample seen, deltas cross) and the first epoch (float32)
are reported apart. For DiLoCo each kind of step (inner, synchronising, merging) is
estimated apart and laid on DiLoCo's link clock over a period, giving the compute
utilisation and the peak and per-period bytes. For replica groups (``groups`` set) the
group's own step is compiled and each fragment's exchange between the groups (torchft's
quorum round trip and two ring all-gathers of ``groups.count - 1`` blocks) is laid on the
same clock (``groups``: payloads, each exchange's seconds, the compute utilisation).
With ``compute: measured`` (the default) the compute is instead this machine's: each of the
step's compiled programs is run here on zero-filled inputs and timed (so the state is
allocated once, at full size), the rest as above.

    python -m train.estimate --config configs/aqsgd_gpt2xl.yaml --set compute=v100 \\
        --set network=1ms,10Gbps [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from . import RUN


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m train.estimate``."""
    p = argparse.ArgumentParser(prog=f"{RUN}.estimate", description=__doc__)
    p.add_argument("--config", help="YAML experiment config (default: built-in defaults)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set compute=a100:tf32 (repeatable)",
    )
    p.add_argument(
        "--branch",
        dest="branches",
        action="append",
        default=[],
        metavar="NAME=INDEX",
        help="resolve a conditional of the step (by a part of its op name), e.g. Marsit's "
        "rounds: --branch marsit_round=0 (one-bit) or marsit_round=1 (full precision) "
        "(repeatable)",
    )
    p.add_argument("--json", dest="json_path", help="also write the estimate to this file")
    return p


def _mode(
    ctx: Any, key: Any, network: Any, overlap: bool, batch: int, branches: Any = None
) -> dict[str, Any]:
    """The estimate of one compiled step (``key`` picks the boundary mode)."""
    import numpy as np

    from .programs import costed

    costs = {}

    def cost(program):
        if id(program) not in costs:
            cost = costed(program)
            mine = {k: v for k, v in (branches or {}).items() if cost._matches(k)}
            costs[id(program)] = cost.per_device(mine)
        return costs[id(program)]

    flops = ctx.layout.per_device(ctx, key, lambda p: cost(p).flops)
    hbm = ctx.layout.per_device(ctx, key, lambda p: cost(p).hbm_bytes)
    try:
        traffic = ctx.step_audit(key, branches)
    except ValueError as e:
        raise ValueError(f"cannot cost the step's communication: {e}") from e
    measured = None
    if ctx.compute_model is None:
        if branches:
            raise ValueError(
                f"compute=measured runs the step as it is and cannot resolve its branches "
                f"({dict(branches)}; DiLoCo's kinds of step, --branch); name a device, e.g. "
                "--set compute=v100"
            )
        measured = _measured_seconds(ctx, key)
    step_s, compute_s, comm_s = ctx.simulate_step(
        key, traffic, network, 0, overlap=overlap, branches=branches, measured_s=measured
    )
    return {
        "step_s": step_s,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "samples_per_s": batch / step_s,
        "flops_per_device": float(flops.max()),
        "hbm_bytes_per_device": float(hbm.max()),
        "sent_bytes_per_device": int(np.max(traffic.sent)),
        "rounds_per_device": int(np.max(traffic.rounds)),
    }


#: Timed runs of each program with ``compute: measured`` (after one untimed run).
MEASURE_RUNS = 5


def _measured_seconds(ctx: Any, key: Any) -> float:
    """Seconds of one step of program ``key`` on this machine (``compute: measured``):
    each of the step's compiled programs run on zero-filled inputs of its own shapes and
    placement, the median of :data:`MEASURE_RUNS` timed runs after one untimed run, summed
    over the programs. The step's arithmetic does not depend on the values (a dense
    model's), so zeros time it as the data would."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    total = 0.0
    for program, _ in ctx.layout.step_programs(ctx, key):

        def zeros(program=program):
            return jax.tree_util.tree_map(
                lambda info, sharding: jnp.zeros(info.shape, info.dtype, device=sharding),
                program.args_info,
                program.input_shardings,
            )

        times = []
        for _ in range(MEASURE_RUNS + 1):
            args, kwargs = zeros()  # fresh each run: a program may donate its inputs
            jax.block_until_ready((args, kwargs))
            t0 = time.perf_counter()
            jax.block_until_ready(program(*args, **kwargs))
            times.append(time.perf_counter() - t0)
        total += float(np.median(times[1:]))
    return total


def estimate(cfg: Any, branches: dict[str, int] | None = None) -> dict[str, Any]:
    """Estimate one step of ``cfg`` (a :class:`train.config.Config` whose ``compute`` names
    a device). Returns the figures of the steady state at the top level and, for AQ-SGD,
    those of the first epoch under ``first_epoch``. ``branches`` resolves the step's
    conditionals (``{part of op name: branch index}``, see :meth:`jaxcomm.WireAudit.traffic`),
    e.g. Marsit's one-bit (0) or full-precision (1) round."""
    return estimates(cfg, [cfg.network], branches=branches)[0]


def estimates(
    cfg: Any,
    networks: list[str],
    overlaps: list[bool] | None = None,
    branches: dict[str, int] | None = None,
) -> list[dict[str, Any]]:
    """:func:`estimate` of ``cfg`` under each network of ``networks`` (e.g. ``"1ms,1Gbps"``)
    and each overlap setting of ``overlaps`` (default: the config's), compiling the step
    once; network-major order."""
    from jaxcomm._src.network import NetworkSchedule

    from .trainer import Trainer

    t0 = time.perf_counter()
    ctx = Trainer(cfg, abstract=True).ctx
    # Compiled steps: one data-parallel step; a pipeline step per boundary mode (AQ-SGD's
    # deltas once every sample was seen, float32 in the first epoch).
    aqsgd = cfg.stages > 1 and cfg.boundary.key == "aqsgd"
    steady = None if cfg.stages == 1 else aqsgd
    results = []
    for spec, overlap in [(n, o) for n in networks for o in overlaps or [cfg.overlap]]:
        network = NetworkSchedule.parse(spec).at(0)
        out: dict[str, Any] = {
            "config": cfg.name,
            "compute": cfg.compute,
            "mfu": getattr(ctx.compute_model, "mfu", None),  # None: compute measured here
            "memory_efficiency": getattr(ctx.compute_model, "efficiency", None),
            "network": spec,
            "overlap": overlap,
            "devices": int(ctx.mesh.devices.size),
            "global_batch": cfg.global_batch,
        }

        def mode(key: Any, mine: Any, network: Any = network, overlap: bool = overlap) -> dict:
            return _mode(ctx, key, network, overlap, cfg.global_batch, mine)

        # A synchronisation with its own timeline (DiLoCo's link) lays its kinds of step
        # on it, as its part does for the trainer's clock.
        own = ctx.sync.estimate(ctx, mode, branches, network)
        out.update(own if own is not None else mode(steady, branches))
        if branches:
            out["branches"] = dict(branches)
        if aqsgd:
            out["first_epoch"] = mode(False, branches)
        out["step_time"] = _step_time(out, cfg, overlap)
        out["estimate_wall_s"] = time.perf_counter() - t0
        results.append(out)
    return results


def _step_time(est: dict[str, Any], cfg: Any, overlap: bool) -> str:
    """How ``step_s`` is made of ``compute_s`` and ``comm_s``, in words (the timeline the
    layout lays them on)."""
    if cfg.sync is not None and cfg.sync.key == "diloco":
        tau = cfg.sync.overlap
        if cfg.groups is not None:
            return (
                f"the mean step of a period on the link clock of {cfg.groups.count} replica "
                f"groups: a fragment's exchange runs while the next {tau} inner steps "
                "compute, and only a merge waits for it"
            )
        return (
            f"the mean step of a period on DiLoCo's link clock: a synchronisation's transfer "
            f"runs while the next {tau} inner steps compute, and only a merge waits for it"
            if tau
            else "the mean step of a period on DiLoCo's link clock: each synchronising step "
            "waits for its transfer"
        )
    if cfg.stages > 1:
        how = "beside the compute (overlap: true)" if overlap else "between the ticks"
        return (
            f"GPipe's timeline: each stage's compute per microbatch with the pipeline's "
            f"bubbles and its boundary messages {how}, then the data-parallel collectives"
        )
    if overlap:
        return "max(compute, communication): communication overlapped with compute"
    return "compute + communication: no overlap"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def _step_note(est: dict[str, Any]) -> str:
    """One line saying how the step time relates to its compute and communication."""
    step, compute, comm = est["step_s"], est["compute_s"], est["comm_s"]
    if math.isclose(step, compute + comm, rel_tol=1e-9):
        return f"step {_ms(step)} = compute {_ms(compute)} + communication {_ms(comm)}"
    if math.isclose(step, max(compute, comm), rel_tol=1e-9):
        return (
            f"step {_ms(step)} = max(compute {_ms(compute)}, communication {_ms(comm)}): "
            "communication overlapped with compute, not added"
        )
    return (
        f"step {_ms(step)}, not compute {_ms(compute)} + communication {_ms(comm)} = "
        f"{_ms(compute + comm)}: the step is {est['step_time']}"
    )


def _format(est: dict[str, Any]) -> str:
    lines = ["", "== estimate =="]
    flat = {k: v for k, v in est.items() if not isinstance(v, dict) and k != "step_time"}
    for part in ("first_epoch", "diloco", "groups"):
        for k, v in est.get(part, {}).items():
            flat[f"{part}.{k}"] = v
    width = max(len(k) for k in flat)
    for key, value in flat.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, int) and not isinstance(value, bool):
            value = f"{value:,}"
        elif isinstance(value, list):
            value = ", ".join(f"{x:.4g}" if isinstance(x, float) else f"{x:,}" for x in value)
        lines.append(f"{key:>{width}}: {value}")
    lines.append(f"note: {_step_note(est)}")
    if "first_epoch" in est:
        first = {**est["first_epoch"], "step_time": est["step_time"]}
        lines.append(f"note (first epoch): {_step_note(first)}")
    return "\n".join(lines)


def _changes(cfg: Any, other: Any) -> str:
    """The keys ``estimate.baseline`` sets, as ``key=value`` text."""
    return ", ".join(f"{k}={v}" for k, v in cfg.estimate["baseline"].items())


def _compare(rows: list[tuple[str, dict[str, Any]]], base: dict[str, Any] | None) -> str:
    """A table of the config at each network beside the baseline: bytes, step time,
    throughput (and as a multiple of the baseline's)."""
    lines = ["", "== compared =="]
    head = "| config | network | sent bytes/device | first epoch | step s | samples/s |"
    lines += [head + (" x baseline |" if base else ""), "|---" * (6 + bool(base)) + "|"]
    for name, e in rows:
        first = e.get("first_epoch", {}).get("sent_bytes_per_device")
        line = (
            f"| {name} | {e['network']} | {e['sent_bytes_per_device']:,} | "
            f"{'' if first is None else f'{first:,}'} | {e['step_s']:.4g} | "
            f"{e['samples_per_s']:.4g} |"
        )
        if base:
            line += f" {e['samples_per_s'] / base['samples_per_s']:.3f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, estimate one step, print (and optionally write) the figures."""
    args = parser().parse_args(argv)
    from .config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    flag = f"--xla_force_host_platform_device_count={cfg.workers * cfg.stages}"
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    branches = {}
    for item in args.branches:
        name, sep, index = item.partition("=")
        if not sep or not name or not index.strip().isdigit():
            print(f"error: --branch takes NAME=INDEX (an int >= 0), got {item!r}", file=sys.stderr)
            return 2
        branches[name] = int(index)
    timed = " and timing it here (compute: measured)" if cfg.compute == "measured" else ""
    print(
        f"estimating {cfg.name}: compiling one step from shapes{timed} (a large model takes a "
        "minute or more)...",
        file=sys.stderr,
        flush=True,
    )
    try:
        nets = cfg.estimate.get("networks", [])
        own = estimates(cfg, [cfg.network, *nets], branches=branches or None)
        est = own[0]
        baseline = cfg.estimate_baseline()
        if baseline is not None:
            print(f"estimating the baseline {_changes(cfg, baseline)}...", file=sys.stderr)
            base = estimate(baseline, branches or None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(_format(est))
    if nets or baseline is not None:
        rows = [(cfg.name, e) for e in own]
        if baseline is not None:
            rows.append((f"baseline: {_changes(cfg, baseline)}", base))
            est["baseline"] = base
        est["networks"] = own[1:]
        print(_compare(rows, base if baseline is not None else None))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(est, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
