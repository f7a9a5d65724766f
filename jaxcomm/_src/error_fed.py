"""Any codec as an error-fed gradient aggregator: :func:`error_fed`.

Worker ``w`` keeps an error buffer ``e_w``; for its gradient ``g_w`` it forms
``e_w <- decay * e_w + g_w``, sends ``c_w = C(e_w)`` for a codec ``C`` and keeps
``e_w <- e_w - decode(c_w)``, so what was not sent (a biased codec's dropped part, a
quantizer's rounding) is sent later. Two exchanges:

* ``"gather"``: every worker all-gathers the ``N`` payloads and averages their decodes in
  rank order (the same bits on every worker). Each worker sends its payload ``N - 1`` times
  over a ring of all-gathers: ``(N - 1) * nbytes(d)``.
* ``"two_phase"``: the all-reduce with compressed messages of 1-bit Adam and AQ-SGD's
  end-to-end setting: each worker cuts ``e_w`` into ``N`` segments and encodes each; an
  all-to-all hands segment ``j`` of every worker to worker ``j``, which averages their
  decodes, adds its own segment error, encodes the mean again and keeps that rounding as its
  segment error; an all-gather hands every averaged segment to every worker. Each worker
  sends about ``2 (N - 1) / N * nbytes(d)``: the bytes of a ring all-reduce of the codes,
  where ``"gather"`` sends ``N - 1`` full payloads.

:func:`jaxcomm.ec_quantized_all_reduce` is ``two_phase`` over nearest-rounded quantization,
:func:`jaxcomm.chunk_topk` (SparseLoCo's) and :func:`jaxcomm.statistical_quantized`
(MuLoCo's) are ``gather`` over their codecs.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm._src._checks import axis_size, check_choice, check_float, check_int
from jaxcomm._src.aggregate import worker_state
from jaxcomm._src.codec import Codec, QuantizeCodec, decode
from jaxcomm._src.collectives import (
    all_gather,
    all_gather_wire,
    all_to_all,
    all_to_all_wire,
    join_segments,
    replicated,
    ring_all_gather,
    ring_all_gather_wire,
    split_segments,
)
from jaxcomm._src.network import CommLog, empty_log, log_wire
from jaxcomm._src.worker import TreeLayout, flatten_grads, init_layout

__all__ = [
    "EXCHANGES",
    "AVERAGES",
    "ErrorFedState",
    "ECQuantizedState",
    "error_fed",
    "ec_quantized_all_reduce",
]

EXCHANGES = ("gather", "two_phase")
AVERAGES = ("workers", "senders")


class ErrorFedState(NamedTuple):
    """State of :func:`error_fed` (and of the aggregators built on it), per worker.

    Attributes:
      residual: ``f32[d]`` this worker's error-feedback buffer ``e``.
      server_error: ``f32[ceil(d / N)]`` the rounding of the averaged segment this worker
        encodes again (``"two_phase"``), ``None`` for ``"gather"``.
      key: ``uint32[2]`` raw PRNG key data of a codec that draws from its key, split every
        step (made distinct per worker), or ``None`` for one that does not.
      log: what the last step sent.
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.TreeLayout`).
    """

    residual: jax.Array
    server_error: jax.Array | None
    key: jax.Array | None
    log: CommLog
    layout: TreeLayout


def _gathered_mean(gathered: Any, n: int, like: jax.Array) -> jax.Array:
    """The mean of the ``n`` all-gathered payloads' decodes, summed in rank order (so the
    same bits on every worker)."""

    def add(w, total):
        return total + decode(jax.tree_util.tree_map(lambda a: a[w], gathered))

    return lax.fori_loop(0, n, add, jnp.zeros_like(like)) / n


def _senders_mean(gathered: Any, codec: Codec, n: int, like: jax.Array) -> jax.Array:
    """The sum of the payloads' decodes over, at each entry, the workers that sent it."""

    def add(w, carry):
        total, count = carry
        one = jax.tree_util.tree_map(lambda a: a[w], gathered)
        return total + decode(one), count + codec.sent_mask(one)

    total, count = lax.fori_loop(0, n, add, (jnp.zeros_like(like),) * 2)
    return total / jnp.maximum(count, 1.0)


def error_fed(
    codec: Codec,
    axis_name: Any,
    *,
    exchange: str = "gather",
    decay: float = 1.0,
    average: str = "workers",
    seed: int = 0,
    name: str = "error_fed",
) -> optax.GradientTransformation:
    """Average gradients over ``axis_name`` through ``codec`` with error feedback.

    Args:
      codec: any :class:`jaxcomm.codecs.Codec` of a flat vector (the leaves of the gradient
        pytree one after another; a codec with per-tensor statistics gets the tensors'
        sizes through :meth:`~jaxcomm.codecs.Codec.bind`).
      axis_name: data-parallel axis.
      exchange: ``"gather"`` or ``"two_phase"`` (module docstring).
      decay: ``beta`` in ``[0, 1]``, the error buffer's decay (1.0: plain error feedback).
      average: ``"gather"`` only: divide the summed payloads by ``"workers"`` (``N``) or, at
        each entry, by the ``"senders"`` of it (a sparse codec's ``sent_mask``).
      seed: seed of a stochastic codec's keys.
      name: the aggregator's name in error messages.

    Returns:
      A ``GradientTransformation`` with :class:`ErrorFedState`, whose updates are the
      averaged decodes, identical on every worker; chain an optimizer after it. A NaN or
      Inf in any worker's gradient reaches every worker's update.
    """
    if not isinstance(codec, Codec):
        raise TypeError(f"codec must be a jaxcomm.codecs.Codec, got {type(codec).__name__}")
    if codec.needs_matrix:
        raise ValueError(
            f"codec {codec.label!r} factors a matrix, and error_fed compresses the fused "
            "gradient vector: use jaxcomm.powersgd for low-rank gradients"
        )
    check_choice("exchange", exchange, EXCHANGES)
    decay = check_float("decay", decay, lo=0.0, hi=1.0)
    check_choice("average", average, AVERAGES)
    if average == "senders" and (exchange != "gather" or not codec.sparse):
        raise ValueError(
            "average='senders' needs exchange='gather' and a sparse codec (one with "
            f"sent_mask), got exchange={exchange!r} and codec {codec.label!r}"
        )
    seed = check_int("seed", seed, lo=0, hi=2**32 - 1)

    def init_fn(params):
        layout, d = init_layout(name, params)
        two = exchange == "two_phase"
        state = ErrorFedState(
            residual=jnp.zeros((d,), jnp.float32),
            # Needs the axis size for the segment length: call init inside shard_map too.
            server_error=jnp.zeros((-(-d // axis_size(axis_name)),), jnp.float32) if two else None,
            key=jax.random.key_data(jax.random.key(seed)) if codec.keyed else None,
            log=empty_log(),
            layout=layout,
        )
        return worker_state(state, axis_name)

    def keys(state):
        if state.key is None:
            return None, None, None
        key, next_key = jax.random.split(jax.random.wrap_key_data(state.key))
        mine, again = jax.random.split(jax.random.fold_in(key, lax.axis_index(axis_name)))
        return mine, again, jax.random.key_data(next_key)

    def gather(e, state, key):
        n = axis_size(axis_name)
        bound = codec.bind(tuple(math.prod(shape) for shape in state.layout.shapes))
        payload = bound.encode(e, key)
        residual = e - decode(payload)
        gathered = all_gather(payload, axis_name)
        if average == "workers":
            mean = _gathered_mean(gathered, n, e)
        else:
            mean = _senders_mean(gathered, codec, n, e)
        log = log_wire(empty_log(), all_gather_wire(jax.eval_shape(lambda: payload), n))
        return mean, residual, state.server_error, log

    def two_phase(e, state, key, key_again):
        n = axis_size(axis_name)
        segments = split_segments(e, n)  # f32[N, s]
        bound = codec.bind((segments.shape[1],))
        if key is None:
            q = jax.vmap(lambda seg: bound.encode(seg, None))(segments)
        else:
            q = jax.vmap(bound.encode)(segments, jax.random.split(key, n))
        residual = join_segments(segments - jax.vmap(decode)(q), e.shape)
        # Phase 1: worker j receives every worker's segment j.
        mine = all_to_all(q, axis_name)
        avg = jnp.mean(jax.vmap(decode)(mine), axis=0) + state.server_error  # f32[s]
        q2 = bound.encode(avg, key_again)
        server_error = avg - decode(q2)
        # Phase 2: every worker gets every averaged segment.
        gathered = ring_all_gather(q2, axis_name)
        mean = join_segments(jax.vmap(decode)(gathered), e.shape)
        one = jax.tree_util.tree_map(lambda a: a[0], q)  # one worker-to-worker message
        log = log_wire(empty_log(), all_to_all_wire(one, n))
        log = log_wire(log, ring_all_gather_wire(q2, n))
        return mean, residual, server_error, log

    def update_fn(updates, state, params=None):
        del params
        flat, unflatten = flatten_grads(name, updates, axis_name, state.layout)
        e = decay * state.residual + flat  # f32[d]
        key, key_again, next_key = keys(state)
        if exchange == "gather":
            mean, residual, server_error, log = gather(e, state, key)
        else:
            mean, residual, server_error, log = two_phase(e, state, key, key_again)
        new = ErrorFedState(residual, server_error, next_key, log, state.layout)
        return unflatten(replicated(mean, axis_name)), worker_state(new, axis_name)

    return optax.GradientTransformation(init_fn, update_fn)


#: The state of :func:`ec_quantized_all_reduce` (its worker error is ``residual``).
ECQuantizedState = ErrorFedState


def ec_quantized_all_reduce(
    axis_name: Any, *, bits: int = 4, bucket_size: int = 512
) -> optax.GradientTransformation:
    """Error-compensated quantized gradient averaging in two compressed phases.

    The scheme AQ-SGD pairs with pipeline parallelism for end-to-end compression (its
    "QuantizedAdam" setting, after 1-bit Adam's compressed all-reduce): each worker adds its
    error to the gradient, cuts it into ``N`` segments and quantizes each to ``bits`` bits
    (nearest rounding; the error feedback absorbs the bias); an all-to-all hands segment ``j``
    of every worker to worker ``j``, which averages them, adds its own segment error,
    re-quantizes and all-gathers the result (a ring). Every message on the wire is
    ``bits``-bit codes plus one float32 scale per bucket; a NaN or Inf in any worker's
    gradient makes its bucket's scale non-finite, so it reaches every worker's update.

    Args:
      axis_name: data-parallel axis.
      bits: code width of both phases, 1..8.
      bucket_size: elements per scale.

    Returns:
      A ``GradientTransformation`` whose updates are the (compressed) averaged gradients,
      identical on every worker (typed as replicated), with :class:`ErrorFedState`
      (``error_fed`` of a nearest-rounding ``QuantizeCodec`` with ``exchange="two_phase"``);
      chain an optimizer after it.
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    bucket_size = check_int("bucket_size", bucket_size, lo=1)
    codec = QuantizeCodec(bits, bucket_size, stochastic=False)
    return error_fed(codec, axis_name, exchange="two_phase", name="ec_quantized_all_reduce")
