"""Dense gradient aggregation as ``optax`` transforms (the uncompressed baselines).

Each aggregator runs inside ``jax.shard_map`` with ``axis_name`` bound: it receives this
worker's gradients and returns their average over the axis, so it chains in front of any
optimizer::

    tx = optax.chain(jaxcomm.dense_allreduce("data", reduce="ring"), optax.adam(1e-3))

The whole gradient pytree is fused into one flat float32 message (one collective per step).
The state holds a :class:`~jaxcomm.network.CommLog` of what the step put on the wire, so the
trainer can turn measured payload bytes into modelled communication time.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm._checks import axis_size, check_choice, check_int
from jaxcomm.codecs import dequantize, payload_bytes, quantize
from jaxcomm.collectives import (
    all_to_all,
    all_to_all_wire,
    as_varying,
    join_segments,
    psum,
    psum_wire,
    replicated,
    ring_all_gather,
    ring_all_gather_wire,
    ring_all_reduce,
    ring_all_reduce_wire,
    split_segments,
    tree_all_reduce,
    tree_all_reduce_wire,
)
from jaxcomm.network import CommLog, Wire, empty_log, log_wire
from jaxcomm.worker import Layout, flatten_grads, init_layout

__all__ = [
    "DENSE_REDUCE",
    "DenseState",
    "ECQuantizedState",
    "all_reduce_flat",
    "all_reduce_wire",
    "dense_allreduce",
    "ec_quantized_allreduce",
    "ring_sent_bytes",
    "tree_sent_bytes",
    "worker_state",
]


def worker_state(state: Any, axis_name: Any) -> Any:
    """Type a per-worker state pytree as varying over ``axis_name`` (inside ``shard_map``).

    Aggregator state (residuals, counters, keys, logs) differs between workers after the
    first update, so ``init`` returns it typed that way too; then ``init`` and ``update``
    agree and the state can be a ``lax.scan`` carry or a ``lax.cond`` operand with
    ``check_vma=True``. Outside ``shard_map`` nothing changes.
    """
    return as_varying(state, axis_name)


class DenseState(NamedTuple):
    """State of :func:`dense_allreduce`.

    Attributes:
      log: what the last step sent (one all-reduce of the fused gradient).
    """

    log: CommLog


def ring_sent_bytes(segment: Any, n: int) -> int:
    """Bytes one worker sends in a ring all-reduce whose segments look like ``segment``."""
    return 2 * (n - 1) * payload_bytes(segment)


def tree_sent_bytes(message: Any, n: int) -> int:
    """Bytes the busiest worker sends in :func:`jaxcomm.tree_all_reduce` of ``message``.

    That is the root, which forwards the result ``ceil(log2 N)`` times in the broadcast
    (every other device sends once in the reduce and at most ``ceil(log2 N) - 1`` times in
    the broadcast); :func:`jaxcomm.collectives.tree_all_reduce_wire` has every device's count.
    """
    return max(tree_all_reduce_wire(message, n).sent, default=0)


def dense_allreduce(axis_name: Any, *, reduce: str = "psum") -> optax.GradientTransformation:
    """Average gradients over ``axis_name`` with no compression.

    Args:
      axis_name: the data-parallel mesh axis.
      reduce: ``"psum"`` (XLA's built-in all-reduce, logged as kind ``allreduce`` with ring
        costs), ``"ring"`` (:func:`jaxcomm.ring_all_reduce`) or ``"tree"``
        (:func:`jaxcomm.tree_all_reduce`).

    Returns:
      A ``GradientTransformation`` whose updates are the worker-averaged gradients, identical
      on every worker and typed as replicated over ``axis_name`` (so replicated parameters,
      ``out_specs=P()``, work with ``check_vma=True``).

    Example::

        tx = optax.chain(jaxcomm.dense_allreduce("data", reduce="ring"), optax.adam(1e-3))

        def per_worker(params, state, batch):      # inside jax.shard_map over "data"
            grads = jaxcomm.worker_grad(loss_fn, "data")(params, batch)  # own gradient
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
    """
    check_choice("reduce", reduce, DENSE_REDUCE)

    def init_fn(params):
        del params
        return worker_state(DenseState(empty_log()), axis_name)

    def update_fn(updates, state, params=None):
        del params, state
        n = axis_size(axis_name)
        # flat: f32[d], this worker's gradient
        flat, unflatten = flatten_grads("dense_allreduce", updates, axis_name)
        total, wire = all_reduce_flat(flat, axis_name, reduce)
        mean = unflatten(total / n)
        log = log_wire(empty_log(), wire, lax.axis_index(axis_name))
        return mean, worker_state(DenseState(log), axis_name)

    return optax.GradientTransformation(init_fn, update_fn)


DENSE_REDUCE = ("psum", "ring", "tree")


def all_reduce_wire(flat: Any, n: int, reduce: str) -> Wire:
    """The :class:`~jaxcomm.network.Wire` of :func:`all_reduce_flat` of a message shaped
    like ``flat`` (an array or ``jax.ShapeDtypeStruct``) on ``n`` devices."""
    check_choice("reduce", reduce, DENSE_REDUCE)
    if reduce == "psum":
        return psum_wire(flat, n)
    if reduce == "ring":
        seg = jax.eval_shape(lambda v: split_segments(v, n)[0], flat)
        return ring_all_reduce_wire(seg, n, message_bytes=payload_bytes(flat))
    return tree_all_reduce_wire(flat, n)


def all_reduce_flat(flat: jax.Array, axis_name: Any, reduce: str) -> tuple[jax.Array, Wire]:
    """Sum of a flat array over ``axis_name`` by ``reduce`` (``psum``, ``ring`` or ``tree``),
    and the :class:`~jaxcomm.network.Wire` of what that sends (inside ``shard_map``)."""
    check_choice("reduce", reduce, DENSE_REDUCE)
    n = axis_size(axis_name)
    if reduce == "psum":
        total = psum(flat, axis_name)
    elif reduce == "ring":
        total = ring_all_reduce(flat, axis_name)
    else:
        total = tree_all_reduce(flat, axis_name)
    return total, all_reduce_wire(flat, n, reduce)


class ECQuantizedState(NamedTuple):
    """State of :func:`ec_quantized_allreduce`, per worker.

    Attributes:
      worker_error: ``f32[d]`` error feedback of this worker's compression (phase 1).
      server_error: ``f32[ceil(d / N)]`` error feedback of the segment this worker averages
        and re-compresses (phase 2).
      log: what the last step sent.
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.Layout`).
    """

    worker_error: jax.Array
    server_error: jax.Array
    log: CommLog
    layout: Layout


def ec_quantized_allreduce(
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
      identical on every worker (typed as replicated); chain an optimizer after it.
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    bucket_size = check_int("bucket_size", bucket_size, lo=1)

    def encode(v):
        return quantize(v, None, bits=bits, bucket_size=bucket_size, stochastic=False)

    def init_fn(params):
        # Needs the axis size for the segment length: call init inside shard_map too.
        n = axis_size(axis_name)
        layout, d = init_layout("ec_quantized_allreduce", params)
        state = ECQuantizedState(
            worker_error=jnp.zeros((d,), jnp.float32),
            server_error=jnp.zeros((-(-d // n),), jnp.float32),
            log=empty_log(),
            layout=layout,
        )
        return worker_state(state, axis_name)

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        flat, unflatten = flatten_grads("ec_quantized_allreduce", updates, axis_name, state.layout)
        v = flat + state.worker_error  # f32[d]
        segments = split_segments(v, n)  # f32[N, s]
        q = jax.vmap(encode)(segments)  # codes: uint8[N, ceil(s*bits/8)], scale: f32[N, nb]
        sent_back = jax.vmap(dequantize)(q)
        worker_error = join_segments(segments - sent_back, v.shape)
        # Phase 1: worker j receives every worker's segment j.
        mine = all_to_all(q, axis_name)
        avg = jnp.mean(jax.vmap(dequantize)(mine), axis=0) + state.server_error  # f32[s]
        q2 = encode(avg)
        server_error = avg - dequantize(q2)
        # Phase 2: every worker gets every averaged segment.
        gathered = ring_all_gather(q2, axis_name)
        out = join_segments(jax.vmap(dequantize)(gathered), v.shape)
        chunk = jax.tree_util.tree_map(lambda a: a[0], q)  # one worker-to-worker message
        log = log_wire(empty_log(), all_to_all_wire(chunk, n))
        log = log_wire(log, ring_all_gather_wire(q2, n))
        state = ECQuantizedState(worker_error, server_error, log, state.layout)
        return unflatten(replicated(out, axis_name)), worker_state(state, axis_name)

    return optax.GradientTransformation(init_fn, update_fn)
