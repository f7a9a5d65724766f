"""DiLoCo and Streaming DiLoCo as an ``optax`` wrapper around an inner optimizer.

DiLoCo (Douillard et al., arXiv 2311.08105): every worker steps its own ``inner``
optimizer on its own gradients; after every ``period``-th step the workers form the
pseudo-gradient ``delta = theta_sync - mean_w(theta_w)`` (how far the parameters moved
since the last synchronisation, averaged over the axis), the ``outer`` optimizer (Nesterov
SGD, lr 0.7, momentum 0.9 by default, the paper's) turns it into an update of
``theta_sync``, and every worker continues from the new ``theta_sync``. The inner
optimizer's state stays local; ``theta_sync`` and the outer state are the same on every
worker.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512) adds:

* **fragments**: the layers are split into ``F`` fragments, each with its own
  ``theta_sync`` and outer state, synchronised once per period at staggered steps
  (fragment ``p`` at local step ``(p + 1) * period // F - 1``), so one fragment at a time
  is on the wire and the peak traffic of a step falls by about ``F``. Fragments are
  strided by default (fragment ``p`` holds layers ``p, p + F, ...``, which the paper
  reports slightly better than contiguous ones) or ``"sequential"``; a
  :class:`jaxcomm.schedules.Schedule` may also name them (``schedule=``; DreamDDP's layer groups,
  each layer in exactly one group).
* **overlap**: a fragment's pseudo-gradient travels while the workers run ``overlap``
  (``tau``) more inner steps; when it arrives each worker mixes
  ``theta_frag <- alpha * theta_local + (1 - alpha) * theta_sync``. In the compiled
  program the collective runs in the synchronising step and the merge ``tau`` steps
  later, with the parameters of then: the data flow is the paper's, and a simulated clock
  (the trainer's) hides the transfer behind the ``tau`` steps' compute.
* **compression**: ``aggregate`` is any jaxcomm aggregator (it receives each worker's
  pseudo-gradient and returns their mean), so the outer gradient can cross as 4- or
  8-bit codes (:func:`jaxcomm.ec_quantized_all_reduce`), chunk-wise top-k with 2-bit values
  (:func:`jaxcomm.chunk_topk`, SparseLoCo) or AR-Topk's shared-index ring
  (:func:`jaxcomm.ar_topk`), each with its own error feedback, one state per fragment.
  Deviation: Streaming DiLoCo sends a 4-bit *float* format; jaxcomm's 4-bit codes are
  uniform on each bucket's max-abs grid, error-fed.

**State and dtypes.** ``theta_sync`` starts as the initial parameters, which must be the
same on every worker (as DiLoCo starts them): ``theta_sync``, the outer optimizer's state
and the step count are typed as replicated inside ``shard_map`` (held once, ``P()``), a
cast that nothing checks. Workers started apart would keep different ``theta_sync``
(each applies the same mean step to its own), and one copy of it held once would be
device 0's. It is kept in
float32 whatever the parameters' dtype (a master copy, as INTELLECT-1 keeps its outer
parameters); the outer optimizer runs on it in float32 and the workers receive it in their
own dtype, as an update added to their parameters (with ``bfloat16`` parameters the sum
is rounded once more, and the next pseudo-gradient sees that rounding). Steps that
synchronise nothing return the inner optimizer's updates unchanged.

Usage, inside ``jax.shard_map`` with per-worker parameters (they differ between
synchronisations, so a trainer keeps them with a leading worker axis)::

    tx = jaxcomm.diloco(optax.adamw(3e-4), "data", period=100)

    def per_worker(params, state, batch):   # params: this worker's own copy
        grads = jaxcomm.worker_grad(loss_fn, "data")(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    eval_params = state.anchor               # theta_sync, the synchronised model

**Warm start** (``warmup=N``): the DiLoCo paper starts its workers from a pre-trained
model. With ``warmup`` the first ``N`` steps are synchronous data parallelism: every
worker's gradient is averaged by a dense float32 all-reduce (``reduce``) before the inner
optimizer steps on it, so every worker takes the same step, and ``theta_sync`` follows the
parameters. DiLoCo's periods start at step ``N`` from the model reached: the anchor is
that model, the outer optimizer and the aggregators' error feedback are as initialised
(they never ran), and the inner optimizer keeps the state (and step count, e.g. of a
learning-rate schedule) it built during the warm start.

The ``lax.switch`` over the step's kind is named :data:`DILOCO_SCOPE` for
:func:`jaxcomm.wire_audit`'s ``branches=`` (:func:`diloco_branch` gives a step's branch);
the warm start's all-reduce sits in a ``lax.switch`` named :data:`DILOCO_WARMUP_SCOPE`
(branch 1 on warm-start steps, 0 after; :func:`diloco_branches` gives both).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomm._src._checks import check_choice, check_float, check_int
from jaxcomm._src.aggregate import DENSE_REDUCE, dense_all_reduce, worker_state
from jaxcomm._src.collectives import as_varying, replicated
from jaxcomm._src.dreamddp import Schedule, as_schedule
from jaxcomm._src.localsgd import Layers, _join_layers, layer_names
from jaxcomm._src.network import CommLog, empty_log
from jaxcomm._src.worker import TreeLayout, check_grads, check_layout, init_layout, layout_of

__all__ = [
    "DILOCO_SCOPE",
    "DILOCO_WARMUP_SCOPE",
    "DiLoCoState",
    "diloco",
    "diloco_branch",
    "diloco_branches",
    "diloco_steps",
    "streaming_schedule",
]

# jax.named_scope of the lax.switch over the step's kind (a ``branches=`` key).
DILOCO_SCOPE = "diloco_sync"
# jax.named_scope of the warm start's lax.switch (0: pass the gradient, 1: average it).
DILOCO_WARMUP_SCOPE = "diloco_warmup"

PATTERNS = ("strided", "sequential")


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`. Inside ``shard_map``, ``count``, ``anchor`` and ``outer``
    are typed as replicated over the workers (one copy, ``P()``, may hold them) and
    ``inner`` and ``reduce`` as per worker; the whole state may also be kept one row per
    worker (``P(axis)``).

    Attributes:
      inner: the inner optimizer's state, local to this worker.
      count: ``int32`` scalar, inner steps taken so far.
      anchor: ``theta_sync``, the synchronised parameters (float32, the parameters'
        structure); identical on every worker.
      outer: one outer-optimizer state per fragment (identical on every worker).
      reduce: one aggregator state per fragment (its error feedback is per worker); the
        logs in them are what this step sent (empty for fragments not synchronised). With
        a warm start (``warmup > 0``) one more, last: the warm start's all-reduce, whose
        log is what a warm-start step sent.
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.TreeLayout`).
    """

    inner: Any
    count: jax.Array
    anchor: Any
    outer: tuple
    reduce: tuple
    layout: TreeLayout


