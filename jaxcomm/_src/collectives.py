"""Ring, tree and broadcast collectives, built from ``jax.lax.ppermute``.

Call these inside ``jax.shard_map`` (or ``pmap``) with ``axis_name`` bound. Shapes in the
docstrings are per device. One implementation serves every algorithm: the ring
reduce-scatter takes a per-hop ``combine`` (and an ``init`` that turns a local segment into
the first message), so a one-bit ring can merge packed sign words at each hop and a
quantized ring can decode, add and re-encode; the messages may be any pytree of arrays
(``uint8`` payloads included).

Ring steps run in ``lax.fori_loop``, so compile time does not grow with the ring size. A
plain sum needs no per-hop work, so :func:`ring_all_reduce` runs its two phases as XLA's
reduce-scatter and all-gather (the same ring schedule and bytes, at about ``psum``'s speed)
unless ``hops=True`` asks for the ``ppermute`` hops.

Every message pattern sends only what the algorithm needs: the tree reduce and the broadcast
use ``ppermute`` pairs restricted to the devices that hold data in each round. Next to each
collective, a ``*_wire`` function describes its traffic as a :class:`~jaxcomm.network.Wire`
(rounds, bytes along them, bytes each device sends), which the aggregators log and
:func:`jaxcomm.wire_audit` checks against the compiled program.

Results that are the same on every device (all-reduce, all-gather, broadcast) are typed as
replicated over the axis, so they can leave ``shard_map`` through ``out_specs=P()`` and mix
with replicated parameters under ``check_vma=True`` (the default).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxcomm._src._checks import axis_size, check_int, is_concrete
from jaxcomm._src.codecs import payload_bytes
from jaxcomm._src.network import Wire, _log2_ceil

__all__ = [
    "ring_reduce_scatter",
    "ring_all_gather",
    "all_gather",
    "ring_all_reduce",
    "tree_all_reduce",
    "broadcast",
    "split_segments",
    "join_segments",
    "as_varying",
    "replicated",
    "send",
    "all_to_all",
    "psum",
    "WIRE_SCOPE",
    "pack_message",
    "unpack_message",
    "ring_reduce_scatter_wire",
    "ring_all_gather_wire",
    "all_gather_wire",
    "ring_all_reduce_wire",
    "tree_all_reduce_wire",
    "broadcast_wire",
    "psum_wire",
    "all_to_all_wire",
]

Combine = Callable[[Any, jax.Array, jax.Array], Any]

# jax.named_scope around every collective jaxcomm sends, and so logs: a collective of a
# compiled program whose op name lacks it is traffic no jaxcomm log accounts for
# (:func:`jaxcomm.unlogged_traffic`).
WIRE_SCOPE = "jaxcomm_wire"


def _in_mesh_order(axis_name: Any) -> Any:
    """A tuple of mesh axes sorted into the mesh's own order (other names unchanged)."""
    if not isinstance(axis_name, tuple):
        return axis_name
    order = tuple(jax.sharding.get_abstract_mesh().axis_names)
    if not set(axis_name) <= set(order):
        return axis_name
    return tuple(sorted(axis_name, key=order.index))


def _permute_size(axis_name: Any) -> int:
    """``axis_size`` for the ``ppermute`` collectives, which number the devices of a tuple of
    axes in the mesh's order while ``lax.axis_index`` follows the tuple's: a tuple out of
    the mesh's order would pair the wrong devices, so it is refused."""
    n = axis_size(axis_name)
    if isinstance(axis_name, tuple) and _in_mesh_order(axis_name) != axis_name:
        raise ValueError(
            f"axis_name={axis_name!r} lists mesh axes out of the mesh's order; the ppermute "
            f"collectives number devices in mesh order: pass {_in_mesh_order(axis_name)!r}"
        )
    return n


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
    try:
        for name in names:
            lax.axis_size(name)
    except NameError:  # not inside shard_map over these axes: nothing to type
        return tree
    for name in names:  # bound by jax.vmap instead of a mesh: jaxcomm's error
        axis_size(name)

    def cast(a):
        a = jnp.asarray(a)
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        if mat is None:
            return a
        missing = tuple(n for n in names if n not in mat.varying)
        return lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree_util.tree_map(cast, tree)


