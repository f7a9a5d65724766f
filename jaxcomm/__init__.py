"""jaxcomm: communication-efficient distributed training over slow networks, in JAX.

The top level holds what a train step uses: the aggregators (optax transforms that average
gradients across a ``shard_map`` axis, compressed), the wrappers around an optimizer (local
SGD, partial local SGD, DiLoCo), ``worker_grad`` and the wire audit. Everything else lives
in a namespace: :mod:`jaxcomm.codecs`, :mod:`jaxcomm.collectives`, :mod:`jaxcomm.network`,
:mod:`jaxcomm.audit`, :mod:`jaxcomm.pipeline`, :mod:`jaxcomm.compute`,
:mod:`jaxcomm.schedules`, :mod:`jaxcomm.elastic`, :mod:`jaxcomm.adaptive`,
:mod:`jaxcomm.groups` and :mod:`jaxcomm.rng`. Names of earlier releases that moved or were
renamed still work, with a ``DeprecationWarning`` naming the new place (:data:`MOVED`).
"""

import importlib as _importlib
import warnings as _warnings

from jaxcomm import (
    adaptive,
    audit,
    codecs,
    collectives,
    compute,
    elastic,
    groups,
    network,
    pipeline,
    rng,
    schedules,
)
from jaxcomm._src.aggregate import (
    DenseState,
    ScheduledStepState,
    WholeOptimizer,
    dense_all_reduce,
    scheduled_step,
    whole_optimizer,
    worker_state,
)
from jaxcomm._src.audit import (
    UnloggedTrafficError,
    WireAudit,
    check_logged_traffic,
    unlogged_traffic,
    wire_audit,
)
from jaxcomm._src.demo import DeMoState, demo
from jaxcomm._src.diloco import DiLoCoState, diloco
from jaxcomm._src.error_fed import (
    ECQuantizedState,
    ErrorFedState,
    ec_quantized_all_reduce,
    error_fed,
)
from jaxcomm._src.localsgd import LocalSGDState, local_sgd, partial_local_sgd
from jaxcomm._src.marsit import MarsitState, marsit
from jaxcomm._src.powersgd import PowerSGDState, powersgd
from jaxcomm._src.signsgd import (
    CascadingState,
    EFSignState,
    SignMVState,
    SSDMState,
    cascading_sign,
    ef_signsgd,
    signsgd_mv,
    ssdm,
)
from jaxcomm._src.sparse import (
    ChunkTopKState,
    StatQuantizedState,
    TopKState,
    ar_topk,
    chunk_topk,
    lw_topk,
    ms_topk,
    statistical_quantized,
)
from jaxcomm._src.worker import TreeLayout, varying, worker_grad, worker_value_and_grad

__version__ = "0.1.0"

__all__ = [
    # aggregators (each an optax transform over a shard_map axis) and their states
    "dense_all_reduce", "ec_quantized_all_reduce", "ar_topk", "lw_topk", "ms_topk",
    "chunk_topk", "statistical_quantized", "marsit", "signsgd_mv", "ef_signsgd", "ssdm",
    "cascading_sign", "powersgd", "demo", "error_fed", "ErrorFedState", "PowerSGDState",
    "DeMoState", "DenseState", "ECQuantizedState",
    "TopKState", "ChunkTopKState", "StatQuantizedState", "MarsitState", "SignMVState",
    "EFSignState", "SSDMState", "CascadingState", "whole_optimizer", "WholeOptimizer",
    "scheduled_step", "ScheduledStepState",
    # wrappers around an optimizer
    "local_sgd", "partial_local_sgd", "diloco", "LocalSGDState", "DiLoCoState",
    # a worker's own gradient and state inside shard_map
    "worker_grad", "worker_value_and_grad", "worker_state", "varying", "TreeLayout",
    # the wire audit
    "wire_audit", "WireAudit", "check_logged_traffic", "unlogged_traffic",
    "UnloggedTrafficError",
    # namespaces
    "codecs", "collectives", "network", "audit", "pipeline", "compute", "schedules",
    "elastic", "adaptive", "groups", "rng",
]  # fmt: skip