def streaming_schedule(
    num_layers: int, period: int, fragments: int, *, pattern: str = "strided"
) -> Schedule:
    """Streaming DiLoCo's schedule: ``groups[h]`` holds the layers of the fragment
    synchronised at local step ``h``; fragment ``p`` (0-based) at ``(p + 1) * period //
    fragments - 1``, so the last one at the period's end, as plain DiLoCo.

    Args:
      num_layers: layers, input (0) to output.
      period: ``H >= 1`` inner steps between two synchronisations of a fragment.
      fragments: ``1 <= F <= min(num_layers, period)``.
      pattern: ``"strided"`` (fragment ``p`` = layers ``p, p + F, ...``) or
        ``"sequential"`` (contiguous runs, the larger ones first).
    """
    n = check_int("num_layers", num_layers, lo=1)
    period = check_int("period", period, lo=1)
    fragments = check_int("fragments", fragments, lo=1)
    check_choice("pattern", pattern, PATTERNS)
    if fragments > n:
        raise ValueError(
            f"fragments={fragments} exceeds the model's {n} layers; each fragment needs at "
            f"least one layer: choose fragments in 1..{n}"
        )
    if fragments > period:
        raise ValueError(
            f"fragments={fragments} exceeds period={period}: two fragments would share a step "
            f"and the peak traffic would not fall; choose fragments in 1..{min(n, period)}"
        )
    if pattern == "strided":
        members = [list(range(p, n, fragments)) for p in range(fragments)]
    else:
        q, r = divmod(n, fragments)
        members, start = [], 0
        for p in range(fragments):
            size = q + (1 if p < r else 0)
            members.append(list(range(start, start + size)))
            start += size
    groups: list[tuple[int, ...]] = [()] * period
    for p, layers in enumerate(members):
        groups[(p + 1) * period // fragments - 1] = tuple(sorted(layers, reverse=True))
    return Schedule(tuple(groups), n)


def _fragments(schedule: Schedule) -> tuple[list[tuple[int, ...]], list[int]]:
    """The fragments (non-empty groups, by step) and each one's step; each layer must be in
    exactly one group."""
    frags, steps, seen = [], [], {}
    for h, g in enumerate(schedule.groups):
        if not g:
            continue
        for layer in g:
            if layer in seen:
                raise ValueError(
                    f"schedule synchronises layer {layer} at steps {seen[layer]} and {h}; a "
                    "DiLoCo fragment has one theta_sync and one outer state, so each layer "
                    "must be in exactly one group (build it with fill_bubbles=False, or use "
                    "jaxcomm.schedules.streaming_schedule)"
                )
            seen[layer] = h
        frags.append(tuple(g))
        steps.append(h)
    return frags, steps


def _kinds(period: int, steps: list[int], overlap: int) -> tuple[list[tuple], list[int]]:
    """Distinct step kinds ``(synced fragment or -1, merged fragments)`` and each local
    step's kind."""
    kinds: list[tuple] = []
    index = []
    for h in range(period):
        sync = steps.index(h) if h in steps else -1
        merges = tuple(p for p, s in enumerate(steps) if (s + overlap) % period == h)
        kind = (sync, merges)
        if kind not in kinds:
            kinds.append(kind)
        index.append(kinds.index(kind))
    return kinds, index


def _steps_schedule(period: int, schedule: Schedule | None, fragments: int) -> Schedule:
    """The schedule that :func:`diloco` with these arguments synchronises by (its sync
    steps depend on the fragment count, not on the layers)."""
    fragments = check_int("fragments", fragments, lo=1, hi=period)
    if schedule is not None:
        if fragments != 1:
            raise ValueError(
                f"give either schedule or fragments, got schedule={schedule!r} and "
                f"fragments={fragments}"
            )
        return as_schedule(schedule)
    return streaming_schedule(fragments, period, fragments)


def diloco_branch(
    period: int,
    step: int,
    *,
    fragments: int = 1,
    schedule: Schedule | None = None,
    overlap: int = 0,
    warmup: int = 0,
) -> int:
    """The :data:`DILOCO_SCOPE` branch that 0-based step ``step`` takes (for ``branches=``);
    ``fragments`` or ``schedule``, ``overlap`` and ``warmup`` as given to :func:`diloco`.
    A warm-start step takes the last branch (one after the period's kinds)."""
    sched = _steps_schedule(period, schedule, fragments)
    _, steps = _fragments(sched)
    kinds, index = _kinds(len(sched.groups), steps, overlap)
    step = check_int("step", step, lo=0)
    warmup = check_int("warmup", warmup, lo=0)
    if step < warmup:
        return len(kinds)
    return index[(step - warmup) % period]


def diloco_branches(
    period: int,
    step: int,
    *,
    fragments: int = 1,
    schedule: Schedule | None = None,
    overlap: int = 0,
    warmup: int = 0,
) -> dict[str, int]:
    """``branches=`` for :func:`jaxcomm.wire_audit` of a step of :func:`diloco` (0-based
    ``step``): :data:`DILOCO_SCOPE`'s branch and, with a warm start,
    :data:`DILOCO_WARMUP_SCOPE`'s (1 while ``step < warmup``, else 0)."""
    out = {
        DILOCO_SCOPE: diloco_branch(
            period, step, fragments=fragments, schedule=schedule, overlap=overlap, warmup=warmup
        )
    }
    if warmup:
        out[DILOCO_WARMUP_SCOPE] = int(step < warmup)
    return out


def diloco_steps(
    period: int, *, fragments: int = 1, schedule: Schedule | None = None, overlap: int = 0
) -> list[tuple[int, tuple[int, ...]]]:
    """For each local step ``h`` of a period: ``(fragment synchronised or -1, fragments
    merged)`` (a merge at step ``t`` happens only once ``t >= overlap``); ``fragments`` or
    ``schedule`` and ``overlap`` as given to :func:`diloco`. With a warm start of ``N``
    steps, step ``t >= N`` is local step ``(t - N) mod period`` (and a merge needs
    ``t - N >= overlap``)."""
    sched = _steps_schedule(period, schedule, fragments)
    _, steps = _fragments(sched)
    kinds, index = _kinds(len(sched.groups), steps, overlap)
    return [kinds[i] for i in index]


def _quiet(state: Any) -> Any:
    """An aggregator state with its logs emptied (it sent nothing this step)."""
    return jax.tree_util.tree_map(
        lambda x: empty_log() if isinstance(x, CommLog) else x,
        state,
        is_leaf=lambda x: isinstance(x, CommLog),
    )


def _f32(tree: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), tree)