# A value that every device of an axis holds bit for bit (e.g. after a ring all-gather) is
# still typed "varying" by shard_map, because ppermute results are. This identity primitive
# only drops the axis from the type; no data moves, and it lowers to nothing.
_replicated_p = Primitive("jaxcomm_replicated")
_replicated_p.def_impl(lambda x, *, axes: x)


def _replicated_abstract_eval(x, *, axes):
    mat = getattr(x, "manual_axis_type", None)
    if mat is None:
        return x
    return x.update(manual_axis_type=mat.update(varying=frozenset(mat.varying) - set(axes)))


def _replicated_jvp(primals, tangents, *, axes):
    (x,), (t,) = primals, tangents
    t = ad.instantiate_zeros(t)
    return _replicated_p.bind(x, axes=axes), _replicated_p.bind(t, axes=axes)


def _replicated_transpose(ct, x, *, axes):
    # The value is one of N bit-identical copies, i.e. their mean: each copy's cotangent is
    # ct / N. With that, a ring all-reduce followed by this cast differentiates like psum
    # (the transposed ring sums the N shares back), and a broadcast like its root's value.
    if type(ct) is ad.Zero:
        return [ad.Zero(x.aval)]
    n = 1
    for name in axes:
        n *= lax.axis_size(name)
    ct = as_varying(ct, tuple(axes))
    return [ct / jnp.asarray(n, ct.dtype)]


_replicated_p.def_abstract_eval(_replicated_abstract_eval)
mlir.register_lowering(_replicated_p, lambda ctx, x, *, axes: [x])
batching.primitive_batchers[_replicated_p] = lambda args, dims, *, axes: (
    _replicated_p.bind(args[0], axes=axes),
    dims[0],
)
ad.primitive_jvps[_replicated_p] = _replicated_jvp
ad.primitive_transposes[_replicated_p] = _replicated_transpose


def replicated(tree: Any, axis_name: Any) -> Any:
    """Type every leaf as replicated over ``axis_name`` (a name or a tuple of names).

    Only for values that are bit-identical on every device of the axis (jaxcomm's
    all-reduce, all-gather and broadcast results): the type changes, nothing is sent or
    checked. Outside ``shard_map`` it returns ``tree`` unchanged.
    """
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def cast(a):
        a = jnp.asarray(a)
        mat = getattr(jax.typeof(a), "manual_axis_type", None)
        axes = tuple(n for n in names if n in mat.varying) if mat is not None else ()
        return _replicated_p.bind(a, axes=axes) if axes else a

    return jax.tree_util.tree_map(cast, tree)


def _to_bytes(leaf: jax.Array, lead: int) -> jax.Array:
    """``leaf`` as ``uint8[*leaf.shape[:lead], nbytes]`` (its raw bytes)."""
    leaf = jnp.asarray(leaf)
    if leaf.dtype == jnp.bool_:
        leaf = leaf.astype(jnp.uint8)
    if leaf.dtype != jnp.uint8:
        leaf = lax.bitcast_convert_type(leaf, jnp.uint8)
    return leaf.reshape(*leaf.shape[:lead], -1)


def _from_bytes(buf: jax.Array, like: jax.Array, lead: int) -> jax.Array:
    like_dtype, shape = jnp.dtype(like.dtype), like.shape
    target = jnp.dtype(jnp.uint8) if like_dtype == jnp.bool_ else like_dtype
    if target.itemsize > 1:
        buf = buf.reshape(*buf.shape[:lead], -1, target.itemsize)
    out = lax.bitcast_convert_type(buf, target) if target != jnp.uint8 else buf
    out = out.reshape(*buf.shape[:lead], *shape[lead:])
    return out.astype(jnp.bool_) if like_dtype == jnp.bool_ else out


