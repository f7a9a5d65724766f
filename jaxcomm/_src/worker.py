"""This worker's own gradient inside ``jax.shard_map``, and the checks every aggregator
makes on the gradient it is handed.

Parameters that enter ``jax.shard_map`` replicated (``in_specs=P()``) are typed as the same
on every worker. When ``jax.grad`` differentiates a loss that combines them with this
worker's data, JAX transposes that implicit "same on every worker" cast into a ``psum``: the
gradient it returns is already the *sum* of every worker's gradient, identical everywhere,
and the compiled step carries a dense float32 all-reduce of the whole gradient before any
jaxcomm code runs. An aggregator then averages copies of the sum (updates ``N`` times too
large) and the traffic it exists to remove is still on the wire.

The one right way is to differentiate with respect to a per-worker view of the parameters::

    grads = jaxcomm.worker_grad(loss_fn, "data")(params, batch)     # this worker's own
    # the same as: jax.grad(loss_fn)(jaxcomm.varying(params, "data"), batch)

Every aggregator and sync wrapper checks, at trace time, that its gradient varies over its
axis (``shard_map``'s ``check_vma=True``, the default, records that in each value's type) and
raises a ``ValueError`` explaining the above otherwise. With ``check_vma=False`` (and under
``jax.pmap``) the type carries nothing to check: use :func:`worker_grad` there too.

Dtype policy, the same for every aggregator: gradients must be floating (``float16``,
``bfloat16``, ``float32``, ``float64``); integer, boolean and ``float0`` leaves are refused
with an error naming them (keep counters and other integer state out of the differentiated
parameters). Every codec and collective works in ``float32``; each update leaf is returned
in its gradient leaf's own dtype (``bfloat16`` parameters get ``bfloat16`` updates).

Aggregator state remembers the layout (tree structure and leaf shapes) of the parameters
``init`` saw, as a :class:`TreeLayout` with no array leaves; ``update`` with gradients of
another layout is an error naming both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomm._src._checks import axis_size
from jaxcomm._src.collectives import as_varying

__all__ = [
    "TreeLayout",
    "check_grads",
    "flatten_grads",
    "layout_of",
    "varying",
    "worker_grad",
    "worker_value_and_grad",
]


def _names(axis_name: Any) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def varying(tree: Any, axis_name: Any) -> Any:
    """``tree`` typed as differing between workers of ``axis_name`` (inside ``shard_map``).

    No data moves. Differentiate with respect to the result and ``jax.grad`` gives this
    worker's own gradient instead of the sum over workers (see the module docstring).

    Args:
      tree: a pytree of arrays, typically replicated parameters.
      axis_name: a mesh axis name or a tuple of names, bound by the enclosing ``shard_map``.
    """
    for name in _names(axis_name):
        axis_size(name)
    return as_varying(tree, tuple(_names(axis_name)) if len(_names(axis_name)) > 1 else axis_name)


def _argnums(argnums: int | Sequence[int]) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums or any(isinstance(a, bool) or not isinstance(a, int) or a < 0 for a in nums):
        raise ValueError(
            f"argnums must be a non-negative int or a sequence of them, got {argnums!r}"
        )
    return nums


def _with_varying(fun: Callable, axis_name: Any, nums: tuple[int, ...]) -> Callable:
    def wrapped(*args, **kwargs):
        if max(nums) >= len(args):
            raise ValueError(
                f"argnums={nums} but the function got {len(args)} positional arguments"
            )
        args = list(args)
        for i in nums:
            args[i] = varying(args[i], axis_name)
        return fun(*args, **kwargs)

    return wrapped


def worker_grad(
    fun: Callable, axis_name: Any, *, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """``jax.grad(fun)`` that gives this worker's own gradient inside ``shard_map``.

    The differentiated arguments are first typed as varying over ``axis_name``
    (:func:`varying`), so autodiff adds no hidden ``psum`` even when they entered
    ``shard_map`` replicated. Hand the result to any jaxcomm aggregator.

    Args:
      fun: the loss, e.g. ``loss_fn(params, batch) -> scalar``.
      axis_name: the data-parallel mesh axis.
      argnums, has_aux: as for ``jax.grad``.

    Example::

        def per_worker(params, opt_state, batch):        # params: in_specs=P()
            grads = jaxcomm.worker_grad(loss_fn, "data")(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
    """
    nums = _argnums(argnums)
    grad = jax.grad(fun, argnums=argnums, has_aux=has_aux)
    return _with_varying(grad, axis_name, nums)


def worker_value_and_grad(
    fun: Callable, axis_name: Any, *, argnums: int | Sequence[int] = 0, has_aux: bool = False
) -> Callable:
    """``jax.value_and_grad(fun)`` with this worker's own gradient (see :func:`worker_grad`);
    the value is this worker's loss."""
    nums = _argnums(argnums)
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)
    return _with_varying(vg, axis_name, nums)


