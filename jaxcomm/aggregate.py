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
from jax.flatten_util import ravel_pytree

from jaxcomm._checks import axis_size, check_choice, check_int
from jaxcomm.codecs import dequantize, payload_bytes, quantize
from jaxcomm.collectives import (
    join_segments,
    ring_all_gather,
    ring_all_reduce,
    split_segments,
    tree_all_reduce,
)
from jaxcomm.network import CommLog, empty_log, log_collective

__all__ = [
    "DenseState",
    "ECQuantizedState",
    "dense_allreduce",
    "ec_quantized_allreduce",
    "ring_sent_bytes",
    "tree_sent_bytes",
]


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
    """Bytes the busiest worker sends in a binomial-tree all-reduce of ``message``."""
    rounds = max(0, (n - 1).bit_length())
    return 2 * rounds * payload_bytes(message)


def dense_allreduce(axis_name: Any, *, reduce: str = "psum") -> optax.GradientTransformation:
    """Average gradients over ``axis_name`` with no compression.

    Args:
      axis_name: the data-parallel mesh axis.
      reduce: ``"psum"`` (XLA's built-in all-reduce, logged with ring all-reduce costs),
        ``"ring"`` (:func:`jaxcomm.ring_all_reduce`) or ``"tree"``
        (:func:`jaxcomm.tree_all_reduce`).

    Returns:
      A ``GradientTransformation`` whose updates are the worker-averaged gradients.
    """
    check_choice("reduce", reduce, ("psum", "ring", "tree"))

    def init_fn(params):
        del params
        return DenseState(empty_log())

    def update_fn(updates, state, params=None):
        del params, state
        n = axis_size(axis_name)
        flat, unravel = ravel_pytree(updates)
        flat = flat.astype(jnp.float32)
        # flat: f32[d], this worker's gradient
        if reduce == "psum":
            total = lax.psum(flat, axis_name)
        elif reduce == "ring":
            total = ring_all_reduce(flat, axis_name)
        else:
            total = tree_all_reduce(flat, axis_name)
        mean = unravel(total / n)
        nbytes = payload_bytes(flat)
        if reduce == "tree":
            log = log_collective(empty_log(), "tree_allreduce", nbytes, tree_sent_bytes(flat, n))
        else:
            seg = jax.eval_shape(lambda v: split_segments(v, n)[0], flat)
            log = log_collective(empty_log(), "ring_allreduce", nbytes, ring_sent_bytes(seg, n))
        return mean, DenseState(log)

    return optax.GradientTransformation(init_fn, update_fn)


class ECQuantizedState(NamedTuple):
    """State of :func:`ec_quantized_allreduce`, per worker.

    Attributes:
      worker_error: ``f32[d]`` error feedback of this worker's compression (phase 1).
      server_error: ``f32[ceil(d / N)]`` error feedback of the segment this worker averages
        and re-compresses (phase 2).
      log: what the last step sent.
    """

    worker_error: jax.Array
    server_error: jax.Array
    log: CommLog


def ec_quantized_allreduce(
    axis_name: Any, *, bits: int = 4, bucket_size: int = 512
) -> optax.GradientTransformation:
    """Error-compensated quantized gradient averaging in two compressed phases.

    The scheme AQ-SGD pairs with pipeline parallelism for end-to-end compression (its
    "QuantizedAdam" setting, after 1-bit Adam's compressed all-reduce): each worker adds its
    error to the gradient, cuts it into ``N`` segments and quantizes each to ``bits`` bits
    (nearest rounding; the error feedback absorbs the bias); an all-to-all hands segment ``j``
    of every worker to worker ``j``, which averages them, adds its own segment error,
    re-quantizes and all-gathers the result. Every message on the wire is ``bits``-bit codes
    plus one float32 scale per bucket.

    Args:
      axis_name: data-parallel axis.
      bits: code width of both phases, 1..8.
      bucket_size: elements per scale.

    Returns:
      A ``GradientTransformation`` whose updates are the (compressed) averaged gradients;
      chain an optimizer after it.
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    bucket_size = check_int("bucket_size", bucket_size, lo=1)

    def encode(v):
        return quantize(v, None, bits=bits, bucket_size=bucket_size, stochastic=False)

    def init_fn(params):
        # Needs the axis size for the segment length: call init inside shard_map too.
        n = axis_size(axis_name)
        flat, _ = ravel_pytree(params)
        return ECQuantizedState(
            worker_error=jnp.zeros(flat.shape, jnp.float32),
            server_error=jnp.zeros((-(-flat.shape[0] // n),), jnp.float32),
            log=empty_log(),
        )

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        flat, unravel = ravel_pytree(updates)
        v = flat.astype(jnp.float32) + state.worker_error  # f32[d]
        segments = split_segments(v, n)  # f32[N, s]
        q = jax.vmap(encode)(segments)  # codes: uint8[N, ceil(s*bits/8)], scale: f32[N, nb]
        sent_back = jax.vmap(dequantize)(q)
        worker_error = join_segments(segments - sent_back, v.shape)
        # Phase 1: worker j receives every worker's segment j.
        mine = jax.tree_util.tree_map(lambda a: lax.all_to_all(a, axis_name, 0, 0, tiled=False), q)
        avg = jnp.mean(jax.vmap(dequantize)(mine), axis=0) + state.server_error  # f32[s]
        q2 = encode(avg)
        server_error = avg - dequantize(q2)
        # Phase 2: every worker gets every averaged segment.
        gathered = ring_all_gather(q2, axis_name)
        out = join_segments(jax.vmap(dequantize)(gathered), v.shape)
        seg_bytes = payload_bytes(q2)
        log = log_collective(empty_log(), "ring_reduce_scatter", n * seg_bytes, (n - 1) * seg_bytes)
        log = log_collective(log, "ring_allgather", n * seg_bytes, (n - 1) * seg_bytes)
        return unravel(out.astype(flat.dtype)), ECQuantizedState(worker_error, server_error, log)

    return optax.GradientTransformation(init_fn, update_fn)
