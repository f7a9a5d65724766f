"""Local SGD and partial local SGD (DreamDDP) as ``optax`` wrappers around an inner optimizer.

DreamDDP (Sec. 3.1, Algorithm 1 and Definition 1 of "DreamDDP: Accelerating Data Parallel
Distributed LLM Training with Layer-wise Scheduled Partial Synchronization"): every worker
steps its own optimizer on its own gradient, and at local step ``h = r mod H`` of each
period of ``H`` steps the parameters of the layers in ``schedule.groups[h]`` are averaged
over the workers (after that step's local update: ``w_{r+1} = mean_k(w_r^k - lr g_r^k)`` for
those layers, ``w_r^k - lr g_r^k`` for the rest). Local SGD with full synchronisation
(FLSGD) is the schedule that averages every layer at the last step of the period.

The wrappers run inside ``jax.shard_map`` with per-worker parameters (they differ between
synchronisations, so a trainer keeps them with a leading worker axis), and return updates
that ``optax.apply_updates`` adds to the parameters, as optax expects::

    tx = jaxcomm.partial_local_sgd(
        optax.adam(1e-3), "data", schedule=jaxcomm.schedules.enp_schedule(6, 3), layers=layer_names
    )

    def per_worker(params, state, batch):   # params: this worker's own copy
        grads = jaxcomm.worker_grad(loss_fn, "data")(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

**Layers.** ``layers`` names the model's layers in order from input (layer 0) to output: a
sequence of top-level keys of the parameter mapping (for a Flax model, e.g. ``["embed",
"block_0", ..., "head"]``; ``models.layer_groups`` gives that order for the models shipped
here), or a callable that returns it from the parameters. Every top-level key must be named
exactly once, so no parameter goes unsynchronised. ``layers=None`` treats the whole model as
one layer. The parameters may be any mapping pytree (a dict, a Linen ``FrozenDict``, the
``nnx.State`` of ``nnx.split``): the updates have exactly the parameters' structure (treedef).

**What crosses the wire.** Each layer of the step's group is averaged by its own all-reduce
(``reduce``: ``ring``, ``tree`` or ``psum``) of its leaves fused into one float32 message, in
backward order (output layer first), the order in which DreamDDP launches them after each
layer's backward pass. A step whose group is empty sends nothing. The ``lax.switch`` that
picks the group is named :data:`SYNC_SCOPE` for :func:`jaxcomm.wire_audit`'s ``branches=``;
branch ``b`` is the ``b``-th distinct group of the schedule (:func:`sync_branch`).

**State.** The inner optimizer's state (e.g. Adam's moments) stays local and is never
averaged, as in the paper's local SGD. Averaged parameters agree between workers up to one
rounding of ``p + (mean - p)`` (the update is added, not assigned).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm._src._checks import check_int
from jaxcomm._src.aggregate import DENSE_REDUCE, all_reduce_flat, all_reduce_wire, worker_state
from jaxcomm._src.collectives import as_varying
from jaxcomm._src.dreamddp import Schedule, as_schedule, full_sync_schedule
from jaxcomm._src.network import CommLog, Network, Wire, empty_log, log_wire
from jaxcomm._src.worker import TreeLayout, check_grads, check_layout, init_layout, layout_of

__all__ = [
    "SYNC_SCOPE",
    "LocalSGDState",
    "layer_names",
    "layer_wires",
    "local_sgd",
    "partial_local_sgd",
    "sync_branch",
]

# jax.named_scope of the lax.switch over the schedule's groups (a ``branches=`` key).
SYNC_SCOPE = "local_sgd_sync"

Layers = Sequence[str] | Callable[[Any], Sequence[str]] | None


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd` and :func:`partial_local_sgd`, per worker.

    Attributes:
      inner: the inner optimizer's state, local to this worker (never averaged).
      count: ``int32`` scalar, local steps taken so far; the next step is local step
        ``count % period`` of its period.
      log: what the last step sent (the averaging of that step's group).
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.TreeLayout`).
    """

    inner: Any
    count: jax.Array
    log: CommLog
    layout: TreeLayout


def layer_names(params: Any, layers: Layers) -> list[str] | None:
    """The layer names (top-level keys of ``params``) in input-to-output order, checked to
    name every key exactly once; None when ``layers`` is None (the whole model, one layer)."""
    if layers is None:
        return None
    names = list(layers(params) if callable(layers) else layers)
    if not isinstance(params, Mapping):
        raise ValueError(
            f"layers={names!r} names top-level keys, but params is a "
            f"{type(params).__name__}, not a mapping; pass layers=None for one layer"
        )
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"layers must be top-level parameter keys (str); got {bad!r}")
    dup = sorted({n for n in names if names.count(n) > 1})
    missing = [k for k in params if k not in names]
    unknown = [n for n in names if n not in params]
    if dup or missing or unknown:
        raise ValueError(
            f"layers must name every top-level parameter key exactly once; got {names!r} "
            f"for keys {list(params)!r} (duplicated: {dup}, missing: {missing}, "
            f"unknown: {unknown})"
        )
    return names