#: Earlier top-level names: ``old -> (namespace, name)``; each still resolves, warning once
#: per use with its new place.
MOVED: dict[str, tuple[str, str]] = {
    "DILOCO_WARMUP_SCOPE": ("jaxcomm.schedules", "DILOCO_WARMUP_SCOPE"),
    "SignReduced": ("jaxcomm.collectives", "SignReduced"),
    "compression_gain": ("jaxcomm.codecs", "compression_gain"),
    "diloco_branches": ("jaxcomm.schedules", "diloco_branches"),
    "sign_all_reduce": ("jaxcomm.collectives", "sign_all_reduce"),
    "sign_merge": ("jaxcomm.collectives", "sign_merge"),
    "stochastic_sign_encode": ("jaxcomm.codecs", "stochastic_sign_encode"),
    "Boundary": ("jaxcomm.pipeline", "Boundary"),
    "BoundaryState": ("jaxcomm.pipeline", "BoundaryState"),
    "BufferRead": ("jaxcomm.pipeline", "BufferRead"),
    "ChunkTopK": ("jaxcomm.codecs", "ChunkTopK"),
    "ChunkTopkState": ("jaxcomm", "ChunkTopKState"),
    "CollectiveOp": ("jaxcomm.audit", "CollectiveOp"),
    "CommLog": ("jaxcomm.network", "CommLog"),
    "ComputeCost": ("jaxcomm.audit", "ComputeCost"),
    "DEVICES": ("jaxcomm.compute", "DEVICES"),
    "DILOCO_SCOPE": ("jaxcomm.schedules", "DILOCO_SCOPE"),
    "Device": ("jaxcomm.compute", "DeviceSpec"),
    "FirstVisit": ("jaxcomm.pipeline", "FirstVisit"),
    "GPipeTimeline": ("jaxcomm.pipeline", "GPipeTimeline"),
    "KINDS": ("jaxcomm.network", "KINDS"),
    "LayerProfile": ("jaxcomm.compute", "LayerProfile"),
    "Layout": ("jaxcomm", "TreeLayout"),
    "MessageBuffer": ("jaxcomm.pipeline", "MessageBuffer"),
    "Network": ("jaxcomm.network", "Network"),
    "NetworkSchedule": ("jaxcomm.network", "NetworkSchedule"),
    "ProgramCost": ("jaxcomm.audit", "ProgramCost"),
    "Quantized": ("jaxcomm.codecs", "Quantized"),
    "RESIZE_RULES": ("jaxcomm.elastic", "RULES"),
    "Resized": ("jaxcomm.elastic", "Resized"),
    "Roofline": ("jaxcomm.compute", "Roofline"),
    "RowCodec": ("jaxcomm.pipeline", "RowCodec"),
    "Schedule": ("jaxcomm.schedules", "Schedule"),
    "SignCode": ("jaxcomm.codecs", "SignCode"),
    "SimClock": ("jaxcomm.network", "SimClock"),
    "StatQuantized": ("jaxcomm.codecs", "StatQuantized"),
    "StepTimeline": ("jaxcomm.schedules", "StepTimeline"),
    "Stragglers": ("jaxcomm.network", "Stragglers"),
    "TICK_SCOPE": ("jaxcomm.pipeline", "TICK_SCOPE"),
    "TopK": ("jaxcomm.codecs", "TopK"),
    "TopkState": ("jaxcomm", "TopKState"),
    "Traffic": ("jaxcomm.audit", "Traffic"),
    "Wire": ("jaxcomm.network", "Wire"),
    "all_gather": ("jaxcomm.collectives", "all_gather"),
    "aqsgd_boundary": ("jaxcomm.pipeline", "aqsgd_boundary"),
    "aqsgd_decode": ("jaxcomm.pipeline", "aqsgd_decode"),
    "aqsgd_encode": ("jaxcomm.pipeline", "aqsgd_encode"),
    "as_bytes": ("jaxcomm.network", "as_bytes"),
    "as_schedule": ("jaxcomm.schedules", "as_schedule"),
    "boundary_message_bytes": ("jaxcomm.pipeline", "boundary_message_bytes"),
    "broadcast": ("jaxcomm.collectives", "broadcast"),
    "brute_force_schedule": ("jaxcomm.schedules", "brute_force_schedule"),
    "choose_collective": ("jaxcomm.network", "choose_collective"),
    "chunk_topk_decode": ("jaxcomm.codecs", "chunk_topk_decode"),
    "chunk_topk_encode": ("jaxcomm.codecs", "chunk_topk_encode"),
    "collective_cost": ("jaxcomm.network", "collective_cost"),
    "collective_time": ("jaxcomm.network", "collective_time"),
    "delta_boundary": ("jaxcomm.pipeline", "delta_boundary"),
    "delta_decode": ("jaxcomm.pipeline", "delta_decode"),
    "delta_encode": ("jaxcomm.pipeline", "delta_encode"),
    "dense_allreduce": ("jaxcomm", "dense_all_reduce"),
    "dequantize": ("jaxcomm.codecs", "dequantize"),
    "diloco_branch": ("jaxcomm.schedules", "diloco_branch"),
    "diloco_steps": ("jaxcomm.schedules", "diloco_steps"),
    "directq_boundary": ("jaxcomm.pipeline", "directq_boundary"),
    "directq_decode": ("jaxcomm.pipeline", "directq_decode"),
    "directq_encode": ("jaxcomm.pipeline", "directq_encode"),
    "dreamddp_schedule": ("jaxcomm.schedules", "dreamddp_schedule"),
    "ec_quantized_allreduce": ("jaxcomm", "ec_quantized_all_reduce"),
    "empty_log": ("jaxcomm.network", "empty_log"),
    "enp_schedule": ("jaxcomm.schedules", "enp_schedule"),
    "find_logs": ("jaxcomm.network", "find_logs"),
    "fp32_boundary": ("jaxcomm.pipeline", "fp32_boundary"),
    "full_sync_schedule": ("jaxcomm.schedules", "full_sync_schedule"),
    "get_device": ("jaxcomm.compute", "get_device"),
    "gpipe": ("jaxcomm.pipeline", "gpipe"),
    "gpipe_timeline": ("jaxcomm.pipeline", "gpipe_timeline"),
    "gpipe_value_and_grad": ("jaxcomm.pipeline", "gpipe_value_and_grad"),
    "grad_wire_bytes": ("jaxcomm.pipeline", "grad_wire_bytes"),
    "hash_bits": ("jaxcomm.rng", "hash_bits"),
    "iteration_time": ("jaxcomm.schedules", "iteration_time"),
    "join_segments": ("jaxcomm.collectives", "join_segments"),
    "log_collective": ("jaxcomm.network", "log_collective"),
    "log_time": ("jaxcomm.network", "log_time"),
    "log_wire": ("jaxcomm.network", "log_wire"),
    "lowrank_rows": ("jaxcomm.pipeline", "lowrank_rows"),
    "merge_logs": ("jaxcomm.network", "merge_logs"),
    "pack_bits": ("jaxcomm.codecs", "pack_bits"),
    "payload_bytes": ("jaxcomm.codecs", "payload_bytes"),
    "payload_is_finite": ("jaxcomm.codecs", "payload_is_finite"),
    "period_timeline": ("jaxcomm.schedules", "period_timeline"),
    "pipeline_ticks": ("jaxcomm.pipeline", "pipeline_ticks"),
    "profile_layers": ("jaxcomm.compute", "profile_layers"),
    "program_cost": ("jaxcomm.audit", "program_cost"),
    "quantize": ("jaxcomm.codecs", "quantize"),
    "quantize_grad": ("jaxcomm.pipeline", "quantize_grad"),
    "quantized_rows": ("jaxcomm.pipeline", "quantized_rows"),
    "register_resize_rule": ("jaxcomm.elastic", "register_resize_rule"),
    "replicated": ("jaxcomm.collectives", "replicated"),
    "resize_rule_of": ("jaxcomm.elastic", "resize_rule_of"),
    "resize_workers": ("jaxcomm.elastic", "resize_workers"),
    "ring_all_gather": ("jaxcomm.collectives", "ring_all_gather"),
    "ring_all_reduce": ("jaxcomm.collectives", "ring_all_reduce"),
    "ring_reduce_scatter": ("jaxcomm.collectives", "ring_reduce_scatter"),
    "roofline": ("jaxcomm.compute", "roofline"),
    "sign_decode": ("jaxcomm.codecs", "sign_decode"),
    "sign_encode": ("jaxcomm.codecs", "sign_encode"),
    "simulate_period": ("jaxcomm.schedules", "simulate_period"),
    "split_segments": ("jaxcomm.collectives", "split_segments"),
    "stat_dequantize": ("jaxcomm.codecs", "stat_dequantize"),
    "stat_quantize": ("jaxcomm.codecs", "stat_quantize"),
    "stochastic_round": ("jaxcomm.rng", "stochastic_round"),
    "streaming_schedule": ("jaxcomm.schedules", "streaming_schedule"),
    "topk_decode": ("jaxcomm.codecs", "topk_decode"),
    "topk_encode": ("jaxcomm.codecs", "topk_encode"),
    "topk_gather": ("jaxcomm.codecs", "topk_gather"),
    "topk_indices": ("jaxcomm.codecs", "topk_indices"),
    "topk_rows": ("jaxcomm.pipeline", "topk_rows"),
    "tree_all_reduce": ("jaxcomm.collectives", "tree_all_reduce"),
    "uniform_seen": ("jaxcomm.pipeline", "uniform_seen"),
    "unpack_bits": ("jaxcomm.codecs", "unpack_bits"),
}


def __getattr__(name: str):
    if name in MOVED:
        module, new = MOVED[name]
        _warnings.warn(
            f"jaxcomm.{name} is now {module}.{new}; the old name goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_importlib.import_module(module), new)
    raise AttributeError(f"module 'jaxcomm' has no attribute {name!r}")
