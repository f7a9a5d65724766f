"""Per-worker state on a different number of workers: the rules that fold or split it.

A data-parallel run keeps its per-worker state stacked over workers: every array of it has
a leading axis of ``N`` rows, one per worker (aggregator state; the parameters and optimizer
state of local SGD and DiLoCo between averages). What every worker holds bit for bit
(synchronous parameters and optimizer state, DiLoCo's anchor) is one copy and does not
depend on ``N``. To continue a run on ``N'`` workers (a machine lost, or one added), each
stacked array needs ``N'`` rows, and what goes in them depends on what the array means.
:func:`resize_workers` maps a stacked state by two rules, ``segments`` for the fields that
:data:`RULES` names and ``replica`` for every other, and states what each keeps:

* ``replica``, every field without a rule of its own. Rows bitwise identical on every
  worker (counters, the shared PRNG key) are kept bit for bit. Rows that differ become
  their mean over the old workers. For local SGD's and DiLoCo's replicas and their inner
  optimizer states between two averages, the new workers start from the **averaged
  model**, which is what the next averaging would have produced from them. For the
  error-feedback residuals (``ErrorFedState.residual`` of :func:`jaxcomm.error_fed` and
  the aggregators built on it, ``TopKState.residual``, ``EFSignState.error``,
  ``MarsitState.compensation``, SSDM's momentum) the mean is also the right rule: every
  aggregator here applies the **mean** over workers of what they send, so what the
  residuals still owe the model is ``(1/N) sum_i e_i``, and with each new worker holding
  that mean, ``(1/N') sum_j e'_j = (1/N) sum_i e_i``: the pending correction, in the
  model's units, is unchanged and nothing is dropped. (Summing and spreading, ``e'_j =
  sum_i e_i / N'``, would scale it by ``N / N'``.) Integer rows that differ cannot be
  averaged and are refused.
* ``segments``: ``ErrorFedState.server_error``, where worker ``i`` owns segment ``i`` of
  the flattened model (whose length is the last axis of a field beside it, the
  residual). The old segments are joined in worker order into one vector (their padding
  dropped) and cut again into ``N'`` segments: the joined vector is unchanged bit for bit.

The traffic logs inside aggregator states (:class:`~jaxcomm.network.CommLog`, what the last
step sent, rewritten by the next) restart empty.

Everything here runs on the host, on NumPy arrays of the whole state (a restore reads each
array whole). Averages are taken in float64 and rounded once to the array's dtype.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src._checks import check_int
from jaxcomm._src.error_fed import ErrorFedState
from jaxcomm._src.network import CommLog, empty_log

__all__ = ["RULES", "Resized", "resize_workers", "register_resize_rule", "resize_rule_of"]

#: The segment fields of the state types that have them (see the module): ``{state type:
#: {segments field: the field beside it whose last axis is the whole length}}``.
RULES: dict[type, dict[str, str]] = {ErrorFedState: {"server_error": "residual"}}


def register_resize_rule(state_type: type, **segments: str) -> None:
    """Give a NamedTuple state type (a custom aggregator's) its ``segments`` fields:
    ``register_resize_rule(MyState, server_error="residual")`` cuts ``server_error`` again
    as segments of a vector as long as ``residual``'s last axis. Every other field
    (per-worker residuals included) follows ``replica``, which needs no rule.

    The earlier spelling, a rule kind per field (``residual="pending",
    server_error="segments"``), still works for one release with a ``FutureWarning``:
    ``"pending"`` and ``"replica"`` ran ``replica``'s code and are ignored, and a
    ``"segments"`` field takes its length from the ``"pending"`` field beside it."""
    if not (isinstance(state_type, type) and hasattr(state_type, "_fields")):
        raise TypeError(f"state_type must be a NamedTuple class, got {state_type!r}")
    fields = state_type._fields
    for name in segments:
        if name not in fields:
            raise ValueError(
                f"{state_type.__name__} has no field {name!r}; its fields are {list(fields)}"
            )
    kinds = {k: v for k, v in segments.items() if v in ("replica", "pending", "segments")}
    if kinds:
        warnings.warn(
            f"register_resize_rule({state_type.__name__}, "
            + ", ".join(f"{k}={v!r}" for k, v in kinds.items())
            + "): rule kinds are the earlier spelling; 'replica' and 'pending' are ignored "
            "(every field is resized so already) and will go; name a segments field's "
            "length field instead (server_error='residual')",
            FutureWarning,
            stacklevel=2,
        )
    pending = [k for k, v in kinds.items() if v == "pending"]
    rules = {}
    for name, beside in segments.items():
        if beside in ("replica", "pending"):
            continue
        if beside == "segments":
            if not pending:
                raise ValueError(
                    f"{name!r}='segments' needs a 'pending' field beside it for its length "
                    f"(or name the length field: {name}='<field>')"
                )
            beside = pending[0]
        if beside not in fields:
            raise ValueError(
                f"{state_type.__name__} has no field {beside!r} (the length of {name!r}); "
                f"its fields are {list(fields)}"
            )
        if beside == name:
            raise ValueError(f"{name!r} cannot be segments of its own length")
        rules[name] = beside
    if rules:
        RULES[state_type] = rules
    else:
        RULES.pop(state_type, None)


def resize_rule_of(node: Any, field: str) -> str:
    """The rule (``replica`` or ``segments``) of ``field`` of state ``node``."""
    return "segments" if field in RULES.get(type(node), {}) else "replica"


class Resized(NamedTuple):
    """What :func:`resize_workers` returns.

    Attributes:
      state: the state with ``workers`` rows in every array.
      notes: ``{key path: what was done}`` for every array whose rows were not all equal
        (the arrays kept bit for bit are not listed).
    """

    state: Any
    notes: dict[str, str]


def _equal_rows(a: np.ndarray) -> bool:
    """Whether every row of ``a`` holds the same bits (NaN included)."""
    if a.shape[0] < 2:
        return True
    flat = np.ascontiguousarray(a).reshape(a.shape[0], -1)
    return bool((flat.view(np.uint8) == flat.view(np.uint8)[:1]).all())


def _rows(a: np.ndarray, workers: int) -> np.ndarray:
    return np.broadcast_to(a, (workers, *a.shape)).copy()


def _mean(a: np.ndarray, workers: int, path: str) -> np.ndarray:
    if not jnp.issubdtype(a.dtype, jnp.floating):  # (NumPy's check misses bfloat16)
        raise ValueError(
            f"{path}: its {a.shape[0]} workers hold different {a.dtype} rows, which cannot be "
            "averaged onto another number of workers; give its state type a rule with "
            "jaxcomm.elastic.register_resize_rule"
        )
    return _rows(a.astype(np.float64).mean(0).astype(a.dtype), workers)


def _segments(a: np.ndarray, length: int, workers: int) -> np.ndarray:
    """``a``: ``[N, *mid, s]`` segments of vectors of ``length`` (worker ``i`` holds segment
    ``i``) cut again into ``workers`` segments: ``[workers, *mid, ceil(length / workers)]``."""
    n, *mid, s = a.shape
    joined = np.moveaxis(a, 0, -2).reshape(*mid, n * s)[..., :length]
    seg = -(-length // workers)
    padded = np.zeros((*mid, workers * seg), a.dtype)
    padded[..., :length] = joined
    return np.moveaxis(padded.reshape(*mid, workers, seg), -2, 0)


def resize_workers(state: Any, workers: int) -> Resized:
    """Map a per-worker state stacked over ``N`` workers (every array ``[N, ...]``, NumPy or
    JAX) to ``workers`` rows by the rules of the module docstring.

    Returns a :class:`Resized`: the new state (NumPy arrays, the same tree structure) and a
    note per array that was averaged or re-cut. Raises ``ValueError`` naming the array when
    arrays disagree on ``N``, when a field needs a rule it does not have (integer rows that
    differ), or when a ``segments`` field's length cannot be found.
    """
    workers = check_int("workers", workers, lo=1)
    leaves = jax.tree_util.tree_leaves(state)
    if not leaves:
        return Resized(state, {})
    counts = {np.shape(a)[0] if np.ndim(a) else None for a in leaves}
    if len(counts) != 1 or None in counts:
        raise ValueError(
            "state must have a leading worker axis of one size on every array, got leading "
            f"sizes {sorted(str(c) for c in counts)}"
        )
    (old,) = counts
    notes: dict[str, str] = {}

    def leaf(path: Any, a: Any, length: int | None = None) -> np.ndarray:
        a = np.asarray(a)
        name = jax.tree_util.keystr(path)
        if length is not None:
            notes[name] = f"segments of {old} workers joined and cut into {workers}"
            return _segments(a, length, workers)
        if _equal_rows(a):
            return _rows(a[0], workers)
        notes[name] = f"averaged: the mean of {old} workers' rows on each of {workers}"
        return _mean(a, workers, name)

    def node(path: tuple, x: Any) -> Any:
        rules = RULES[type(x)]
        out = {}
        for f in x._fields:
            here = (*path, jax.tree_util.GetAttrKey(f))
            sub = getattr(x, f)
            if sub is None:  # a field this configuration leaves unused
                out[f] = None
            elif f in rules:
                whole = getattr(x, rules[f])
                if whole is None:
                    raise ValueError(
                        f"{jax.tree_util.keystr(here)}: its length field {rules[f]!r} is unset"
                    )
                out[f] = leaf(here, sub, np.shape(whole)[-1])
            else:
                out[f] = walk(here, sub)
        return type(x)(**out)

    def log(x: CommLog) -> CommLog:
        # What the last step sent, rewritten by the next one: an empty log on the new world.
        return CommLog(
            *(
                np.broadcast_to(np.asarray(e), (workers, *np.shape(a)[1:])).copy()
                for e, a in zip(empty_log(), x, strict=True)
            )
        )

    def walk(path: tuple, tree: Any) -> Any:
        def visit(sub_path, x):
            full = (*path, *sub_path)
            if type(x) is CommLog:
                return log(x)
            if type(x) in RULES:
                return node(full, x)
            return leaf(full, x)

        special = lambda x: type(x) in RULES or type(x) is CommLog  # noqa: E731
        return jax.tree_util.tree_map_with_path(visit, tree, is_leaf=special)

    return Resized(walk((), state), notes)