def _leaf_layers(tree: Any, names: list[str]) -> list[int]:
    """For each leaf of ``tree`` (in flattening order), the index in ``names`` of the layer
    (top-level key, from the leaf's key path) that holds it."""
    index = {name: i for i, name in enumerate(names)}
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = getattr(path[0], "key", None) if path else None
        if not isinstance(key, str) or key not in index:
            raise ValueError(
                f"leaf {jax.tree_util.keystr(path) or '<root>'} of the {type(tree).__name__} "
                f"parameters lies under no layer of {names!r}: layers are the top-level keys "
                "of a mapping (a dict, FrozenDict or nnx.State)"
            )
        out.append(index[key])
    return out


def _layer_trees(params: Any, names: list[str] | None) -> list[Any]:
    """Each layer's leaves (a list, in ``params``' flattening order), layer 0 first; the
    whole tree as one layer when ``names`` is None."""
    if names is None:
        return [params]
    owner = _leaf_layers(params, names)
    leaves = jax.tree_util.tree_leaves(params)
    return [[x for x, o in zip(leaves, owner, strict=True) if o == i] for i in range(len(names))]


def _join_layers(trees: Sequence[Any], names: list[str] | None, like: Any) -> Any:
    """The inverse of :func:`_layer_trees`: ``like``'s structure (its treedef, so an
    ``nnx.State`` stays one) with layer ``i``'s leaves taken, in order, from ``trees[i]``
    (any pytree whose leaves are that layer's, as ``like`` orders them)."""
    if names is None:
        return trees[0]
    treedef = jax.tree_util.tree_structure(like)
    layers = [iter(jax.tree_util.tree_leaves(t)) for t in trees]
    return jax.tree_util.tree_unflatten(
        treedef, [next(layers[o]) for o in _leaf_layers(like, names)]
    )


def _flat(tree: Any) -> jax.Array:
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])


