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

from jaxcomm._checks import axis_size, check_choice
from jaxcomm.codecs import payload_bytes
from jaxcomm.collectives import ring_all_reduce, split_segments, tree_all_reduce
from jaxcomm.network import CommLog, empty_log, log_collective

__all__ = ["DenseState", "dense_allreduce", "ring_sent_bytes", "tree_sent_bytes"]


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
