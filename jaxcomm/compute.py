"""Compute models: named accelerators, the roofline of a compiled program, per-layer
profiles.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import compute as _compute
from jaxcomm._src import profiler as _profiler
from jaxcomm._src.compute import *  # noqa: F403
from jaxcomm._src.profiler import *  # noqa: F403

__all__ = list(_compute.__all__) + list(_profiler.__all__)
