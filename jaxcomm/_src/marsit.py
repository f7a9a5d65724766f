"""Marsit: one-bit multi-hop all-reduce with an unbiased bit-wise merge.

Reference: "Sign Bit is Enough: A Learning Synchronization Framework for Multi-hop
All-reduce with Ultimate Compression" (Marsit, DAC 2022), Algorithms 1 and 2, Eq. 2.

Each worker ``w`` forms ``u = local_lr * grad + c_w``. In a one-bit round the sign bits of
``u`` travel a ring reduce-scatter where each hop merges the received bits ``r`` (already the
merge of ``m - 1`` workers) with the local bits ``s`` by
``(r AND s) OR ((r XOR s) AND v)``, ``v`` being Bernoulli(1/m) where ``s = 1`` and
Bernoulli((m - 1)/m) where ``s = 0`` (:func:`sign_merge`); the merged bit is then 1 with
probability equal to the mean of the ``m`` workers' bits, and every hop carries exactly one
bit per element. A ring all-gather circulates the merged bits unchanged. The global step is
``g = global_lr * (2 bits - 1)`` and the compensation becomes ``c_w = u - g``. Every
``full_sync_every``-th round is a full-precision ring average ``g = mean_w(u)`` with
``c_w = 0``. The 2-D torus variant merges along mesh rows, then columns, then gathers back.

Deviations, documented where they occur: rounds are counted from 0, so round 0 (when
``c = 0`` anyway) is a full-precision round; the Bernoulli masks are built directly as packed
words from random bits, with a randomised truncation of ``1/m`` that keeps each bit's
probability exactly ``1/m`` in expectation; every one-bit hop message carries one extra byte,
the OR of the merged workers' non-finite flags, so that a NaN or Inf in one worker's
gradient reaches every worker's update (a sign bit cannot carry it).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm._src._checks import axis_size, check_choice, check_float, check_int, is_concrete
from jaxcomm._src.aggregate import WholeOptimizer, whole_optimizer, worker_state
from jaxcomm._src.codecs import pack_bits, unpack_bits
from jaxcomm._src.collectives import (
    join_segments,
    replicated,
    ring_all_gather,
    ring_all_gather_wire,
    ring_all_reduce,
    ring_all_reduce_wire,
    ring_reduce_scatter,
    ring_reduce_scatter_wire,
    split_segments,
)
from jaxcomm._src.network import CommLog, Wire, empty_log, log_wire
from jaxcomm._src.rng import hash_bits
from jaxcomm._src.worker import TreeLayout, flatten_grads, init_layout

__all__ = [
    "ROUND_SCOPE",
    "MarsitState",
    "SignReduced",
    "bernoulli_words",
    "sign_merge",
    "sign_all_reduce",
    "marsit",
]

# jax.named_scope of the lax.cond between a one-bit round (branch 0) and a full-precision
# round (branch 1): the `branches=` key (e.g. `train.estimate --branch marsit_round=0`).
ROUND_SCOPE = "marsit_round"

_PRECISION = 16  # binary digits of the probability used to build a Bernoulli word


def bernoulli_words(key: jax.Array, p: jax.Array | float, shape: tuple[int, ...]) -> jax.Array:
    """Packed words whose bits are independent Bernoulli(``p``) draws, built bit-wise.

    With ``p = 0.b_1 b_2 ... b_K`` in binary, start from ``r = 0`` and for ``j = K .. 1`` set
    ``r = r OR R_j`` if ``b_j = 1`` else ``r AND R_j``, each ``R_j`` a word of fair random bits;
    then ``P(bit = 1) = sum_j b_j 2^-j``. ``p`` is cut to ``K = 16`` binary digits by
    rounding ``p * 2^K`` up with probability equal to its fractional part (one uniform draw
    shared by the call), so each bit's marginal is Bernoulli(``p``) exactly when the 16 fair
    words are independent (hash words, each uniform; see :mod:`jaxcomm.rng`); the shared
    rounding only correlates bits through a probability shift below ``2^-16``. No
    per-element float is formed; the fair words come from :func:`jaxcomm.rng.hash_bits` (a
    counter-based hash, each word exactly uniform over keys; several times cheaper than
    threefry words) and are viewed as bytes.

    Args:
      key: PRNG key.
      p: probability in ``[0, 1)`` (Python float or traced scalar).
      shape: shape of the ``uint8`` output.

    Returns:
      ``uint8[shape]``.
    """
    k_round, k_bits = jax.random.split(key)
    scaled = jnp.asarray(p, jnp.float32) * (1 << _PRECISION)
    digits = jnp.floor(scaled + jax.random.uniform(k_round, (), jnp.float32)).astype(jnp.int32)
    digits = jnp.clip(digits, 0, (1 << _PRECISION) - 1)

    size = math.prod(shape)
    words = -(-size // 4)
    fair = hash_bits(k_bits, (_PRECISION, words))
    r = jnp.zeros((words,), jnp.uint32)
    for j in range(_PRECISION, 0, -1):  # digits of p, least significant first
        bit = (jnp.right_shift(digits, _PRECISION - j) & 1) == 1
        r = jnp.where(bit, r | fair[j - 1], r & fair[j - 1])
    return lax.bitcast_convert_type(r, jnp.uint8).reshape(-1)[:size].reshape(shape)


def sign_merge(
    received: jax.Array, local: jax.Array, key: jax.Array, m: int | jax.Array
) -> jax.Array:
    """Marsit's unbiased merge of packed sign words (its Eq. 2 and operator).

    ``out = (r AND s) OR ((r XOR s) AND v)`` with ``v`` Bernoulli(1/m) where the local bit
    ``s`` is 1 and Bernoulli((m-1)/m) where it is 0. If each bit of ``received`` is 1 with
    probability ``p`` (the mean of ``m - 1`` workers' bits), each output bit is 1 with
    probability ``((m - 1) p + s) / m``: the mean over ``m`` workers.

    Args:
      received: ``uint8[...]`` packed bits merged over ``m - 1`` workers.
      local: ``uint8[...]`` this worker's packed sign bits (same shape).
      key: PRNG key for ``v``.
      m: workers merged in the output, including this one (``>= 1``; may be traced).

    Returns:
      ``uint8[...]`` packed merged bits.
    """
    received, local = jnp.asarray(received), jnp.asarray(local)
    if received.dtype != jnp.uint8 or local.dtype != jnp.uint8:
        raise TypeError(
            f"received and local must be packed uint8 words, got {received.dtype} and {local.dtype}"
        )
    if received.shape != local.shape:
        raise ValueError(
            f"received and local must have the same shape, got {received.shape} and {local.shape}"
        )
    if is_concrete(m) and not isinstance(m, jax.Array):
        check_int("m", m, lo=1)
    m = jnp.asarray(m, jnp.int32)
    a = bernoulli_words(key, 1.0 / jnp.maximum(m, 1).astype(jnp.float32), local.shape)
    # Where s = 1, v = a ~ B(1/m); where s = 0, v = NOT a ~ B(1 - 1/m).
    v = ~(local ^ a)
    merged = (received & local) | ((received ^ local) & v)
    return jnp.where(m <= 1, local, merged)


class SignReduced(NamedTuple):
    """Result of :func:`sign_all_reduce`.

    Attributes:
      bits: ``bool[d]`` the merged bits, the same on every worker (typed as replicated).
      finite: ``bool[]`` False when some worker's ``x`` held a NaN or Inf.
      wires: the collectives that ran, for :func:`jaxcomm.network.log_wire`.
    """

    bits: jax.Array
    finite: jax.Array
    wires: tuple[Wire, ...]


def _device_key(key: jax.Array, axis_name: Any) -> jax.Array:
    """``key`` made distinct on every device of ``axis_name`` (a name or a tuple of names:
    the position on all of them, so a torus's columns do not share their rows' draws)."""
    return jax.random.fold_in(key, lax.axis_index(axis_name))


def _merge_ring(words: jax.Array, flag: jax.Array, axis_name: Any, key: jax.Array):
    """Reduce-scatter packed words ``[N, w]`` with :func:`sign_merge` at every hop.

    Each hop message is a segment's words plus one flag byte (OR of the merged workers'
    non-finite flags). ``key`` must already differ between devices.
    """

    def init(segment):
        return segment, flag

    def combine(received, segment, step):
        r_words, r_flag = received
        merged = sign_merge(r_words, segment, jax.random.fold_in(key, step), step + 2)
        return merged, r_flag | flag

    return ring_reduce_scatter(words, axis_name, combine=combine, init=init)


def sign_all_reduce(
    x: jax.Array, axis_name: Any, key: jax.Array, *, topology: str = "ring"
) -> SignReduced:
    """Marsit's one-bit all-reduce of the signs of ``x``.

    Every hop carries one bit per element plus one byte: the OR of the non-finite flags of
    the workers merged so far, so a NaN or Inf anywhere is known everywhere (``finite``).

    Args:
      x: ``f32[d]`` this worker's vector (only its signs travel).
      axis_name: the ring axis (``topology="ring"``), or ``(row_axis, col_axis)`` for
        ``topology="torus"``.
      key: PRNG key, the same on every worker; the merge draws are made distinct per worker
        (its position on every axis) and hop inside.
      topology: ``"ring"`` or ``"torus"``.

    Returns:
      :class:`SignReduced`: the merged bits, each 1 with probability equal to the fraction
      of workers whose ``x`` is positive there; the finite flag; the collectives that ran.
    """
    check_choice("topology", topology, ("ring", "torus"))
    x = jnp.ravel(x)
    flag = jnp.any(~jnp.isfinite(x)).astype(jnp.uint8)[None]  # uint8[1]
    if topology == "ring":
        n = axis_size(axis_name)
        segments = split_segments(x, n)  # [n, s]
        words = pack_bits(segments > 0)  # [n, ceil(s / 8)]
        merged = _merge_ring(words, flag, axis_name, _device_key(key, axis_name))  # ([w], [1])
        g_words, g_flags = ring_all_gather(merged, axis_name)
        bits = join_segments(unpack_bits(g_words, segments.shape[1]), x.shape)
        finite = ~jnp.any(g_flags > 0)
        return SignReduced(bits, finite, (ring_all_reduce_wire(merged, n),))
    if not (isinstance(axis_name, tuple) and len(axis_name) == 2):
        raise ValueError(
            f"topology='torus' needs axis_name=(row_axis, col_axis), got {axis_name!r}"
        )
    rows, cols = axis_name
    r, c = axis_size(rows), axis_size(cols)
    me = _device_key(key, (rows, cols))
    segments = split_segments(x, r)  # [r, s]
    words = pack_bits(segments > 0)  # [r, w]
    row_words, row_flag = _merge_ring(words, flag, rows, jax.random.fold_in(me, 1))  # [w]
    w = row_words.shape[0]
    sub = split_segments(row_words, c)  # [c, ceil(w / c)], uint8 zero-padded
    col_merged = _merge_ring(sub, row_flag, cols, jax.random.fold_in(me, 2))  # c row groups
    col_words, col_flags = ring_all_gather(col_merged, cols)
    full_row = (join_segments(col_words, (w,)), jnp.max(col_flags, axis=0))
    g_words, g_flags = ring_all_gather(full_row, rows)  # [r, w], [r, 1]
    bits = join_segments(unpack_bits(g_words, segments.shape[1]), x.shape)
    finite = ~jnp.any(g_flags > 0)
    wires = (
        ring_reduce_scatter_wire((row_words, row_flag), r),
        ring_reduce_scatter_wire(col_merged, c),
        ring_all_gather_wire(col_merged, c),
        ring_all_gather_wire(full_row, r),
    )
    return SignReduced(bits, finite, wires)


class MarsitState(NamedTuple):
    """State of :func:`marsit`, per worker.

    Attributes:
      count: ``int32[]`` rounds done; round ``t`` is full precision when ``t % K == 0``.
      compensation: ``f32[d]`` the compensation vector ``c_w`` of the flattened parameters.
      key: ``uint32[2]`` raw PRNG key data for the merge draws, advanced every round (made
        distinct per worker by folding in the worker's axis index at use).
      log: what the last round sent.
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.TreeLayout`).
    """

    count: jax.Array
    compensation: jax.Array
    key: jax.Array
    log: CommLog
    layout: TreeLayout


def marsit(
    axis_name: Any,
    *,
    local_lr: float,
    global_lr: float,
    full_sync_every: int,
    topology: str = "ring",
    seed: int = 0,
) -> WholeOptimizer:
    """Marsit aggregation and update as an ``optax`` transform (Algorithms 1-2 of the paper).

    The returned updates follow optax's convention: they are *added* to the parameters,
    ``x <- x + updates = x - g``. Step sizes enter exactly as in the paper: ``local_lr``
    scales this worker's gradient before compensation (``u = local_lr * grad + c``), and
    ``global_lr`` scales the merged signs of one-bit rounds (``g = global_lr * (2 bits - 1)``);
    full-precision rounds apply ``g = mean_w(u)`` with no further step size. So Marsit is the
    whole optimizer (a :class:`~jaxcomm.WholeOptimizer`): use it in place of
    ``optax.chain(aggregator, optimizer)``, chain gradient-side transforms *before* it
    (clipping, weight decay), and add no optimizer after it: ``optax.chain`` with a transform
    other than ``optax.identity()`` after it raises a ``ValueError`` at trace time.

    Args:
      axis_name: data-parallel axis (``topology="ring"``) or ``(row_axis, col_axis)``
        (``"torus"``), bound by the enclosing ``shard_map``.
      local_lr: local step size ``eta_l > 0``.
      global_lr: global step size ``eta_s > 0`` of one-bit rounds.
      full_sync_every: ``K >= 1``; every ``K``-th round is full precision (``K = 1`` is
        plain parallel SGD).
      topology: ``"ring"`` or ``"torus"``.
      seed: seeds the merge draws.

    Returns:
      A :class:`~jaxcomm.WholeOptimizer` whose state is a :class:`MarsitState`.

    Example::

        tx = jaxcomm.marsit("data", local_lr=0.1, global_lr=1e-3, full_sync_every=10)

        def per_worker(params, state, batch):      # inside jax.shard_map over "data"
            grads = jaxcomm.worker_grad(loss_fn, "data")(params, batch)  # own gradient
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
    """
    local_lr = check_float("local_lr", local_lr, lo=0.0, lo_open=True)
    global_lr = check_float("global_lr", global_lr, lo=0.0, lo_open=True)
    k = check_int("full_sync_every", full_sync_every, lo=1)
    check_choice("topology", topology, ("ring", "torus"))
    if topology == "torus" and not (isinstance(axis_name, tuple) and len(axis_name) == 2):
        raise ValueError(
            f"topology='torus' needs axis_name=(row_axis, col_axis), got {axis_name!r}"
        )
    seed = check_int("seed", seed, lo=0)
    axes = axis_name if isinstance(axis_name, tuple) else (axis_name,)

    def init_fn(params):
        layout, d = init_layout("marsit", params)
        state = MarsitState(
            count=jnp.zeros((), jnp.int32),
            compensation=jnp.zeros((d,), jnp.float32),
            key=jax.random.key_data(jax.random.key(seed)),
            log=empty_log(),
            layout=layout,
        )
        return worker_state(state, axes)

    def update_fn(updates, state, params=None):
        del params
        n = 1
        for a in axes:
            n *= axis_size(a)
        flat, unflatten = flatten_grads("marsit", updates, axes, state.layout)
        # u: f32[d] = local step + compensation
        u = local_lr * flat + state.compensation
        key, next_key = jax.random.split(jax.random.wrap_key_data(state.key))
        ring_axes = axes if len(axes) > 1 else axes[0]

        def full_round(u):
            g = ring_all_reduce(u, ring_axes) / n
            seg = jax.eval_shape(lambda v: split_segments(v, n)[0], u)
            wire = ring_all_reduce_wire(seg, n, message_bytes=4 * u.shape[0])
            log = log_wire(empty_log(), wire)
            return g, jnp.zeros_like(u), log

        def one_bit_round(u):
            reduced = sign_all_reduce(u, axis_name, key, topology=topology)
            g = global_lr * (2.0 * reduced.bits.astype(jnp.float32) - 1.0)
            g = jnp.where(reduced.finite, g, jnp.nan)
            log = empty_log()
            for wire in reduced.wires:
                log = log_wire(log, wire)
            return g, u - g, log

        def typed(out):
            g, comp, log = out
            return replicated(g, axes), worker_state((comp, log), axes)

        with jax.named_scope(ROUND_SCOPE):
            g, (comp, log) = lax.cond(
                state.count % k == 0,
                lambda v: typed(full_round(v)),
                lambda v: typed(one_bit_round(v)),
                u,
            )
        new_state = MarsitState(
            count=state.count + 1,
            compensation=comp,
            key=jax.random.key_data(next_key),
            log=log,
            layout=state.layout,
        )
        return unflatten(-g), worker_state(new_state, axes)

    return whole_optimizer("jaxcomm.marsit", "local_lr and global_lr", init_fn, update_fn)
