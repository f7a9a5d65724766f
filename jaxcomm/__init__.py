"""jaxcomm: communication-efficient distributed training over slow networks, in JAX."""

from jaxcomm.aggregate import (
    DenseState,
    ECQuantizedState,
    WholeOptimizer,
    dense_allreduce,
    ec_quantized_allreduce,
    whole_optimizer,
    worker_state,
)
from jaxcomm.audit import (
    CollectiveOp,
    ComputeCost,
    ProgramCost,
    Traffic,
    UnloggedTrafficError,
    WireAudit,
    check_logged_traffic,
    program_cost,
    unlogged_traffic,
    wire_audit,
)
from jaxcomm.buffer import BufferRead, MessageBuffer
from jaxcomm.codecs import (
    ChunkTopK,
    Quantized,
    SignCode,
    StatQuantized,
    TopK,
    chunk_topk_decode,
    chunk_topk_encode,
    dequantize,
    pack_bits,
    payload_bytes,
    payload_is_finite,
    quantize,
    sign_decode,
    sign_encode,
    stat_dequantize,
    stat_quantize,
    topk_decode,
    topk_encode,
    topk_gather,
    unpack_bits,
)
from jaxcomm.collectives import (
    all_gather,
    broadcast,
    join_segments,
    replicated,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    split_segments,
    tree_all_reduce,
)
from jaxcomm.compute import DEVICES, Device, Roofline, get_device, roofline
from jaxcomm.elastic import (
    RULES as RESIZE_RULES,
)
from jaxcomm.elastic import (
    Resized,
    register_resize_rule,
    resize_rule_of,
    resize_workers,
)
from jaxcomm.marsit import MarsitState, SignReduced, marsit, sign_all_reduce, sign_merge
from jaxcomm.signsgd import (
    CascadingState,
    EFSignState,
    SignMVState,
    SSDMState,
    cascading_sign,
    ef_signsgd,
    signsgd_mv,
    ssdm,
    stochastic_sign_encode,
)
from jaxcomm.sparse import (
    ChunkTopkState,
    StatQuantizedState,
    TopkState,
    ar_topk,
    chunk_topk,
    compression_gain,
    lw_topk,
    ms_topk,
    statistical_quantized,
    topk_indices,
)

__version__ = "0.1.0"
from jaxcomm.aqsgd import (
    FirstVisit,
    RowCodec,
    aqsgd_decode,
    aqsgd_encode,
    delta_decode,
    delta_encode,
    directq_decode,
    directq_encode,
    grad_wire_bytes,
    lowrank_rows,
    quantize_grad,
    quantized_rows,
    topk_rows,
    uniform_seen,
)
from jaxcomm.diloco import (
    DILOCO_SCOPE,
    DILOCO_WARMUP_SCOPE,
    DiLoCoState,
    diloco,
    diloco_branch,
    diloco_branches,
    diloco_steps,
    streaming_schedule,
)
from jaxcomm.dreamddp import (
    Schedule,
    StepTimeline,
    as_schedule,
    brute_force_schedule,
    dreamddp_schedule,
    enp_schedule,
    full_sync_schedule,
    iteration_time,
    period_timeline,
    simulate_period,
)
from jaxcomm.localsgd import LocalSGDState, local_sgd, partial_local_sgd
from jaxcomm.network import (
    KINDS,
    CommLog,
    Network,
    NetworkSchedule,
    SimClock,
    Stragglers,
    Wire,
    as_bytes,
    choose_collective,
    collective_cost,
    collective_time,
    empty_log,
    find_logs,
    log_collective,
    log_time,
    log_wire,
    merge_logs,
)
from jaxcomm.pipeline import (
    TICK_SCOPE,
    Boundary,
    BoundaryState,
    GPipeTimeline,
    aqsgd_boundary,
    boundary_message_bytes,
    delta_boundary,
    directq_boundary,
    fp32_boundary,
    gpipe,
    gpipe_timeline,
    gpipe_value_and_grad,
    pipeline_ticks,
)
from jaxcomm.profiler import LayerProfile, profile_layers
from jaxcomm.rng import hash_bits, stochastic_round
from jaxcomm.worker import Layout, varying, worker_grad, worker_value_and_grad
