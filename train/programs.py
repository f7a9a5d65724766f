"""What every layout's step programs share: abstract shapes, the checks a compiled program
passes before it runs, finite flags, and the host's reads of a step's outputs."""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.network import find_logs
from jaxcomm._src.sparse import TopKState

__all__ = [
    "AXIS",
    "structs",
    "costed",
    "checked",
    "host_metrics",
    "host_finite",
    "all_finite",
    "ready_at",
    "state_report",
    "squeeze",
    "expand",
    "row_specs",
    "varying_rows",
]

#: The mesh axis over data replicas (workers), in every layout.
AXIS = "data"


def structs(tree: Any, sharding: Any, lead: tuple[int, ...] = ()) -> Any:
    """``tree``'s arrays (or shapes) as ``jax.ShapeDtypeStruct`` with ``sharding``, with
    ``lead`` axes prepended."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype, sharding=sharding), tree
    )


def squeeze(tree: Any, rows: Any = None) -> Any:
    """Drop the leading (per-worker) axis of every leaf, ``[1, ...]`` to ``[...]``; with
    ``rows`` (a tree of bools of ``tree``'s structure), only of the leaves marked True."""
    if rows is None:
        return jax.tree_util.tree_map(lambda a: a[0], tree)
    return jax.tree_util.tree_map(lambda a, r: a[0] if r else a, tree, rows)


def expand(tree: Any, rows: Any = None) -> Any:
    """Add a leading (per-worker) axis to every leaf, ``[...]`` to ``[1, ...]``; with
    ``rows``, only to the leaves marked True."""
    if rows is None:
        return jax.tree_util.tree_map(lambda a: a[None], tree)
    return jax.tree_util.tree_map(lambda a, r: a[None] if r else a, tree, rows)


def row_specs(rows: Any) -> Any:
    """``shard_map`` specs of a state whose leaves marked True in ``rows`` hold one row per
    worker (``P(AXIS)``); the others are one copy on every worker (``P()``)."""
    return jax.tree_util.tree_map(lambda r: P(AXIS) if r else P(), rows)


def varying_rows(tree: Any) -> Any:
    """Inside ``shard_map`` (``check_vma=True``): a tree of bools, True where a leaf of
    ``tree`` is typed as differing between workers."""

    def vary(a: Any) -> bool:
        t = jax.typeof(a)
        mat = getattr(t, "manual_axis_type", None)  # JAX 0.10
        axes = mat.varying if mat is not None else getattr(t, "vma", frozenset())
        return AXIS in axes

    return jax.tree_util.tree_map(vary, tree)


def costed(program: Any) -> jaxcomm.audit.ProgramCost:
    """:func:`jaxcomm.audit.program_cost` of ``program``, warning loudly when it holds custom calls
    whose flops nothing can cost (a GPU backend's own kernels other than cuBLAS and cuDNN):
    their memory traffic is in the simulated time, their arithmetic is not."""
    cost = jaxcomm.audit.program_cost(program)
    if cost.uncounted:
        names = ", ".join(cost.uncounted[:5]) + (" ..." if len(cost.uncounted) > 5 else "")
        warnings.warn(
            f"{len(cost.uncounted)} custom call(s) of the step have no flop count ({names}): "
            "their flops are missing from the modelled compute time (their memory bytes are "
            "counted)",
            UserWarning,
            stacklevel=2,
        )
    return cost


def checked(program: Any, where: str = "the training step") -> Any:
    """``program`` after :func:`jaxcomm.check_logged_traffic`: a compiled step whose
    collectives are not all in the traffic logs (so not in the simulated time) is an error
    here, before it runs."""
    jaxcomm.check_logged_traffic(program, where=where)
    return program


def host_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Per-device metrics (``{name: [devices...]}``, from the step's outputs) averaged on
    the host: the step sends no bytes for them."""
    return {k: float(np.mean(np.asarray(v, np.float64))) for k, v in metrics.items()}


def host_finite(*flags: Any) -> bool:
    """Whether every device's finite flag (int or bool arrays, from the step's programs)
    is set."""
    return all(bool(np.all(np.asarray(f))) for f in flags)


def all_finite(tree: Any) -> jax.Array:
    """A scalar bool: every element of every leaf of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree_util.tree_leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def ready_at(tree: Any) -> float:
    """Block until ``tree``'s arrays are ready; ``time.perf_counter()`` then."""
    jax.block_until_ready(tree)
    return time.perf_counter()


def state_report(opt_state: Any) -> dict[str, Any]:
    """What the host reads of a step's optimizer state: its traffic logs and a top-k
    aggregator's gain and root (the first one's)."""
    from jaxcomm._src.diloco import DiLoCoState

    def stop(x: Any) -> bool:
        return isinstance(x, (TopKState, DiLoCoState))

    # A top-k aggregator inside DiLoCo runs only at its fragment's synchronisations: its
    # gain and root would be stale on the other steps, so they are not reported.
    topk = [
        (s.gain, s.root)
        for s in jax.tree.leaves(opt_state, is_leaf=stop)
        if isinstance(s, TopKState)
    ]
    return {"logs": find_logs(opt_state), "topk": topk[:1]}
