"""Top-k sparsified gradient aggregation: AR-Topk (STAR / VAR) and the all-gather baselines.

From "Flexible Communication for Optimal Distributed Learning over Unpredictable Networks"
(Tyagi and Swany). Every transform here is error-fed: worker ``w`` adds its residual to its
gradient, ``G_w = grad_w + residual_w``, sends some entries of ``G_w`` and keeps the rest as
its next residual, so ``sent + residual == G_w`` exactly, entry by entry.

* :func:`ar_topk`: one worker's top-k indices (the *root*'s) are broadcast and every worker
  all-reduces its own values at those indices (Algorithm 1 of the paper). STAR-Topk takes
  roots round-robin, VAR-Topk the worker whose top-k entries have the largest squared norm.
  The values cross a ring or tree all-reduce, so the message is ``k`` float32 values plus
  one broadcast of ``k`` int32 indices, whatever ``N``.
* :func:`lw_topk` (layer-wise top-k) and :func:`ms_topk` (one threshold over the whole model,
  found by bisection): every worker all-gathers its own values and indices.

The whole gradient pytree is fused into one float32 vector of ``d`` entries; ``k =
ceil(ratio * d)``. The all-gathers use :func:`jaxcomm.collectives.all_gather` (``log2 N``
rounds on a power-of-two axis) and the logs record the paper's kinds (``art_ring``,
``art_tree``, ``ag_topk``) with the dense size ``M = 4 d`` bytes and ratio ``k / d``, so
:func:`jaxcomm.network.collective_time` of the logged kind is the paper's Eqs. (4a), (4b) and its AG
cost for the step that ran.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm._src._checks import axis_size, check_choice, check_float, check_int
from jaxcomm._src.aggregate import worker_state
from jaxcomm._src.codec import ChunkTopKCodec, StatQuantizeCodec
from jaxcomm._src.codecs import (
    AUTO_THRESHOLD_ABOVE,
    SELECTIONS,
    TopK,
    topk_indices,
)
from jaxcomm._src.collectives import (
    all_gather,
    all_gather_wire,
    broadcast,
    broadcast_wire,
    replicated,
    ring_all_reduce,
    ring_all_reduce_wire,
    split_segments,
    tree_all_reduce,
    tree_all_reduce_wire,
)
from jaxcomm._src.error_fed import ErrorFedState, error_fed
from jaxcomm._src.network import (
    CommLog,
    Network,
    choose_collective,
    empty_log,
    log_collective,
    log_wire,
    words_table,
)
from jaxcomm._src.worker import TreeLayout, flatten_grads, init_layout

__all__ = [
    "ROOT_SCOPE",
    "AUTO_THRESHOLD_ABOVE",
    "SELECTIONS",
    "TopKState",
    "ChunkTopKState",
    "StatQuantizedState",
    "statistical_quantized",
    "ar_topk",
    "chunk_topk",
    "compression_gain",
    "lw_topk",
    "ms_topk",
    "topk_indices",
]

# jax.named_scope of AR-Topk's broadcast from a traced root: the `branches=` key that
# resolves its lax.switch in jaxcomm.wire_audit (branch r = root r).
ROOT_SCOPE = "ar_topk_root"


def compression_gain(compressed: Any, error_fed: Any) -> jax.Array:
    """``||compressed||^2 / ||error_fed||^2`` (GraVAC's compression gain), in ``[0, 1]`` for a
    sparsifier: how much of the error-fed gradient a compressor keeps. Pytrees of the same
    structure; 1.0 when ``error_fed`` is zero."""
    num = sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(compressed))
    den = sum(jnp.sum(jnp.square(a.astype(jnp.float32))) for a in jax.tree.leaves(error_fed))
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 1.0)


# --------------------------------------------------------------------------- state


class TopKState(NamedTuple):
    """State of :func:`ar_topk`, :func:`lw_topk` and :func:`ms_topk`, per worker.

    Attributes:
      residual: ``f32[d]`` this worker's error feedback (the entries of ``G`` not sent).
      count: ``int32[]`` steps done (STAR's root at step ``t`` is ``t mod N``).
      root: ``int32[]`` the worker whose indices the last step used; ``-1`` when every
        worker sent its own (all-gather).
      gain: ``f32[]`` compression gain of the last step on this worker,
        ``||G[sent]||^2 / ||G||^2``.
      log: what the last step sent.
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.TreeLayout`).
    """

    residual: jax.Array
    count: jax.Array
    root: jax.Array
    gain: jax.Array
    log: CommLog
    layout: TreeLayout


def _init(who: str, axis_name: Any):
    def init_fn(params):
        layout, d = init_layout(who, params)
        state = TopKState(
            residual=jnp.zeros((d,), jnp.float32),
            count=jnp.zeros((), jnp.int32),
            root=jnp.full((), -1, jnp.int32),
            gain=jnp.ones((), jnp.float32),
            log=empty_log(),
            layout=layout,
        )
        return worker_state(state, axis_name)

    return init_fn


def ratio_k(ratio: float, d: int) -> int:
    """``k = ceil(ratio * d)`` with ``ratio`` read as the decimal it prints as (``0.07 * 100``
    is ``7.000000000000001`` in floating point, whose ceiling would be 8), at most ``d``."""
    return min(d, math.ceil(Fraction(repr(float(ratio))) * d))


def _k(ratio: float, d: int) -> int:
    if d == 0:
        raise ValueError("the gradient has no entries (d = 0): nothing to sparsify")
    if ratio * d < 1.0:
        raise ValueError(
            f"k = ratio * d = {ratio!r} * {d} = {ratio * d:.3g} is less than one entry; ratio "
            f"must be at least 1 / d = {1.0 / d:.3g} for a model of {d} parameters"
        )
    return ratio_k(ratio, d)


def _check_ratio(ratio: Any) -> float:
    return check_float("ratio", ratio, lo=0.0, hi=1.0, lo_open=True)


def _gather_average(g: jax.Array, own: jax.Array, ok: jax.Array, axis_name: Any, n: int):
    """All-gather every worker's ``(G[own], own)`` and average them densely (AG top-k)."""
    vals = jnp.where(ok, g[own], jnp.nan)  # a non-finite G reaches every worker
    gathered = all_gather(TopK(vals, own, g.shape, "float32"), axis_name)

    # One worker's entries at a time, workers in rank order: each scatter has distinct
    # indices, so the sum at an index shared by several workers is added in the same order
    # on every device and the result is bit-identical everywhere by construction (a single
    # scatter-add of all N k entries leaves the order of duplicates to the backend).
    def add(w, total):
        return total.at[gathered.indices[w]].add(gathered.values[w], unique_indices=True)

    total = lax.fori_loop(0, n, add, jnp.zeros_like(g))
    payload = jax.eval_shape(lambda: TopK(vals, own, g.shape, "float32"))
    wire = all_gather_wire(payload, n)
    log = log_collective(
        empty_log(),
        "ag_topk",
        4 * g.shape[0],
        wire.sent[0],
        rounds=wire.rounds,
        path_bytes=wire.path_bytes,
        ratio=own.shape[0] / g.shape[0],
    )
    return total / n, log


def _finish(unflatten, g, sent_idx, mean, state, root, log, axis_name):
    """New state and dense updates: the residual is ``G`` with ``sent_idx`` zeroed."""
    kept = g[sent_idx]
    gain = compression_gain(kept, g)
    new = TopKState(
        residual=g.at[sent_idx].set(0.0),
        count=state.count + 1,
        root=jnp.asarray(root, jnp.int32),
        gain=gain.astype(jnp.float32),
        log=log,
        layout=state.layout,
    )
    # Identical on every worker (the switch over roots types it as varying).
    mean = replicated(mean, axis_name)
    return unflatten(mean), worker_state(new, axis_name)


def _error_fed(who, updates, state, axis_name):
    """``(G, finite, unflatten)``: ``G = grad + residual`` as ``f32[d]``."""
    flat, unflatten = flatten_grads(who, updates, axis_name, state.layout)
    g = flat + state.residual  # f32[d]
    return g, jnp.all(jnp.isfinite(g)), unflatten


# --------------------------------------------------------------------------- AR-Topk


def ar_topk(
    axis_name: Any,
    *,
    ratio: float,
    select: str = "star",
    reduce: str = "ring",
    network: Network | None = None,
    method: str = "auto",
) -> optax.GradientTransformation:
    """AR-Topk: all-reduce-compatible top-k with error feedback (the paper's Algorithm 1).

    Per step, on every worker: ``G = grad + residual``; ``idx_w`` = the ``k = ceil(ratio *
    d)`` largest ``|G|`` entries over the whole fused gradient (not layer by layer). A root
    is chosen: STAR-Topk takes ``step mod N`` (steps counted from 0), VAR-Topk the worker
    with the largest ``||G_w[idx_w]||^2`` (an all-gather of ``N`` float32 scalars; ties to
    the lower rank). The root's indices reach every worker by :func:`jaxcomm.collectives.broadcast`;
    every worker all-reduces ``G[idx]`` (ring or tree) and the updates are the worker
    average scattered at ``idx`` (zero elsewhere, identical on every worker). The new
    residual is ``G`` with ``idx`` zeroed. Inner optimizers chain after it.

    ``reduce="allgather"`` is the flexible scheme's third option: every worker all-gathers
    its own top-k values and indices (``2 k`` words each) and keeps its own unsent entries,
    with no root. ``reduce="auto"`` picks whichever of AG, ART-ring and ART-tree
    :func:`jaxcomm.network.choose_collective` models as cheapest on ``network`` for this model,
    axis size and ratio (at trace time).

    A non-finite ``G`` on any worker makes the values it sends NaN, so every worker's
    update is non-finite.

    Args:
      axis_name: the data-parallel axis.
      ratio: compression ratio ``c`` in ``(0, 1]``; ``k = ceil(c d)`` must be at least 1
        before rounding up (``c >= 1 / d``).
      select: ``"star"`` (round-robin roots) or ``"var"`` (largest norm).
      reduce: ``"ring"``, ``"tree"``, ``"allgather"`` or ``"auto"``.
      network: the link model ``"auto"`` chooses on (required with it).
      method: top-k selection, see :func:`topk_indices`; the default (``"auto"``) is an
        exact selection chosen per platform: the sample selection on the CPU from
        ``AUTO_SAMPLE_FROM`` (32K) entries, ``lax.top_k`` on a CUDA GPU, otherwise a
        threshold search above 2% of entries, else ``lax.top_k``.

    Returns:
      A ``GradientTransformation`` with :class:`TopKState`. Its log holds one ``art_ring``,
      ``art_tree`` or ``ag_topk`` entry (dense size ``4 d`` bytes, ratio ``k / d``), plus
      VAR's ``allgather`` of the norms.

    Example::

        tx = optax.chain(jaxcomm.ar_topk("data", ratio=0.01, select="star"), optax.sgd(0.1))
    """
    ratio = _check_ratio(ratio)
    check_choice("select", select, ("star", "var"))
    check_choice("reduce", reduce, ("ring", "tree", "allgather", "auto"))
    check_choice("method", method, SELECTIONS)
    if network is not None and not isinstance(network, Network):
        raise ValueError(
            "network must be a jaxcomm.network.Network (e.g. Network.parse('1ms,10Gbps')); "
            f"got {network!r}"
        )
    if reduce == "auto" and network is None:
        raise ValueError("reduce='auto' needs network=jaxcomm.network.Network(...) to choose on")

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        g, ok, unflatten = _error_fed("ar_topk", updates, state, axis_name)
        d = g.shape[0]
        k = _k(ratio, d)
        kind = reduce
        if reduce == "auto":
            kind = {"allgather": "allgather", "art_ring": "ring", "art_tree": "tree"}[
                choose_collective(4 * d, n, k / d, network)
            ]
        own = topk_indices(g, k, method=method)
        if kind == "allgather":
            mean, log = _gather_average(g, own, ok, axis_name, n)
            return _finish(unflatten, g, own, mean, state, -1, log, axis_name)

        log = empty_log()
        if select == "star":
            root = state.count % n
        else:
            norm = jnp.where(ok, jnp.sum(jnp.square(g[own])), jnp.nan)
            norms = all_gather(norm, axis_name)  # f32[N]
            root = jnp.argmax(norms).astype(jnp.int32)
            log = log_wire(log, all_gather_wire(norm, n))
        with jax.named_scope(ROOT_SCOPE):
            idx = broadcast(own, root, axis_name)
        vals = jnp.where(ok, g[idx], jnp.nan)
        if kind == "ring":
            summed = ring_all_reduce(vals, axis_name)
            seg = jax.eval_shape(lambda v: split_segments(v, n)[0], vals)
            reduce_wire = ring_all_reduce_wire(seg, n, message_bytes=4 * k)
        else:
            summed = tree_all_reduce(vals, axis_name)
            reduce_wire = tree_all_reduce_wire(vals, n)
        mean = jnp.zeros_like(g).at[idx].set(summed / n)
        # The broadcast's senders depend on the (traced) root: one row per root.
        cast = [broadcast_wire(own, n, r) for r in range(n)]
        rows = [[c + a for c, a in zip(w.sent, reduce_wire.sent, strict=True)] for w in cast]
        sent = words_table([s for row in rows for s in row])
        log = log_collective(
            log,
            "art_ring" if kind == "ring" else "art_tree",
            4 * d,
            sent[root * n + lax.axis_index(axis_name)],
            rounds=cast[0].rounds + reduce_wire.rounds,
            path_bytes=cast[0].path_bytes + reduce_wire.path_bytes,
            ratio=k / d,
        )
        return _finish(unflatten, g, idx, mean, state, root, log, axis_name)

    return optax.GradientTransformation(_init("ar_topk", axis_name), update_fn)


# --------------------------------------------------------------------------- baselines


def lw_topk(axis_name: Any, *, ratio: float) -> optax.GradientTransformation:
    """Layer-wise top-k (LWTopk) with error feedback and an all-gather.

    Each leaf of the gradient pytree (a layer's tensor) keeps its ``ceil(ratio * d_l)``
    largest-magnitude entries of ``G = grad + residual`` (at least one per leaf); every
    worker all-gathers its values and their indices into the fused vector (``int32``) and
    the updates are the average of all workers' sparse vectors. Residual: ``G`` minus what
    this worker sent.

    Args:
      axis_name: data-parallel axis.
      ratio: per-layer compression ratio in ``(0, 1]``.

    Returns:
      A ``GradientTransformation`` with :class:`TopKState` (``root`` is always -1); its
      log holds one ``ag_topk`` entry.
    """
    ratio = _check_ratio(ratio)

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        g, ok, unflatten = _error_fed("lw_topk", updates, state, axis_name)
        parts, start = [], 0
        for leaf in jax.tree.leaves(updates):
            size = math.prod(jnp.shape(leaf))
            if size:
                k = ratio_k(ratio, size)
                parts.append(topk_indices(g[start : start + size], k, method="exact") + start)
            start += size
        if not parts:
            raise ValueError("the gradient has no entries (d = 0): nothing to sparsify")
        own = jnp.concatenate(parts)
        mean, log = _gather_average(g, own, ok, axis_name, n)
        return _finish(unflatten, g, own, mean, state, -1, log, axis_name)

    return optax.GradientTransformation(_init("lw_topk", axis_name), update_fn)


def ms_topk(axis_name: Any, *, ratio: float, rounds: int = 25) -> optax.GradientTransformation:
    """MSTopk: top-k over the whole fused gradient by threshold search, then an all-gather.

    ``k = ceil(ratio * d)`` entries of ``G = grad + residual`` are chosen by ``rounds``
    bisection trials of a magnitude threshold (the paper uses 25 rounds; see
    :func:`topk_indices` with ``method="threshold"`` for what is exact), and every worker
    all-gathers its values and indices. Residual: ``G`` minus what this worker sent.

    Deviation: MSTopk estimates the threshold from random samples of ``G`` and bisects on
    the samples' counts, so about ``k`` entries go out; here each trial counts over all of
    ``G``, so exactly ``k`` go out (a bisection step is one pass over memory either way on
    an accelerator, and the payload size stays static, which a collective needs).

    Args:
      axis_name: data-parallel axis.
      ratio: compression ratio in ``(0, 1]``, at least ``1 / d``.
      rounds: threshold trials, >= 1.

    Returns:
      A ``GradientTransformation`` with :class:`TopKState` (``root`` is always -1); its log
      holds one ``ag_topk`` entry.
    """
    ratio = _check_ratio(ratio)
    rounds = check_int("rounds", rounds, lo=1)

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        g, ok, unflatten = _error_fed("ms_topk", updates, state, axis_name)
        own = topk_indices(g, _k(ratio, g.shape[0]), method="threshold", rounds=rounds)
        mean, log = _gather_average(g, own, ok, axis_name, n)
        return _finish(unflatten, g, own, mean, state, -1, log, axis_name)

    return optax.GradientTransformation(_init("ms_topk", axis_name), update_fn)


# --------------------------------------------------------------------------- chunk-wise


#: The state of :func:`chunk_topk` (:func:`jaxcomm.error_fed`'s).
ChunkTopKState = ErrorFedState


def chunk_topk(
    axis_name: Any,
    *,
    chunk: int = 4096,
    k: int = 64,
    bits: int | None = 2,
    decay: float = 1.0,
    average: str = "workers",
    exchange: str = "gather",
) -> optax.GradientTransformation:
    """Chunk-wise top-k with error feedback and an all-gather (SparseLoCo's compressor).

    Worker ``w`` keeps an error buffer ``e_w`` and, for its gradient ``g_w``, forms
    ``e_w <- decay * e_w + g_w``, sends ``c_w = Q(TopK_chunk(e_w))`` (the ``k``
    largest-magnitude entries of every chunk of ``chunk`` entries, positions packed in
    ``ceil(log2 chunk)`` bits, values in ``bits`` bits on each chunk's max-abs grid, see
    :func:`jaxcomm.codecs.chunk_topk_encode`) and keeps ``e_w <- e_w - c_w``: what was sent
    leaves the buffer exactly as the receivers decode it. Every worker all-gathers the
    ``N`` payloads and sums them in rank order (bit-identical on every worker); the
    updates are that sum divided by

    * ``average="workers"`` (default): ``N``, ``mean_w(c_w)``: SparseLoCo's aggregation as
      its paper writes it, ``Delta = (1 / R) sum_r Delta_hat_r`` over the ``R`` replicas
      (arXiv 2508.15706, the outer step of its Algorithm 1), an entry sent by few workers
      counting for less;
    * ``average="senders"``: at each entry, the number of workers that sent it (entries
      no one sent stay 0): the mean over senders that the authors' code computes
      (``scatter_reduce(..., reduce="mean", include_self=False)`` in the DeMo-derived
      compressors of their CCLoco and templar repositories). Every worker has every
      payload's indices after the all-gather, so it counts the senders itself: the wire
      carries the same bytes as ``"workers"``.

    Chunks run over the whole fused vector (the leaves of the pytree one after another), so
    a chunk may span the end of one tensor and the start of the next under one scale;
    SparseLoCo chunks each tensor apart. A chunk with fewer than ``k`` non-zero entries
    sends some zeros as the smallest 2-bit level (see :func:`jaxcomm.codecs.chunk_topk_encode`).

    SparseLoCo (arXiv 2508.15706) uses it on DiLoCo's pseudo-gradients in place of the
    outer momentum, with ``chunk=4096, k=64, bits=2, decay=0.95`` and an outer SGD step of
    1.0: ``jaxcomm.diloco(inner, axis, period=30, outer=optax.sgd(1.0),
    aggregate=jaxcomm.chunk_topk(axis, decay=0.95))``.

    Args:
      axis_name: data-parallel axis.
      chunk: entries per chunk, ``>= 2`` (the last chunk of the fused gradient is padded).
      k: entries sent per chunk, ``1 <= k <= chunk``.
      bits: value width 1..8, or None for float32 values.
      decay: ``beta`` in ``[0, 1]``, the error buffer's decay (1.0: plain error feedback).
      average: ``"workers"`` or ``"senders"``, the divisor of the summed payloads (above).
      exchange: ``"gather"`` (above, the paper's) or ``"two_phase"`` (each worker averages
        one segment and re-encodes it: see :func:`jaxcomm.error_fed`; not the paper's).

    Returns:
      A ``GradientTransformation`` with :class:`ChunkTopKState` (``error_fed`` of a
      :class:`~jaxcomm.codecs.ChunkTopKCodec`); its log holds one ``allgather`` of the
      packed payload.
    """
    codec = ChunkTopKCodec(chunk, k, bits)
    return error_fed(
        codec, axis_name, exchange=exchange, decay=decay, average=average, name="chunk_topk"
    )


# --------------------------------------------------------------------------- statistical


#: The state of :func:`statistical_quantized` (:func:`jaxcomm.error_fed`'s).
StatQuantizedState = ErrorFedState


def statistical_quantized(
    axis_name: Any,
    *,
    bits: int = 2,
    sigmas: float = 6.0,
    decay: float = 0.9,
    exchange: str = "gather",
) -> optax.GradientTransformation:
    """Error-fed statistical quantization with an all-gather (MuLoCo's compressor).

    Worker ``w`` keeps an error buffer ``e_w`` and, for its gradient ``g_w``, forms
    ``e_w <- decay * e_w + g_w``, sends ``c_w = Q(e_w)`` (:func:`jaxcomm.codecs.stat_quantize`:
    ``bits`` bits per entry, one segment per parameter tensor, each code decoded to the mean
    of the values it stands for) and keeps ``e_w <- e_w - c_w``. Every worker all-gathers the
    ``N`` payloads and averages their decodes in rank order (bit-identical on every worker).
    On the wire: ``ceil(d * bits / 8)`` bytes of codes and ``4 * 2 ** bits`` bytes per
    tensor, from each worker.

    MuLoCo (Therien et al., arXiv 2505.23725) uses it on DiLoCo's pseudo-gradients with a
    Muon inner optimizer at 2 bits: ``jaxcomm.diloco(muon, axis, period=30,
    aggregate=jaxcomm.statistical_quantized(axis))``. As the authors' code, the decay is 0.9
    and the rounding deterministic; their buffer accumulates the pseudo-gradient already
    scaled by the outer learning rate, this one the pseudo-gradient itself (the outer
    optimizer's step follows), which is the same for SGD up to that constant factor on
    ``e``; their per-row variant is not offered.

    Args:
      axis_name: data-parallel axis.
      bits: code width, 1..8 (2: MuLoCo's).
      sigmas: the bins span ``sigmas`` standard deviations of each tensor (6: MuLoCo's).
      decay: ``beta`` in ``[0, 1]``, the error buffer's decay (1.0: plain error feedback).
      exchange: ``"gather"`` (the paper's) or ``"two_phase"``: each worker averages one
        segment of the vector and re-encodes it, with its own error buffer, before an
        all-gather (:func:`jaxcomm.error_fed`), which sends about ``2 / N`` of the gather's
        bytes; statistics then go per segment, not per tensor. Not the paper's.

    Returns:
      A ``GradientTransformation`` with :class:`StatQuantizedState` (``error_fed`` of a
      :class:`~jaxcomm.codecs.StatQuantizeCodec`); its log holds one ``allgather`` of the
      packed payload.
    """
    codec = StatQuantizeCodec(bits, sigmas)
    return error_fed(codec, axis_name, exchange=exchange, decay=decay, name="statistical_quantized")