def _unflat(flat: jax.Array, like: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(like)
    out, at = [], 0
    for x in leaves:
        size = x.size
        out.append(flat[at : at + size].reshape(x.shape).astype(x.dtype))
        at += size
    return jax.tree_util.tree_unflatten(treedef, out)


def layer_wires(params: Any, layers: Layers, n: int, *, reduce: str = "ring") -> list[Wire]:
    """The :class:`~jaxcomm.network.Wire` of each layer's averaging (layer 0 first) on ``n``
    workers: what :func:`partial_local_sgd` sends when it averages that layer. ``params``
    may hold arrays or ``jax.ShapeDtypeStruct``."""
    trees = _layer_trees(params, layer_names(params, layers))
    out = []
    for tree in trees:
        d = sum(int(x.size) for x in jax.tree_util.tree_leaves(tree))
        out.append(all_reduce_wire(jax.ShapeDtypeStruct((d,), jnp.float32), n, reduce))
    return out


def layer_comm_s(wires: Sequence[Wire], network: Network) -> list[float]:
    """Modelled seconds of each layer's averaging: ``rounds * alpha + path_bytes * beta``."""
    return [network.wire_seconds(w.rounds, w.path_bytes) for w in wires]


def _distinct(groups: Sequence[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], list[int]]:
    unique: list[tuple[int, ...]] = []
    index = []
    for g in groups:
        if g not in unique:
            unique.append(g)
        index.append(unique.index(g))
    return unique, index


def sync_branch(schedule: Schedule | Sequence[Sequence[int]], step: int) -> int:
    """The :data:`SYNC_SCOPE` branch that 0-based step ``step`` takes (for ``branches=``)."""
    sched = as_schedule(schedule)
    return _distinct(sched.groups)[1][check_int("step", step, lo=0) % sched.period]


def _scheduled(
    who: str,
    inner: optax.GradientTransformation,
    axis_name: Any,
    make_schedule: Callable[[int], Schedule],
    layers: Layers,
    reduce: str,
) -> optax.GradientTransformation:
    """The wrapper: ``make_schedule(num_layers)`` gives the schedule once the parameters
    (and so the number of layers) are known, at trace time."""

    def init_fn(params):
        layout, _ = init_layout(who, params)
        state = LocalSGDState(inner.init(params), jnp.zeros([], jnp.int32), empty_log(), layout)
        return worker_state(state, axis_name)

    def update_fn(grads, state, params=None):
        if params is None:
            raise ValueError("local SGD wrappers need params: call tx.update(grads, state, params)")
        check_grads(who, grads, axis_name)
        check_layout(who, state.layout, layout_of(grads))
        names = layer_names(params, layers)
        schedule = make_schedule(1 if names is None else len(names))
        unique, branch_of = _distinct(schedule.groups)
        inner_updates, inner_state = inner.update(grads, state.inner, params)
        local = optax.apply_updates(params, inner_updates)
        index = lax.axis_index(axis_name)

        def branch(group):
            def run(trees):
                # trees: this worker's layers after its local step; the group's layers are
                # replaced by their worker average, one all-reduce each, output side first.
                trees, log = list(trees), empty_log()
                for layer in sorted(group, reverse=True):
                    flat = _flat(trees[layer])
                    total, wire = all_reduce_flat(flat, axis_name, reduce)
                    trees[layer] = _unflat(total / lax.axis_size(axis_name), trees[layer])
                    log = log_wire(log, wire, index)
                return as_varying((trees, log), axis_name)

            return run

        with jax.named_scope(SYNC_SCOPE):
            h = state.count % schedule.period
            table = jnp.asarray(branch_of, jnp.int32)
            trees, log = lax.switch(
                table[h], [branch(g) for g in unique], _layer_trees(local, names)
            )
        synced = _join_layers(trees, names, local)
        updates = jax.tree_util.tree_map(lambda s, p: (s - p).astype(p.dtype), synced, params)
        new_state = LocalSGDState(inner_state, state.count + 1, log, state.layout)
        return updates, worker_state(new_state, axis_name)

    return optax.GradientTransformation(init_fn, update_fn)


def local_sgd(
    inner: optax.GradientTransformation,
    axis_name: Any,
    *,
    period: int,
    layers: Layers = None,
    reduce: str = "ring",
) -> optax.GradientTransformation:
    """Local SGD with full synchronisation (FLSGD): average all parameters every ``period``
    steps (after steps ``period``, ``2 period``, ...).

    Args:
      inner: the optimizer each worker steps locally (its state stays local).
      axis_name: the data-parallel mesh axis (inside ``jax.shard_map``).
      period: ``H >= 1``; ``period=1`` averages after every step, which for SGD (and
        momentum SGD, being linear) equals synchronous SGD with averaged gradients.
      layers: None (default) averages the whole model as one fused message; layer names
        (see the module docstring) average layer by layer, as DreamDDP's FLSGD baseline
        does, so each layer's message can leave right after its backward pass.
      reduce: the all-reduce: ``ring`` (:func:`jaxcomm.collectives.ring_all_reduce`), ``tree`` or
        ``psum``.

    Returns:
      A ``GradientTransformation`` with :class:`LocalSGDState`; its updates are added to this
      worker's parameters.

    References:
      Lin et al., "Don't use large mini-batches, use local SGD", ICLR 2020; DreamDDP Sec. 2.
    """
    period = check_int("period", period, lo=1)
    if reduce not in DENSE_REDUCE:
        raise ValueError(f"reduce must be one of {DENSE_REDUCE}, got {reduce!r}")

    return _scheduled(
        "local_sgd",
        inner,
        axis_name,
        lambda num_layers: full_sync_schedule(num_layers, period),
        layers,
        reduce,
    )


def partial_local_sgd(
    inner: optax.GradientTransformation,
    axis_name: Any,
    *,
    schedule: Schedule | Sequence[Sequence[int]],
    layers: Layers = None,
    period: int | None = None,
    reduce: str = "ring",
) -> optax.GradientTransformation:
    """Partial local SGD (PLSGD, DreamDDP's Algorithm 1): at local step ``h`` of each period
    average the layers of ``schedule.groups[h]``.

    Args:
      inner: the optimizer each worker steps locally (its state stays local).
      axis_name: the data-parallel mesh axis (inside ``jax.shard_map``).
      schedule: a :class:`jaxcomm.schedules.Schedule` (from
        :func:`jaxcomm.schedules.dreamddp_schedule`, :func:`jaxcomm.schedules.enp_schedule`,
        ...) or a plain sequence of groups of 0-based layer
        indices (0 = input); every layer must be averaged at least once per period, and a
        layer may be averaged at several steps.
      layers: the layer names, input to output (see the module docstring); their number
        must equal the schedule's.
      period: optional check: must equal the schedule's period.
      reduce: the all-reduce of each layer: ``ring``, ``tree`` or ``psum``.

    Returns:
      A ``GradientTransformation`` with :class:`LocalSGDState`; its updates are added to this
      worker's parameters.

    Example::

        sched = jaxcomm.schedules.dreamddp_schedule(backward_s, comm_s, period=5)
        tx = jaxcomm.partial_local_sgd(optax.adam(1e-3), "data", schedule=sched,
                                       layers=["embed", "block_0", "block_1", "head"])

    References:
      DreamDDP, Sec. 3.1 (Definition 1, Algorithm 1).
    """
    sched = as_schedule(schedule)
    if period is not None and check_int("period", period, lo=1) != sched.period:
        raise ValueError(
            f"period={period} does not match the schedule's period {sched.period} "
            f"(len(schedule.groups)); pass a schedule built for period {period}"
        )
    if reduce not in DENSE_REDUCE:
        raise ValueError(f"reduce must be one of {DENSE_REDUCE}, got {reduce!r}")

    def make_schedule(num_layers: int) -> Schedule:
        if num_layers != sched.num_layers:
            raise ValueError(
                f"schedule covers {sched.num_layers} layers (0..{sched.num_layers - 1}), but "
                f"layers={layers!r} gives the model {num_layers}; layer indices must lie in "
                f"0..{num_layers - 1} and cover them all"
            )
        return sched

    return _scheduled("partial_local_sgd", inner, axis_name, make_schedule, layers, reduce)