# --------------------------------------------------------------------------- layout


@jax.tree_util.register_pytree_node_class
class TreeLayout:
    """The tree structure and leaf shapes of the parameters an aggregator's state was built
    for. A pytree node with no array leaves: it rides in the state's tree structure (so it
    costs nothing under ``jit`` and in checkpoints) and ``update`` compares it with the
    gradients' layout at trace time."""

    __slots__ = ("treedef", "shapes")

    def __init__(self, treedef: Any, shapes: tuple[tuple[int, ...], ...]):
        self.treedef = treedef
        self.shapes = shapes

    def tree_flatten(self):
        return (), (self.treedef, self.shapes)

    @classmethod
    def tree_unflatten(cls, aux, children):
        del children
        return cls(*aux)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TreeLayout)
            and self.treedef == other.treedef
            and self.shapes == other.shapes
        )

    def __hash__(self) -> int:
        return hash((self.treedef, self.shapes))

    @property
    def size(self) -> int:
        """Total number of elements."""
        return sum(math.prod(s) for s in self.shapes)

    def describe(self, limit: int = 6) -> str:
        """A short human-readable form: leaf count, size and the first leaves' paths."""
        dummy = jax.tree_util.tree_unflatten(self.treedef, [np.zeros(0)] * len(self.shapes))
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]
        items = [f"{p or '<root>'}: {tuple(s)}" for p, s in zip(paths, self.shapes, strict=True)]
        more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
        return (
            f"{len(self.shapes)} leaves, {self.size} elements {{{', '.join(items[:limit])}{more}}}"
        )

    def __repr__(self) -> str:
        return f"TreeLayout({self.describe()})"


def _register_flax_serialization() -> None:
    """A :class:`TreeLayout` holds no values: Flax's ``to_state_dict`` writes it as ``{}`` and
    ``from_state_dict`` keeps the target's (the structure comes from ``init``)."""
    try:
        from flax import serialization
    except ImportError:  # pragma: no cover - flax is a dependency
        return
    serialization.register_serialization_state(
        TreeLayout, lambda layout: {}, lambda target, state: target, override=True
    )


_register_flax_serialization()


def layout_of(tree: Any) -> TreeLayout:
    """The :class:`TreeLayout` of a pytree of arrays (or ``jax.ShapeDtypeStruct``)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return TreeLayout(treedef, tuple(tuple(int(d) for d in np.shape(x)) for x in leaves))


# --------------------------------------------------------------------------- checks


def _varying(x: Any) -> frozenset | None:
    """The mesh axes ``x`` is typed as varying over inside ``shard_map`` (None: this JAX
    does not type values so)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)  # JAX 0.10
    if mat is not None:
        return frozenset(mat.varying)
    vma = getattr(t, "vma", None)  # earlier JAX
    return None if vma is None else frozenset(vma)


def _vma_checked(axis_name: Any) -> bool:
    """Whether the enclosing ``shard_map`` types values by the axes they vary over
    (``check_vma=True``): probed on the index of an axis, which varies over it when the
    types are checked (public API only)."""
    name = _names(axis_name)[0]
    return bool(_varying(jax.lax.axis_index(name)))


def _leaf_paths(tree: Any, pick: Callable[[Any], bool]) -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [jax.tree_util.keystr(p) or "<root>" for p, x in flat if pick(x)]


def _short(paths: list[str], limit: int = 5) -> str:
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return ", ".join(paths[:limit]) + more


