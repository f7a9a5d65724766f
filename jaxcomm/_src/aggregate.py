"""Dense gradient aggregation as ``optax`` transforms (the uncompressed baselines).

Each aggregator runs inside ``jax.shard_map`` with ``axis_name`` bound: it receives this
worker's gradients and returns their average over the axis, so it chains in front of any
optimizer::

    tx = optax.chain(jaxcomm.dense_all_reduce("data", reduce="ring"), optax.adam(1e-3))

The transforms that own their step (:func:`jaxcomm.marsit` and the sign methods of
:mod:`jaxcomm.signsgd`) are of type :class:`WholeOptimizer` instead: they return the step to
apply, so they take the place of the whole chain and refuse an optimizer chained after them.

The whole gradient pytree is fused into one flat float32 message (one collective per step).
The state holds a :class:`~jaxcomm.network.CommLog` of what the step put on the wire, so the
trainer can turn measured payload bytes into modelled communication time.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm._src._checks import axis_size, check_choice
from jaxcomm._src.codecs import payload_bytes
from jaxcomm._src.collectives import (
    as_varying,
    psum,
    psum_wire,
    ring_all_reduce,
    ring_all_reduce_wire,
    split_segments,
    tree_all_reduce,
    tree_all_reduce_wire,
)
from jaxcomm._src.network import CommLog, Wire, empty_log, log_wire
from jaxcomm._src.worker import flatten_grads

__all__ = [
    "DENSE_REDUCE",
    "DenseState",
    "WholeOptimizer",
    "all_reduce_flat",
    "all_reduce_wire",
    "dense_all_reduce",
    "whole_optimizer",
    "scheduled_step",
    "ScheduledStepState",
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


class WholeOptimizer(optax.GradientTransformation):
    """A ``GradientTransformation`` whose updates are the step to apply, not a gradient.

    :func:`jaxcomm.marsit`, :func:`jaxcomm.signsgd_mv`, :func:`jaxcomm.ef_signsgd`,
    :func:`jaxcomm.ssdm` and :func:`jaxcomm.cascading_sign` are of this type: each applies
    its own step sizes and returns ``-step``, ready for ``optax.apply_updates``. An optimizer
    chained after one would transform that step again (``optax.sgd`` reverses its sign, so
    training goes uphill), so it is used alone: in the place of the whole
    ``optax.chain(aggregator, optimizer)``, or as ``optax.chain(tx, optax.identity())`` where a
    two-part state is wanted. Gradient-side transforms (clipping, weight decay) may come
    before it. When its ``update`` runs directly inside ``optax.chain`` or
    ``optax.named_chain`` (nested chains included) and any transform other than
    ``optax.identity()`` follows it there, ``update`` raises a ``ValueError`` naming it.
    ``isinstance(tx, jaxcomm.WholeOptimizer)`` tells such a transform from a gradient
    aggregator, which an optimizer follows.
    """

    __slots__ = ()


def whole_optimizer(
    name: str, step_sizes: str, init_fn: Callable, update_fn: Callable
) -> WholeOptimizer:
    """``optax.GradientTransformation(init_fn, update_fn)`` as a :class:`WholeOptimizer`.

    Args:
      name: how errors name the transform, e.g. ``"jaxcomm.marsit"``.
      step_sizes: its step-size arguments as errors name them, e.g. ``"lr"``.
      init_fn, update_fn: as for ``optax.GradientTransformation``; ``update_fn`` returns the
        step to add to the parameters.

    Returns:
      A :class:`WholeOptimizer` whose ``update`` refuses, at trace time, to be followed in
      an ``optax.chain`` by any transform other than ``optax.identity()`` or
      :func:`scheduled_step`.
    """

    def update(updates, state, params=None):
        _refuse_followers(name, step_sizes)
        return update_fn(updates, state, params)

    return WholeOptimizer(init_fn, update)


# What optax.chain is made of, recognised by code object: a chain's update function, the
# wrapper it puts around a transform without extra-args support, optax.identity's update.
_PLAIN = optax.GradientTransformation(lambda params: (), lambda u, s, p=None: (u, s))
_WRAPPER_CODE = optax.with_extra_args_support(_PLAIN).update.__code__
_CHAIN_CODE = optax.chain(_PLAIN).update.__code__
_NAMED_CHAIN_CODE = optax.named_chain(("t", _PLAIN)).update.__code__
_IDENTITY_CODE = optax.identity().update.__code__


class ScheduledStepState(NamedTuple):
    """State of :func:`scheduled_step`: ``count``, the updates scaled so far (int32[])."""

    count: Any


def scheduled_step(schedule: Callable[[Any], Any]) -> optax.GradientTransformation:
    """The updates times ``schedule(count)`` (a learning-rate schedule's shape, peak 1:
    values in ``[0, 1]``, clipped there), ``count`` the calls so far: the one transform
    besides ``optax.identity()`` that may follow a whole optimizer (it scales the step
    without turning it; optax's own scalings may negate)."""

    def init(params):
        del params
        return ScheduledStepState(jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        factor = jnp.clip(schedule(state.count), 0.0, 1.0)
        updates = jax.tree_util.tree_map(lambda u: (factor * u).astype(u.dtype), updates)
        return updates, ScheduledStepState(optax.safe_int32_increment(state.count))

    return optax.GradientTransformation(init, update)


_SCHEDULE_CODE = scheduled_step(lambda count: 1.0).update.__code__


def _closure(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__), strict=True))


