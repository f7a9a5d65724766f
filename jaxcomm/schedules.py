"""Synchronisation schedules: DreamDDP's and the baselines' layer groups per step, Streaming
DiLoCo's fragments, and the timelines that cost them.

Implementations live in ``jaxcomm._src``; this module is their public face."""

from jaxcomm._src import dreamddp as _dreamddp
from jaxcomm._src.diloco import (
    DILOCO_SCOPE,
    DILOCO_WARMUP_SCOPE,
    diloco_branch,
    diloco_branches,
    diloco_steps,
    streaming_schedule,
)
from jaxcomm._src.dreamddp import *  # noqa: F403
from jaxcomm._src.localsgd import SYNC_SCOPE, layer_names, sync_branch

__all__ = list(_dreamddp.__all__) + [
    "DILOCO_SCOPE",
    "DILOCO_WARMUP_SCOPE",
    "diloco_branches",
    "diloco_branch",
    "diloco_steps",
    "streaming_schedule",
    "SYNC_SCOPE",
    "layer_names",
    "sync_branch",
]
