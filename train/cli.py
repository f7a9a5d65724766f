"""Command line: ``python -m train --config configs/dp_default.yaml [--set key=value ...]``."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train", description=__doc__)
    p.add_argument("--config", help="YAML experiment config (default: built-in defaults)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set steps=50 --set model.width=64 (repeatable)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run one training job, print its summary."""
    args = _parser().parse_args(argv)
    from train.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.no_progress:
        cfg = load_config(args.config, [*args.overrides, "progress=false"])
    from train import distributed

    if distributed.requested():
        # One of several processes (train.launch or a cluster's launcher): it owns the
        # devices its environment gives it, and the mesh spans every process's devices.
        try:
            distributed.initialize()
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        # Simulated CPU devices must be requested before JAX initialises its backends.
        flag = f"--xla_force_host_platform_device_count={cfg.workers * cfg.stages}"
        if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
            os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    from train.trainer import Interrupted, RunFolderBusy, Trainer

    try:
        summary = Trainer(cfg).run(resume=args.resume)
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return 128 + e.signum
    except (ValueError, FloatingPointError, FileNotFoundError, RunFolderBusy) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if distributed.is_primary():
        print(_format_summary(summary))
        print(f"metrics, plot and checkpoints in {cfg.run_dir}/")
    return 0


def _format_summary(s: dict) -> str:
    lines = ["", "== summary =="]
    width = max((len(k) for k in s), default=0)
    for key, value in s.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        lines.append(f"{key:>{width}}: {value}")
    return "\n".join(lines) if s else json.dumps(s)