def _passes_through(fn: Any) -> bool:
    """Whether a chained update function hands its updates on in their direction:
    optax.identity's or :func:`scheduled_step`'s, also wrapped for extra args or inside a
    chain of such."""
    code = getattr(fn, "__code__", None)
    if code in (_IDENTITY_CODE, _SCHEDULE_CODE):
        return True
    if code is _WRAPPER_CODE:
        return _passes_through(getattr(_closure(fn).get("tx"), "update", None))
    if code is _CHAIN_CODE:
        return all(_passes_through(f) for f in _closure(fn).get("update_fns", (None,)))
    if code is _NAMED_CHAIN_CODE:
        transforms = _closure(fn).get("transforms") or [(None, None)]
        return all(_passes_through(getattr(t, "update", None)) for _, t in transforms)
    return False


def _chain_position(frame: Any) -> tuple[list[Any], int] | None:
    """``(update functions, index of the one running)`` of the chain running in ``frame``,
    or None when the frame's variables are not the expected ones."""
    names = frame.f_locals
    if frame.f_code is _CHAIN_CODE:
        fns, current = names.get("update_fns"), names.get("fn")
    else:
        transforms, tx = names.get("transforms"), names.get("tx")
        if transforms is None or tx is None:
            return None
        fns, current = [t.update for _, t in transforms], tx.update
    if fns is None:
        return None
    index = next((i for i, f in enumerate(fns) if f is current), None)
    return None if index is None else (list(fns), index)


def _refuse_followers(name: str, step_sizes: str) -> None:
    """Raise when the update function that called this runs directly inside an optax chain
    (nested chains included) that applies a transform other than optax.identity after it.

    optax hands no transform a view of the ones after it, so this reads the running chain's
    own variables; a chain whose variables are not the expected ones is not checked.
    """
    frame = sys._getframe(2)  # the caller of the whole optimizer's update
    try:
        while frame is not None:
            if frame.f_code is _WRAPPER_CODE:
                frame = frame.f_back
                continue
            if frame.f_code not in (_CHAIN_CODE, _NAMED_CHAIN_CODE):
                return
            position = _chain_position(frame)
            if position is None:
                return
            fns, index = position
            after = [f for f in fns[index + 1 :] if not _passes_through(f)]
            if after:
                chain = "optax.chain" if frame.f_code is _CHAIN_CODE else "optax.named_chain"
                raise ValueError(
                    f"{name} returns the step to apply, already negative and scaled by its "
                    f"own {step_sizes}, but {chain} applies {len(after)} more "
                    f"transform(s) after it, which would change that step (optax.sgd after "
                    f"it reverses its sign, and training goes uphill). {name} is a whole "
                    f"optimizer: use it alone in place of optax.chain(aggregator, optimizer), "
                    f"or as optax.chain({name}(...), optax.identity()) to keep a two-part "
                    "state; optax.identity() is the only transform allowed after it (and "
                    "jaxcomm's scheduled_step, a schedule's shape in [0, 1]). "
                    "Gradient-side transforms (clipping, weight decay) go before it"
                )
            frame = frame.f_back
    finally:
        del frame


class DenseState(NamedTuple):
    """State of :func:`dense_all_reduce`.

    Attributes:
      log: what the last step sent (one all-reduce of the fused gradient).
    """

    log: CommLog


def dense_all_reduce(axis_name: Any, *, reduce: str = "psum") -> optax.GradientTransformation:
    """Average gradients over ``axis_name`` with no compression.

    Args:
      axis_name: the data-parallel mesh axis.
      reduce: ``"psum"`` (XLA's built-in all-reduce, logged as kind ``allreduce`` with ring
        costs), ``"ring"`` (:func:`jaxcomm.collectives.ring_all_reduce`) or ``"tree"``
        (:func:`jaxcomm.collectives.tree_all_reduce`).

    Returns:
      A ``GradientTransformation`` whose updates are the worker-averaged gradients, identical
      on every worker and typed as replicated over ``axis_name`` (so replicated parameters,
      ``out_specs=P()``, work with ``check_vma=True``).

    Example::

        tx = optax.chain(jaxcomm.dense_all_reduce("data", reduce="ring"), optax.adam(1e-3))

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
        flat, unflatten = flatten_grads("dense_all_reduce", updates, axis_name)
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