def pack_message(tree: Any, lead: int = 0) -> jax.Array:
    """All leaves of a payload pytree as one ``uint8[*lead_dims, nbytes]`` buffer.

    A message of several arrays (packed codes and their scales, say) crosses a link as one
    message, as a real transport would send it: one collective per hop, not one per leaf.
    The first ``lead`` axes (shared by every leaf) are kept, e.g. a per-destination axis.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    parts = [_to_bytes(leaf, lead) for leaf in leaves]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def unpack_message(buf: jax.Array, like: Any, lead: int = 0) -> Any:
    """Inverse of :func:`pack_message`: the pytree shaped like ``like`` from its bytes."""
    leaves, treedef = jax.tree_util.tree_flatten(like)
    out, start = [], 0
    for leaf in leaves:
        n = math.prod(leaf.shape[lead:]) * jnp.dtype(leaf.dtype).itemsize
        out.append(_from_bytes(lax.slice_in_dim(buf, start, start + n, axis=-1), leaf, lead))
        start += n
    return jax.tree_util.tree_unflatten(treedef, out)


def send(x: Any, axis_name: Any, perm: list[tuple[int, int]]) -> Any:
    """``lax.ppermute`` of a payload pytree as ONE message (see :func:`pack_message`)."""
    if len(jax.tree_util.tree_leaves(x)) == 1:
        with jax.named_scope(WIRE_SCOPE):
            return lax.ppermute(x, axis_name, perm)
    packed = pack_message(x)
    with jax.named_scope(WIRE_SCOPE):
        received = lax.ppermute(packed, axis_name, perm)
    return unpack_message(received, x)


def all_to_all(x: Any, axis_name: Any) -> Any:
    """``lax.all_to_all`` of a payload pytree whose leaves have a leading ``[N, ...]``
    destination axis: row ``j`` of every leaf goes to device ``j``, as one message."""
    if len(jax.tree_util.tree_leaves(x)) == 1:
        with jax.named_scope(WIRE_SCOPE):
            return jax.tree_util.tree_map(lambda a: lax.all_to_all(a, axis_name, 0, 0), x)
    packed = pack_message(x, lead=1)
    with jax.named_scope(WIRE_SCOPE):
        buf = lax.all_to_all(packed, axis_name, 0, 0)
    return unpack_message(buf, x, lead=1)


def psum(x: jax.Array, axis_name: Any) -> jax.Array:
    """``lax.psum`` (XLA's all-reduce) marked as jaxcomm traffic: the caller logs it with
    :func:`psum_wire`."""
    with jax.named_scope(WIRE_SCOPE):
        return lax.psum(x, axis_name)


def _nbytes(message: Any) -> int:
    """Bytes of a message given as a payload pytree, array, ShapeDtypeStruct or int."""
    if isinstance(message, int):
        return check_int("message bytes", message, lo=0)
    return payload_bytes(message)


def _sent_by(perms: list[list[tuple[int, int]]], n: int, nbytes: int) -> tuple[int, ...]:
    sent = [0] * n
    for perm in perms:
        for src, _ in perm:
            sent[src] += nbytes
    return tuple(sent)


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
    n = _permute_size(axis_name)
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
        received = send(msg, axis_name, perm)
        return combine(received, segment(i - step - 2), step)

    # At hop t device i sends segment (i - t - 1); after N - 1 hops it holds segment i.
    return lax.fori_loop(0, n - 1, hop, as_varying(init(segment(i - 1)), axis_name))


def ring_all_gather(x: Any, axis_name: Any) -> Any:
    """Ring all-gather: ``N - 1`` hops, each forwarding the segment received last.

    Args:
      x: this device's segment, any pytree of arrays (``uint8`` payloads included).

    Returns:
      The same pytree with a new leading axis ``[N, ...]``; entry ``j`` is device ``j``'s
      ``x``, identical on every device (typed as replicated over the axis).
    """
    n = _permute_size(axis_name)
    i = lax.axis_index(axis_name)
    perm = _ring_perm(n)

    def place(buf, value, j):
        return lax.dynamic_update_index_in_dim(buf, value, j % n, 0)

    out = jax.tree_util.tree_map(
        lambda a: place(jnp.zeros((n, *jnp.shape(a)), jnp.result_type(a)), a, i), x
    )

    def hop(step, carry):
        cur, buf = carry
        cur = send(cur, axis_name, perm)  # device (i - step - 1)'s segment
        buf = jax.tree_util.tree_map(lambda b, c: place(b, c, i - step - 1), buf, cur)
        return cur, buf

    _, out = lax.fori_loop(0, n - 1, hop, as_varying((x, out), axis_name))
    return replicated(out, axis_name)


def _doubling_perms(n: int) -> list[list[tuple[int, int]]]:
    """Recursive doubling: in round ``r`` device ``j`` swaps with ``j XOR 2**r``."""
    return [[(j, j ^ d) for j in range(n)] for d in (1 << r for r in range(_log2_ceil(n)))]


def all_gather(x: Any, axis_name: Any) -> Any:
    """All-gather in ``ceil(log2 N)`` rounds (recursive doubling) when ``N`` is a power of two.

    In round ``r`` each device swaps the ``2**r`` entries it holds with device
    ``i XOR 2**r``, so every device sends ``(N - 1)`` times ``x``'s bytes over ``log2 N``
    rounds: the all-gather cost ``log N alpha + (N - 1) M beta`` of the AR-Topk paper's
    Table I. For other ``N`` it is :func:`ring_all_gather` (``N - 1`` rounds, same bytes).

    Args:
      x: this device's entry, any pytree of arrays.

    Returns:
      The pytree with a leading axis ``[N, ...]`` (entry ``j`` from device ``j``), identical
      on every device and typed as replicated.
    """
    n = _permute_size(axis_name)
    if n & (n - 1):
        return ring_all_gather(x, axis_name)
    i = lax.axis_index(axis_name)
    held = jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], as_varying(x, axis_name))
    for r, perm in enumerate(_doubling_perms(n)):
        received = send(held, axis_name, perm)
        mine_first = ((i >> r) & 1) == 0  # my block precedes my partner's
        held = jax.tree_util.tree_map(
            lambda a, b, first=mine_first: _where(
                first, jnp.concatenate([a, b]), jnp.concatenate([b, a])
            ),
            held,
            received,
        )
    return replicated(held, axis_name)


def ring_all_reduce(
    x: jax.Array, axis_name: Any, *, mean: bool = False, hops: bool = False
) -> jax.Array:
    """Sum (or mean) of ``x`` over the axis as a ring: reduce-scatter, then all-gather.

    ``x`` of any shape is flattened and zero-padded to a multiple of ``N`` elements; each
    device sends ``2 (N - 1)`` segments of ``ceil(size / N)`` elements over ``2 (N - 1)``
    rounds. Integer inputs wrap like their dtype's addition. Equals ``lax.psum``
    (``lax.pmean`` with ``mean=True``) up to float summation order; the result is identical
    on every device and typed as replicated.

    By default the two phases are XLA's own ``reduce-scatter`` and ``all-gather``
    (``lax.psum_scatter`` and ``lax.all_gather`` of the segments): a plain sum needs no work
    between hops, and the backend runs each phase as one collective (NCCL's ring on a GPU),
    at about ``psum``'s speed. ``hops=True`` runs the same schedule hop by hop instead, as
    ``2 (N - 1)`` ``ppermute`` messages (:func:`ring_reduce_scatter` then
    :func:`ring_all_gather`, the path algorithms with per-hop work take); on 8 simulated CPU
    devices it is 3-5x slower than ``psum``. Both send the same bytes in the same number of
    rounds as a ring (the wire audit costs XLA's reduce-scatter and all-gather as rings; the
    backend may schedule them otherwise), and sum in different orders.
    """
    axis_name = _in_mesh_order(axis_name)  # a sum does not depend on the devices' order
    n = axis_size(axis_name)
    x = jnp.asarray(x)
    segments = split_segments(x, n)
    if hops:
        reduced = ring_reduce_scatter(segments, axis_name)
        gathered = ring_all_gather(reduced, axis_name)
    else:
        with jax.named_scope(WIRE_SCOPE):
            reduced = lax.psum_scatter(segments, axis_name, scatter_dimension=0, tiled=False)
            gathered = replicated(lax.all_gather(reduced, axis_name), axis_name)
    out = join_segments(gathered, x.shape)
    return out / n if mean else out


def _tree_reduce_perms(n: int) -> list[list[tuple[int, int]]]:
    """Binomial reduce to device 0: round ``d`` moves ``j -> j - d`` for ``j % 2d == d``."""
    perms, d = [], 1
    while d < n:
        perms.append([(j, j - d) for j in range(n) if j % (2 * d) == d])
        d *= 2
    return perms


def _broadcast_perms(n: int, root: int) -> list[list[tuple[int, int]]]:
    """Binomial broadcast: in round ``d`` the ``d`` devices that hold the value send it on."""
    perms, d = [], 1
    while d < n:
        perms.append([((root + k) % n, (root + k + d) % n) for k in range(d) if k + d < n])
        d *= 2
    return perms


def tree_all_reduce(
    x: Any,
    axis_name: Any,
    *,
    combine: Callable[[Any, Any], Any] | None = None,
) -> Any:
    """Binomial-tree reduce to device 0, then binomial-tree broadcast back.

    ``2 ceil(log2 N)`` rounds, each moving the whole message, which suits small messages on
    high-latency links. In every round only the devices holding data send. ``x`` may be any
    pytree; ``combine(a, b)`` defaults to ``a + b``. The result is typed as replicated.
    """
    n = _permute_size(axis_name)
    combine = combine or (lambda a, b: jax.tree_util.tree_map(jnp.add, a, b))
    i = lax.axis_index(axis_name)
    acc = x
    d = 1
    for perm in _tree_reduce_perms(n):
        received = send(acc, axis_name, perm)
        is_receiver = (i % (2 * d) == 0) & (i + d < n)
        acc = _where(is_receiver, combine(acc, received), acc)
        d *= 2
    return broadcast(acc, 0, axis_name)


def _broadcast_static(x: Any, root: int, axis_name: Any, n: int) -> Any:
    rank = (lax.axis_index(axis_name) - root) % n  # distance from the root along the ring
    d = 1
    for perm in _broadcast_perms(n, root):
        received = send(x, axis_name, perm)
        x = _where((rank >= d) & (rank < 2 * d), received, x)
        d *= 2
    return replicated(x, axis_name)


def broadcast(x: Any, root: int | jax.Array, axis_name: Any) -> Any:
    """Every device gets ``root``'s ``x``, in ``ceil(log2 N)`` doubling rounds.

    In round ``d`` only the ``d`` devices that already hold the value send. ``root`` may be
    a traced integer (chosen inside the step, e.g. by a ``max`` over devices); it must then
    be the same on every device, and a ``lax.switch`` over the ``N`` possible roots picks
    the message pattern (a traced ``root`` outside ``[0, N)`` is taken modulo ``N``). A
    concrete ``root`` must lie in range. ``x`` may be any pytree of arrays; the result is
    typed as replicated.
    """
    n = _permute_size(axis_name)
    if is_concrete(root) and not isinstance(root, jax.Array):
        root = check_int("root", root, lo=0, hi=n - 1)
        return _broadcast_static(x, root, axis_name, n)
    if is_concrete(root) and jnp.ndim(root) == 0:
        return _broadcast_static(x, check_int("root", int(root), lo=0, hi=n - 1), axis_name, n)
    branches = [
        (lambda v, r=r: _broadcast_static(as_varying(v, axis_name), r, axis_name, n))
        for r in range(n)
    ]
    index = jnp.asarray(root, jnp.int32) % n
    return lax.switch(index, branches, x)


# --------------------------------------------------------------------------- wire descriptions


def ring_reduce_scatter_wire(segment: Any, n: int) -> Wire:
    """Traffic of :func:`ring_reduce_scatter` whose hop messages look like ``segment``.

    ``N - 1`` rounds of one message each; every device sends ``(N - 1) * segment`` bytes.
    """
    b = _nbytes(segment)
    return Wire("ring_reduce_scatter", n * b, n - 1, (n - 1) * b, ((n - 1) * b,) * n)


def ring_all_gather_wire(segment: Any, n: int) -> Wire:
    """Traffic of :func:`ring_all_gather` of ``segment`` (``N - 1`` rounds)."""
    b = _nbytes(segment)
    return Wire("ring_allgather", n * b, n - 1, (n - 1) * b, ((n - 1) * b,) * n)


def all_gather_wire(segment: Any, n: int) -> Wire:
    """Traffic of :func:`all_gather` of ``segment``: ``ceil(log2 N)`` rounds for a power-of-two
    ``N`` (round ``r`` moves ``2**r`` segments), else the ring's ``N - 1``."""
    if n & (n - 1):
        return ring_all_gather_wire(segment, n)
    b = _nbytes(segment)
    rounds = _log2_ceil(n)
    return Wire("allgather", b, rounds, (n - 1) * b, ((n - 1) * b,) * n)


def ring_all_reduce_wire(segment: Any, n: int, *, message_bytes: int | None = None) -> Wire:
    """Traffic of a ring all-reduce (reduce-scatter, then all-gather) of ``segment``-sized
    messages: ``2 (N - 1)`` rounds; ``message_bytes`` defaults to ``N * segment``."""
    b = _nbytes(segment)
    m = n * b if message_bytes is None else message_bytes
    return Wire("ring_allreduce", m, 2 * (n - 1), 2 * (n - 1) * b, (2 * (n - 1) * b,) * n)


def tree_all_reduce_wire(message: Any, n: int) -> Wire:
    """Traffic of :func:`tree_all_reduce`: ``2 ceil(log2 N)`` rounds of the whole message.

    Device ``j > 0`` sends once in the reduce, plus its broadcast forwards; the root sends
    ``ceil(log2 N)`` times in the broadcast.
    """
    b = _nbytes(message)
    perms = _tree_reduce_perms(n) + _broadcast_perms(n, 0)
    return Wire("tree_allreduce", b, len(perms), len(perms) * b, _sent_by(perms, n, b))


def broadcast_wire(message: Any, n: int, root: int) -> Wire:
    """Traffic of :func:`broadcast` from ``root``: ``ceil(log2 N)`` rounds."""
    b = _nbytes(message)
    perms = _broadcast_perms(n, check_int("root", root, lo=0, hi=n - 1))
    return Wire("broadcast", b, len(perms), len(perms) * b, _sent_by(perms, n, b))


def psum_wire(message: Any, n: int) -> Wire:
    """Traffic of ``lax.psum`` (XLA's all-reduce) of ``message``, costed as a ring:
    ``2 (N - 1)`` rounds of ``ceil(size / N)``-element segments of every leaf."""
    seg = 0
    for leaf in jax.tree_util.tree_leaves(message):
        seg += -(-math.prod(jnp.shape(leaf)) // n) * jnp.dtype(leaf.dtype).itemsize
    per = 2 * (n - 1) * seg
    return Wire("allreduce", _nbytes(message), 2 * (n - 1), per, (per,) * n)


def all_to_all_wire(chunk: Any, n: int) -> Wire:
    """Traffic of ``lax.all_to_all`` where each device sends one ``chunk`` to every other
    device: ``N - 1`` rounds (pairwise exchange), ``(N - 1) * chunk`` bytes per device."""
    b = _nbytes(chunk)
    return Wire("alltoall", n * b, n - 1, (n - 1) * b, ((n - 1) * b,) * n)
