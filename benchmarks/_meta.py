"""Run metadata recorded next to every benchmark result: command, date, machine, JAX.
Importing it also puts the checkout on ``sys.path`` (``import train`` from a benchmark)."""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import jax

# A benchmark runs from a checkout (python benchmarks/<name>.py): its trainer is the
# checkout's train/ and models/, which an install names jaxcomm_train.
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))


def run_meta(argv: list[str] | None, t0: float | None = None, **extra: Any) -> dict[str, Any]:
    """``{command, date, machine, jax, backend[, wall_s], **extra}`` for a script's ``main``.

    ``argv`` is what ``main`` received (``None``: the process's arguments); ``t0`` a
    ``time.time()`` taken at the start, giving ``wall_s`` in seconds.
    """
    meta: dict[str, Any] = {
        "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip()
        + f", {os.cpu_count()} cores",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }
    if t0 is not None:
        meta["wall_s"] = round(time.time() - t0, 1)
    meta.update(extra)
    return meta