def _is_transform(tx: Any) -> bool:
    return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


def diloco(
    inner: optax.GradientTransformation,
    axis_name: Any,
    *,
    period: int,
    outer: optax.GradientTransformation | None = None,
    layers: Layers = None,
    fragments: int = 1,
    pattern: str | None = None,
    schedule: Schedule | Sequence[Sequence[int]] | None = None,
    overlap: int = 0,
    alpha: float | None = None,
    aggregate: optax.GradientTransformation | None = None,
    reduce: str | None = None,
    warmup: int = 0,
) -> optax.GradientTransformation:
    """DiLoCo / Streaming DiLoCo around ``inner`` (see the module docstring).

    Args:
      inner: the optimizer each worker steps locally (its state stays local).
      axis_name: the data-parallel mesh axis (inside ``jax.shard_map``).
      period: ``H >= 1`` inner steps between two synchronisations (of each fragment).
        ``period=1`` with ``outer=optax.sgd(1.0)`` averages the workers' steps every step:
        for SGD and momentum SGD that is synchronous data parallelism exactly (for Adam it
        averages the workers' Adam steps).
      outer: the outer optimizer (any ``optax`` transform) fed ``delta`` as its gradient;
        default ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      layers: layer names, input to output (top-level parameter keys, see
        :func:`jaxcomm.local_sgd`); needed for ``fragments > 1`` and ``schedule``. The
        updates and ``state.anchor`` keep the parameters' structure (a dict, a Linen
        ``FrozenDict``, an ``nnx.State``: the same treedef).
      fragments: ``F``, fragments synchronised at staggered steps
        (:func:`streaming_schedule`); 1 is plain DiLoCo.
      pattern: ``"strided"`` (default) or ``"sequential"`` fragments.
      schedule: instead of ``fragments``/``pattern``: a :class:`jaxcomm.schedules.Schedule` (or
        groups of layer indices) of ``period`` steps whose non-empty groups are the
        fragments, each layer in exactly one.
      overlap: ``tau`` in ``[0, period)``: inner steps between a fragment's
        synchronisation and its merge.
      alpha: the merge's weight on the local parameters, in ``[0, 1)``; default 0.5 with
        ``overlap > 0`` (the Streaming DiLoCo paper's), else 0 (take ``theta_sync``). With
        ``overlap=0`` and ``alpha > 0`` the workers keep part of their own drift at every
        synchronisation (the paper's mixing without the delay).
      aggregate: a jaxcomm aggregator over ``axis_name`` that averages the pseudo-gradient
        (default :func:`jaxcomm.dense_all_reduce` with ``reduce``); one state per fragment.
      reduce: the default aggregator's all-reduce: ``ring`` (default), ``tree`` or
        ``psum``; not with ``aggregate``. The warm start's all-reduce is the same.
      warmup: ``N >= 0`` steps of synchronous data parallelism before the first period
        (see the module docstring): each step averages the workers' gradients with a
        dense float32 all-reduce before the inner optimizer, and ``theta_sync`` follows
        the parameters; the periods count from step ``N``.

    Between synchronisations every worker's parameters differ: keep them per worker
    (``out_specs=P(axis_name)`` from ``shard_map``), never ``P()``.

    Returns:
      A ``GradientTransformation`` with :class:`DiLoCoState`; its updates are added to
      this worker's parameters. ``state.anchor`` is the synchronised model.

    References:
      DiLoCo (arXiv 2311.08105), Algorithm 1; Streaming DiLoCo (arXiv 2501.18512), Sec. 2.
    """
    period = check_int("period", period, lo=1)
    for name, tx in (("inner", inner), ("outer", outer), ("aggregate", aggregate)):
        if (tx is not None or name == "inner") and not _is_transform(tx):
            raise TypeError(
                f"{name} must be an optax.GradientTransformation (with init and update), "
                f"got {tx!r} of type {type(tx).__name__}"
            )
    overlap = check_int("overlap", overlap, lo=0, hi=period - 1)
    if alpha is None:
        alpha = 0.5 if overlap else 0.0
    alpha = check_float("alpha", alpha, lo=0.0, hi=1.0, hi_open=True)
    if reduce is not None and aggregate is not None:
        raise ValueError(
            f"reduce={reduce!r} picks the default aggregator's all-reduce, but aggregate= "
            "was given: set the reduction on that aggregator instead"
        )
    reduce = "ring" if reduce is None else reduce
    check_choice("reduce", reduce, DENSE_REDUCE)
    if pattern is not None and schedule is not None:
        raise ValueError(
            f"pattern={pattern!r} shapes the fragments that fragments= makes, but schedule= "
            "was given: the schedule's groups are the fragments"
        )
    pattern = "strided" if pattern is None else pattern
    check_choice("pattern", pattern, PATTERNS)
    fragments = check_int("fragments", fragments, lo=1)
    if schedule is not None and fragments != 1:
        raise ValueError(
            f"give either schedule or fragments, got schedule={schedule!r} and "
            f"fragments={fragments}"
        )
    if schedule is not None and len(as_schedule(schedule).groups) != period:
        raise ValueError(
            f"schedule has {len(as_schedule(schedule).groups)} steps, but period={period}; "
            "its groups must cover one period"
        )
    if layers is None and fragments > 1:
        raise ValueError(
            f"fragments={fragments} splits the model by layers: pass layers= (the top-level "
            "parameter keys, input to output)"
        )
    warmup = check_int("warmup", warmup, lo=0)
    outer = outer if outer is not None else optax.sgd(0.7, momentum=0.9, nesterov=True)
    agg = aggregate if aggregate is not None else dense_all_reduce(axis_name, reduce=reduce)
    # The warm start's all-reduce of the gradients (float32, the default aggregator's).
    warm_agg = dense_all_reduce(axis_name, reduce=reduce) if warmup else None

    def plan(params):
        names = layer_names(params, layers)
        split_by_layers = schedule is not None and as_schedule(schedule).num_layers > 1
        if names is None and (fragments > 1 or split_by_layers):
            raise ValueError(
                f"fragments={fragments} / schedule={schedule!r} split the model by layers: "
                "pass layers= (the top-level parameter keys, input to output)"
            )
        num = 1 if names is None else len(names)
        sched = (
            as_schedule(schedule, num)
            if schedule is not None
            else streaming_schedule(num, period, fragments, pattern=pattern)
        )
        frags, steps = _fragments(sched)
        return names, frags, steps

    def split(tree, names, frags):
        if names is None:
            return [tree]
        return [{names[i]: tree[names[i]] for i in sorted(f)} for f in frags]

    def join(parts, names, like):
        # ``like``'s own structure (an nnx.State stays one), filled from the parts' leaves
        if names is None:
            return parts[0]
        by_layer = [None] * len(names)
        for part in parts:
            for name, tree in part.items():
                by_layer[names.index(name)] = tree
        return _join_layers(by_layer, names, like)

    def _typed(u_parts, anchors, outers, reduces):
        # What every worker holds bit for bit (theta_sync, the outer states: computed from
        # the all-reduced mean) is typed so; the updates and error feedback are per worker.
        shared = replicated((anchors, outers), axis_name)
        return (as_varying(u_parts, axis_name), *shared, as_varying(reduces, axis_name))

    def init_fn(params):
        layout, _ = init_layout("diloco", params)
        names, frags, _ = plan(params)
        anchor = _f32(params)
        parts = split(anchor, names, frags)
        reduce = tuple(_quiet(agg.init(p)) for p in parts)
        return DiLoCoState(
            inner=worker_state(inner.init(params), axis_name),
            count=replicated(jnp.zeros([], jnp.int32), axis_name),
            anchor=replicated(anchor, axis_name),
            outer=replicated(tuple(outer.init(p) for p in parts), axis_name),
            reduce=worker_state(reduce + ((_quiet(warm_agg.init(params)),) if warmup else ()),
                                axis_name),
            layout=layout,
        )  # fmt: skip

    def update_fn(grads, state, params=None):
        if params is None:
            raise ValueError("diloco needs params: call tx.update(grads, state, params)")
        check_grads("diloco", grads, axis_name)
        check_layout("diloco", state.layout, layout_of(grads))
        names, frags, steps = plan(params)
        kinds, kind_of = _kinds(period, steps, overlap)
        # The fragments' aggregator states, and the warm start's all-reduce state after them.
        frag_reduce = list(state.reduce[: len(frags)])
        warm_reduce = list(state.reduce[len(frags) :])
        if warmup:
            # Warm start: every worker steps on the mean gradient (a dense all-reduce),
            # afterwards on its own; a switch, so the bytes go out on warm steps only.
            def own(operand):
                g, s = operand
                return as_varying((g, _quiet(s)), axis_name)

            def average(operand):
                g, s = operand
                return as_varying(warm_agg.update(g, s), axis_name)

            with jax.named_scope(DILOCO_WARMUP_SCOPE):
                warm = state.count < warmup
                grads, warm_reduce[0] = lax.switch(
                    warm.astype(jnp.int32), [own, average], (grads, warm_reduce[0])
                )
        inner_updates, inner_state = inner.update(grads, state.inner, params)
        local = optax.apply_updates(params, inner_updates)
        # Steps since the periods began (the warm start's steps are not in a period).
        local_count = state.count - warmup
        ready = local_count >= overlap  # a merge needs its synchronisation to have happened

        def branch(kind):
            sync, merges = kind

            def run(operand):
                p_parts, u_parts, l_parts, anchors, outers, reduces = map(list, operand)
                reduces = [_quiet(r) for r in reduces]
                if sync >= 0:
                    # delta_w = theta_sync - theta_w, in float32.
                    delta = jax.tree_util.tree_map(
                        lambda a, w: a - w.astype(jnp.float32), anchors[sync], l_parts[sync]
                    )
                    mean, reduces[sync] = agg.update(delta, reduces[sync], anchors[sync])
                    step, outers[sync] = outer.update(mean, outers[sync], anchors[sync])
                    anchors[sync] = optax.apply_updates(anchors[sync], step)
                for p in merges:

                    def mix(p_, u, w, a):
                        merged = (alpha * w.astype(jnp.float32) + (1.0 - alpha) * a).astype(w.dtype)
                        return jnp.where(ready, (merged - p_).astype(u.dtype), u)

                    u_parts[p] = jax.tree_util.tree_map(
                        mix, p_parts[p], u_parts[p], l_parts[p], anchors[p]
                    )
                return _typed(u_parts, anchors, outers, reduces)

            return run

        def warm_branch(operand):
            # theta_sync follows the (identical) parameters; nothing synchronises.
            _, u_parts, l_parts, _, outers, reduces = map(list, operand)
            anchors = [_f32(part) for part in l_parts]
            reduces = [_quiet(r) for r in reduces]
            return _typed(u_parts, anchors, outers, reduces)

        p_parts = split(params, names, frags)
        operand = (
            p_parts,
            split(inner_updates, names, frags),
            split(local, names, frags),
            split(state.anchor, names, frags),
            list(state.outer),
            frag_reduce,
        )
        with jax.named_scope(DILOCO_SCOPE):
            table = jnp.asarray(kind_of, jnp.int32)
            branches = [branch(k) for k in kinds]
            if warmup:
                index = jnp.where(warm, len(kinds), table[jnp.maximum(local_count, 0) % period])
                branches.append(warm_branch)
            else:
                index = table[state.count % period]
            u_parts, anchors, outers, reduces = lax.switch(index, branches, operand)
        updates = join(u_parts, names, params)
        anchor = join(anchors, names, state.anchor)
        new_state = DiLoCoState(
            worker_state(inner_state, axis_name),
            replicated(state.count + 1, axis_name),
            anchor,
            tuple(outers),
            worker_state(tuple(reduces) + tuple(warm_reduce), axis_name),
            state.layout,
        )
        return updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)
