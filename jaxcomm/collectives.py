"""Ring, tree and broadcast collectives built from ``jax.lax.ppermute``.

Call these inside ``jax.shard_map`` (or ``pmap``) with ``axis_name`` bound. Shapes in the
docstrings are per device. One implementation serves every algorithm: the ring
reduce-scatter takes a per-hop ``combine`` (and an ``init`` that turns a local segment into
the first message), so a one-bit ring can merge packed sign words at each hop and a
quantized ring can decode, add and re-encode; the messages may be any pytree of arrays
(``uint8`` payloads included).

Ring steps run in ``lax.fori_loop``, so compile time does not grow with the ring size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm._checks import axis_size, check_int, is_concrete

__all__ = [
    "ring_reduce_scatter",
    "ring_all_gather",
    "ring_all_reduce",
    "tree_all_reduce",
    "broadcast",
    "split_segments",
    "join_segments",
    "as_varying",
]

Combine = Callable[[Any, jax.Array, jax.Array], Any]


def _ring_perm(n: int) -> list[tuple[int, int]]:
    return [(j, (j + 1) % n) for j in range(n)]


def _where(pred: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree_util.tree_map(lambda u, v: jnp.where(pred, u, v), a, b)


def as_varying(tree: Any, axis_name: Any) -> Any:
    """Mark every leaf as varying over ``axis_name`` (a name or a tuple of names).

    Under ``shard_map(check_vma=True)`` loop carries and ``lax.cond`` branches must agree on
    which values differ across devices; a constant (e.g. a zero message) is device-invariant
    until cast.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def cast(a):
        a = jnp.asarray(a)
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        if mat is None:
            return a
        missing = tuple(n for n in names if n not in mat.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree_util.tree_map(cast, tree)


def split_segments(x: jax.Array, n: int) -> jax.Array:
    """Flatten ``x`` and cut it into ``n`` equal segments ``[n, ceil(size / n)]``, zero-padded."""
    flat = jnp.ravel(x)
    seg = -(-flat.shape[0] // n)
    return jnp.pad(flat, (0, n * seg - flat.shape[0])).reshape(n, seg)


def join_segments(segments: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`split_segments`: drop the padding and restore ``shape``."""
    return segments.reshape(-1)[: math.prod(shape)].reshape(shape)


def ring_reduce_scatter(
    x: jax.Array,
    axis_name: Any,
    *,
    combine: Combine | None = None,
    init: Callable[[jax.Array], Any] | None = None,
) -> Any:
    """Ring reduce-scatter: device ``i`` ends with segment ``i`` reduced over all devices.

    ``N - 1`` hops; at each hop every device sends one message to its right neighbour
    ``(i + 1) mod N``. The message for a segment starts as ``init(local_segment)`` and, on
    arrival, becomes ``combine(received, local_segment, step)``. At ``step`` (0-based) the
    received message already merges ``step + 1`` devices and the result merges ``step + 2``.
    Defaults (identity ``init``, ``received + local`` ``combine``) give the sum, which equals
    ``lax.psum_scatter(x, axis_name, tiled=False)``.

    Args:
      x: ``[N, ...]``: ``x[j]`` is this device's contribution to segment ``j``.
      axis_name: the mesh axis of size ``N``.
      combine: ``(message, local_segment, step) -> message`` (same pytree structure/shapes).
      init: ``local_segment -> message``.

    Returns:
      The message for segment ``axis_index``, a pytree shaped like ``init``'s output.
    """
    n = axis_size(axis_name)
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] != n:
        raise ValueError(
            f"x must have a leading axis of size {n} (one segment per device on axis "
            f"{axis_name!r}), got shape {x.shape}; use split_segments to cut a flat array"
        )
    init = init or (lambda seg: seg)
    combine = combine or (lambda msg, seg, step: msg + seg)
    i = lax.axis_index(axis_name)
    perm = _ring_perm(n)

    def segment(j):
        return lax.dynamic_index_in_dim(x, j % n, keepdims=False)

    def hop(step, msg):
        received = lax.ppermute(msg, axis_name, perm)
        return combine(received, segment(i - step - 2), step)

    # At hop t device i sends segment (i - t - 1); after N - 1 hops it holds segment i.
    return lax.fori_loop(0, n - 1, hop, as_varying(init(segment(i - 1)), axis_name))


def ring_all_gather(x: Any, axis_name: Any) -> Any:
    """Ring all-gather: ``N - 1`` hops, each forwarding the segment received last.

    Args:
      x: this device's segment, any pytree of arrays (``uint8`` payloads included).

    Returns:
      The same pytree with a new leading axis ``[N, ...]``; entry ``j`` is device ``j``'s ``x``.
    """
    n = axis_size(axis_name)
    i = lax.axis_index(axis_name)
    perm = _ring_perm(n)

    def place(buf, value, j):
        return lax.dynamic_update_index_in_dim(buf, value, j % n, 0)

    out = jax.tree_util.tree_map(
        lambda a: place(jnp.zeros((n, *jnp.shape(a)), jnp.result_type(a)), a, i), x
    )

    def hop(step, carry):
        cur, buf = carry
        cur = lax.ppermute(cur, axis_name, perm)  # device (i - step - 1)'s segment
        buf = jax.tree_util.tree_map(lambda b, c: place(b, c, i - step - 1), buf, cur)
        return cur, buf

    _, out = lax.fori_loop(0, n - 1, hop, as_varying((x, out), axis_name))
    return out


def ring_all_reduce(x: jax.Array, axis_name: Any, *, mean: bool = False) -> jax.Array:
    """Sum (or mean) of ``x`` over the axis by ring reduce-scatter then ring all-gather.

    ``x`` of any shape is flattened and zero-padded to a multiple of ``N`` elements; each
    device sends ``2 (N - 1)`` segments of ``ceil(size / N)`` elements. Integer inputs wrap
    like their dtype's addition. Equals ``lax.psum`` (``lax.pmean`` with ``mean=True``).
    """
    n = axis_size(axis_name)
    x = jnp.asarray(x)
    reduced = ring_reduce_scatter(split_segments(x, n), axis_name)
    out = join_segments(ring_all_gather(reduced, axis_name), x.shape)
    return out / n if mean else out


def tree_all_reduce(
    x: Any,
    axis_name: Any,
    *,
    combine: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """Binomial-tree reduce to device 0, then binomial-tree broadcast back.

    ``2 ceil(log2 N)`` rounds, each moving the whole message, which suits small messages on
    high-latency links. ``x`` may be any pytree; ``combine(a, b)`` defaults to ``a + b``.
    """
    n = axis_size(axis_name)
    combine = combine or (lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))
    i = lax.axis_index(axis_name)
    acc = x
    d = 1
    while d < n:
        perm = [(j, j - d) for j in range(n) if j % (2 * d) == d]
        received = lax.ppermute(acc, axis_name, perm)
        is_receiver = (i % (2 * d) == 0) & (i + d < n)
        acc = _where(is_receiver, combine(acc, received), acc)
        d *= 2
    return broadcast(acc, 0, axis_name)


def broadcast(x: Any, root: int | jax.Array, axis_name: Any) -> Any:
    """Every device gets ``root``'s ``x``, in ``ceil(log2 N)`` doubling rounds.

    ``root`` may be a traced integer (chosen inside the step, e.g. by a ``max`` over
    devices). A traced ``root`` outside ``[0, N)`` is taken modulo ``N``; a concrete one
    must lie in range. ``x`` may be any pytree of arrays.
    """
    n = axis_size(axis_name)
    if is_concrete(root) and not isinstance(root, jax.Array):
        root = check_int("root", root, lo=0, hi=n - 1)
    elif is_concrete(root) and jnp.ndim(root) == 0:
        check_int("root", int(root), lo=0, hi=n - 1)
    i = lax.axis_index(axis_name)
    rank = (i - jnp.asarray(root, jnp.int32)) % n  # distance from the root along the ring
    d = 1
    while d < n:
        perm = [(j, (j + d) % n) for j in range(n)]
        received = lax.ppermute(x, axis_name, perm)
        x = _where((rank >= d) & (rank < 2 * d), received, x)
        d *= 2
    return x