def check_grads(who: str, grads: Any, axis_name: Any) -> None:
    """Trace-time checks of the gradient pytree an aggregator is handed.

    ``axis_name`` is bound by ``jax.shard_map`` (not ``jax.vmap``); every leaf is floating;
    and under ``check_vma=True`` every leaf varies over every axis of ``axis_name``.
    Raises ``ValueError`` (``TypeError`` for dtypes) naming ``who``, the leaves and the fix.
    """
    names = _names(axis_name)
    for name in names:
        axis_size(name)
    leaves = jax.tree_util.tree_leaves(grads)
    if not leaves:
        raise ValueError(f"{who}: the gradient pytree has no leaves")
    bad = _leaf_paths(grads, lambda x: not jnp.issubdtype(jnp.result_type(x), jnp.floating))
    if bad:
        dtypes = sorted({str(jnp.result_type(x)) for x in leaves
                         if not jnp.issubdtype(jnp.result_type(x), jnp.floating)})  # fmt: skip
        raise TypeError(
            f"{who}: gradients must be floating (float16, bfloat16, float32 or float64); "
            f"the leaves {_short(bad)} are {', '.join(dtypes)}. Keep integer state out of the "
            "differentiated parameters"
        )
    if not _vma_checked(axis_name):
        return

    def invariant(x: Any) -> bool:
        varying = _varying(x)
        return varying is not None and any(n not in varying for n in names)

    same = _leaf_paths(grads, invariant)
    if same:
        ax = names[0] if len(names) == 1 else names
        raise ValueError(
            f"{who}: the gradient does not vary over axis {ax!r} (leaves {_short(same)}): it "
            f"is already the same on every worker. This happens when the parameters enter "
            f"jax.shard_map replicated (in_specs=P()) and jax.grad runs inside: autodiff then "
            f"sums the gradient over {ax!r} with a hidden dense all-reduce before any "
            f"aggregator runs. Take this worker's own gradient with "
            f"jaxcomm.worker_grad(loss_fn, {ax!r})(params, batch), or differentiate with "
            f"respect to jaxcomm.varying(params, {ax!r})"
        )


def check_layout(who: str, expected: TreeLayout, got: TreeLayout) -> None:
    """Raise when gradients of layout ``got`` meet state built for ``expected``."""
    if expected != got:
        raise ValueError(
            f"{who}: the state was built by init for parameters of {expected.describe()}, "
            f"but update got gradients of {got.describe()}; call init with parameters of the "
            "same structure and shapes as the gradients"
        )


def flatten_grads(
    who: str, grads: Any, axis_name: Any, layout: TreeLayout | None = None
) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """Check ``grads`` (:func:`check_grads`, and its layout against ``layout``) and fuse it
    into one ``f32[d]`` vector.

    Returns:
      ``(flat, unflatten)``: ``flat`` is ``f32[d]`` (leaves in tree order, row-major);
      ``unflatten(v)`` turns an ``[d]`` vector back into the gradients' structure, each leaf
      cast to that gradient leaf's own dtype.
    """
    check_grads(who, grads, axis_name)
    if layout is not None:
        check_layout(who, layout, layout_of(grads))
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves])
    shapes = [(x.shape, x.dtype) for x in leaves]

    def unflatten(v: jax.Array) -> Any:
        out, at = [], 0
        for shape, dtype in shapes:
            size = math.prod(shape)
            out.append(v[at : at + size].reshape(shape).astype(dtype))
            at += size
        return jax.tree_util.tree_unflatten(treedef, out)

    return flat, unflatten


def init_layout(who: str, params: Any) -> tuple[TreeLayout, int]:
    """``(layout, d)`` of the parameters ``init`` is given (every leaf must be floating)."""
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves:
        raise ValueError(f"{who}: the parameter pytree has no leaves")
    bad = _leaf_paths(params, lambda x: not jnp.issubdtype(jnp.result_type(x), jnp.floating))
    if bad:
        raise TypeError(
            f"{who}: parameters must be floating (float16, bfloat16, float32 or float64); the "
            f"leaves {_short(bad)} are not. Keep integer state out of the optimized parameters"
        )
    layout = layout_of(params)
    return layout, layout.size
