"""One-bit sign baselines: signSGD-MV, EF-signSGD, SSDM and cascading compression.

These are the sign-based baselines that Marsit ("Sign Bit is Enough: A Learning
Synchronization Framework for Multi-hop All-reduce with Ultimate Compression", DAC 2022) is
compared with. Each is an ``optax`` transform that is the *whole optimizer*
(a :class:`~jaxcomm.WholeOptimizer`): its updates are added to the parameters
(``x <- x + updates``), so each returns ``-lr * direction`` (EF-signSGD folds ``lr`` in before
compressing). Use one in place of ``optax.chain(aggregator, optimizer)``: ``optax.chain``
with a transform other than ``optax.identity()`` after it raises a ``ValueError``. Run them
inside ``jax.shard_map`` with ``axis_name`` bound; the gradient pytree is fused into one flat
``float32`` vector of ``d`` elements.

The first three are parameter-server (PS) algorithms. The Marsit paper extends them to
multi-hop all-reduce "by dynamically changing the bit length"; here they instead use the
PS-equivalent exchange, a ring all-gather of every worker's one-bit payload, after which each
worker decodes all ``N`` payloads and aggregates locally (what a PS would do), so the result is
exactly the PS algorithm and each payload stays one bit per element (plus a 4-byte scale where
the method has one). :func:`cascading_sign` is the naive multi-hop alternative of the Marsit
paper's Sec. 3.2: a ring reduce-scatter whose every hop decompresses, adds and recompresses.

Every state holds a :class:`~jaxcomm.network.CommLog` whose ``sent_bytes`` is counted from the
payload arrays that actually crossed the wire (:func:`~jaxcomm.codecs.payload_bytes`), and
whose rounds are those of the ring all-gather (``N - 1``) or ring all-reduce that runs.

Non-finite gradients: a NaN or Inf in any worker's gradient reaches every worker's update.
Payloads with a float scale carry it there; signSGD-MV's payload has no float, so it carries
one extra byte, the worker's non-finite flag.

Sign convention on the wire (:class:`~jaxcomm.codecs.SignCode`): bit 1 means ``+``, bit 0 means
``-``; a deterministic sign of an exact zero is sent as ``-``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm._src._checks import axis_size, check_float, check_int
from jaxcomm._src.aggregate import WholeOptimizer, whole_optimizer, worker_state
from jaxcomm._src.codecs import (
    SignCode,
    pack_bits,
    sign_decode,
    sign_encode,
    unpack_bits,
)
from jaxcomm._src.collectives import (
    join_segments,
    ring_all_gather,
    ring_all_gather_wire,
    ring_all_reduce_wire,
    ring_reduce_scatter,
    split_segments,
)
from jaxcomm._src.network import CommLog, empty_log, log_wire
from jaxcomm._src.rng import bernoulli
from jaxcomm._src.worker import TreeLayout, flatten_grads, init_layout

__all__ = [
    "SignMVState",
    "EFSignState",
    "SSDMState",
    "CascadingState",
    "stochastic_sign_encode",
    "signsgd_mv",
    "ef_signsgd",
    "ssdm",
    "cascading_sign",
]


def stochastic_sign_encode(x: jax.Array, key: jax.Array) -> SignCode:
    """SSDM's unbiased compressor ``Q(v) = ||v||_2 * sign~(v)`` as a wire payload.

    From "Stochastic Sign Descent Methods: New Algorithms and Better Theory" (Safaryan and
    Richtarik, ICML 2021), in the form the Marsit paper gives in its Appendix A: element ``j``
    is sent as ``+1`` with probability ``1/2 + v_j / (2 ||v||_2)`` and ``-1`` otherwise, so
    ``E[sign~(v)] = v / ||v||`` and ``E[Q(v)] = v``; the variance is
    ``E||Q(v) - v||^2 = (n - 1) ||v||^2``. A zero vector is sent as fair coin flips with
    scale 0 (decoded as 0).

    Args:
      x: ``f32[..., n]``; the norm is taken over the whole array.
      key: PRNG key for the ``n`` uniform draws.

    Returns:
      :class:`~jaxcomm.codecs.SignCode` with ``bits: uint8[..., ceil(n / 8)]`` (the stochastic
      signs, 1 = ``+``) and ``scale: f32[] = ||x||_2``: ``ceil(n / 8) + 4`` bytes on the wire
      for a vector. Decode with :func:`~jaxcomm.codecs.sign_decode`.
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    xf = x.astype(jnp.float32)
    norm = jnp.sqrt(jnp.sum(xf * xf))  # f32[]
    safe = jnp.where(norm > 0, norm, 1.0)
    p_plus = 0.5 + 0.5 * xf / safe  # f32[..., n], in [0, 1]
    plus = bernoulli(key, p_plus)  # bool[..., n], P(True) = p_plus to within 2**-24
    return SignCode(pack_bits(plus), norm, tuple(x.shape), jnp.dtype(x.dtype).name)


def _nonfinite_flag(x: jax.Array) -> jax.Array:
    """``uint8[1]``: 1 when ``x`` holds a NaN or Inf, else 0 (one byte on the wire)."""
    return jnp.any(~jnp.isfinite(x)).astype(jnp.uint8)[None]


def _decode_all(gathered: SignCode) -> jax.Array:
    """Decode ``N`` gathered :class:`SignCode` payloads (leading axis ``N``) to ``f32[N, n]``."""
    return jax.vmap(sign_decode)(gathered).astype(jnp.float32)


# ------------------------------------------------------------------------------- signSGD-MV


class SignMVState(NamedTuple):
    """State of :func:`signsgd_mv`, per worker.

    Attributes:
      count: ``int32[]`` steps done.
      log: what the last step sent (one all-gather of packed sign bits).
    """

    count: jax.Array
    log: CommLog


def signsgd_mv(axis_name: Any, *, lr: float) -> WholeOptimizer:
    """signSGD with majority vote as an ``optax`` transform.

    From "signSGD: Compressed Optimisation for Non-Convex Problems" (Bernstein et al., ICML
    2018), the majority-vote variant (also "signSGD with Majority Vote is Communication
    Efficient and Fault Tolerant", Bernstein et al., ICLR 2019). Each worker sends the signs of
    its gradient ``g_w: f32[d]`` as packed bits (``uint8[ceil(d / 8)]``, bit 1 where
    ``g > 0``, so an exact zero votes ``-``); a ring all-gather gives every worker all ``N``
    votes (``N * ceil(d / 8)`` bytes gathered, ``(N - 1) * ceil(d / 8)`` sent per worker), and
    every worker applies ``-lr * sign(sum_w sign(g_w))``. Ties (possible for even ``N``) give
    0: no step on that coordinate. The payload also carries one byte, set when the worker's
    gradient holds a NaN or Inf; then every worker's update is NaN.

    Args:
      axis_name: data-parallel mesh axis, bound by the enclosing ``shard_map``.
      lr: step size ``> 0``.

    Returns:
      A :class:`~jaxcomm.WholeOptimizer` whose state is a :class:`SignMVState`. Logged as one
      ``"ring_allgather"`` of ``ceil(d / 8) + 1``-byte payloads.
    """
    lr = check_float("lr", lr, lo=0.0, lo_open=True)

    def init_fn(params):
        del params
        state = SignMVState(count=jnp.zeros((), jnp.int32), log=empty_log())
        return worker_state(state, axis_name)

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        flat, unflatten = flatten_grads("signsgd_mv", updates, axis_name)  # f32[d]
        d = flat.shape[0]
        # bits: uint8[ceil(d / 8)]; flag: uint8[1], 1 when this gradient is not finite
        payload = (sign_encode(flat), _nonfinite_flag(flat))
        votes, flags = ring_all_gather(payload, axis_name)  # [N, ceil(d / 8)], [N, 1]
        ones = jnp.sum(unpack_bits(votes.bits, d).astype(jnp.int32), axis=0)  # int32[d]
        vote = 2 * ones - n  # sum_w sign(g_w), int32[d]
        direction = jnp.sign(vote).astype(jnp.float32)  # ties -> 0
        direction = jnp.where(jnp.any(flags > 0), jnp.nan, direction)
        log = log_wire(empty_log(), ring_all_gather_wire(payload, n))
        new_state = worker_state(SignMVState(count=state.count + 1, log=log), axis_name)
        return unflatten(-lr * direction), new_state

    return whole_optimizer("jaxcomm.signsgd_mv", "lr", init_fn, update_fn)


# ------------------------------------------------------------------------------- EF-signSGD


class EFSignState(NamedTuple):
    """State of :func:`ef_signsgd`, per worker.

    Attributes:
      count: ``int32[]`` steps done.
      error: ``f32[d]`` the error-feedback memory ``e = p - delta`` of the flattened parameters.
      log: what the last step sent (one all-gather of scaled sign payloads).
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.TreeLayout`).
    """

    count: jax.Array
    error: jax.Array
    log: CommLog
    layout: TreeLayout


def ef_signsgd(axis_name: Any, *, lr: float) -> WholeOptimizer:
    """EF-signSGD (signSGD with error feedback) as an ``optax`` transform.

    From "Error Feedback Fixes SignSGD and other Gradient Compression Schemes" (Karimireddy
    et al., ICML 2019), Algorithm 1, run data-parallel as in the Marsit paper's baselines. Per
    worker, with ``g: f32[d]``::

        p     = lr * g + e
        delta = (||p||_1 / d) * sign(p)        # sign(0) = -1 on the wire
        e     = p - delta

    The payload is ``sign_encode(p, scale=True)``: packed bits ``uint8[ceil(d / 8)]`` plus the
    scale ``||p||_1 / d`` (``f32[]``), ``ceil(d / 8) + 4`` bytes. A ring all-gather gives every
    worker all ``N`` payloads; each decodes them and applies ``-mean_w(delta_w)`` (``lr`` is
    already inside ``p``).

    Args:
      axis_name: data-parallel mesh axis, bound by the enclosing ``shard_map``.
      lr: step size ``> 0``.

    Returns:
      A :class:`~jaxcomm.WholeOptimizer` whose state is an :class:`EFSignState`. Logged as one
      ``"ring_allgather"`` of ``ceil(d / 8) + 4``-byte payloads.
    """
    lr = check_float("lr", lr, lo=0.0, lo_open=True)

    def init_fn(params):
        layout, d = init_layout("ef_signsgd", params)
        state = EFSignState(
            count=jnp.zeros((), jnp.int32),
            error=jnp.zeros((d,), jnp.float32),
            log=empty_log(),
            layout=layout,
        )
        return worker_state(state, axis_name)

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        flat, unflatten = flatten_grads("ef_signsgd", updates, axis_name, state.layout)
        p = lr * flat + state.error  # f32[d]
        payload = sign_encode(p, scale=True)  # bits: uint8[ceil(d / 8)], scale: f32[]
        delta = sign_decode(payload).astype(jnp.float32)  # f32[d], what the others receive
        gathered = ring_all_gather(payload, axis_name)  # bits: [N, ceil(d / 8)], scale: [N]
        direction = jnp.mean(_decode_all(gathered), axis=0)  # f32[d]
        log = log_wire(empty_log(), ring_all_gather_wire(payload, n))
        new_state = EFSignState(state.count + 1, p - delta, log, state.layout)
        new_state = worker_state(new_state, axis_name)
        return unflatten(-direction), new_state

    return whole_optimizer("jaxcomm.ef_signsgd", "lr", init_fn, update_fn)


# ------------------------------------------------------------------------------------- SSDM


class SSDMState(NamedTuple):
    """State of :func:`ssdm`, per worker.

    Attributes:
      count: ``int32[]`` steps done.
      momentum: ``f32[d]`` the momentum ``m`` of the flattened parameters.
      key: ``uint32[2]`` raw PRNG key data, split every step (made distinct per worker by
        folding in the worker's axis index at use).
      log: what the last step sent (one all-gather of stochastic-sign payloads).
      layout: the parameters' structure and shapes (no arrays; see :class:`jaxcomm.TreeLayout`).
    """

    count: jax.Array
    momentum: jax.Array
    key: jax.Array
    log: CommLog
    layout: TreeLayout


def ssdm(axis_name: Any, *, lr: float, momentum: float = 0.9, seed: int = 0) -> WholeOptimizer:
    """SSDM, stochastic sign descent with momentum, as an ``optax`` transform.

    From "Stochastic Sign Descent Methods: New Algorithms and Better Theory" (Safaryan and
    Richtarik, ICML 2021), in the unbiased form the Marsit paper uses (its Sec. 3.2 and
    Appendix A). Per worker, with ``g: f32[d]``::

        m = momentum * m + (1 - momentum) * g
        payload = Q(m) = (stochastic sign bits, ||m||_2)     # stochastic_sign_encode

    The payload is ``ceil(d / 8) + 4`` bytes. A ring all-gather gives every worker all ``N``
    payloads; each applies ``-lr * mean_w(||m_w|| * sign~_w)``, whose expectation is
    ``-lr * mean_w(m_w)``.

    Args:
      axis_name: data-parallel mesh axis, bound by the enclosing ``shard_map``.
      lr: step size ``> 0``.
      momentum: ``beta`` in ``[0, 1)`` (0: no momentum).
      seed: seeds the stochastic signs (``>= 0``).

    Returns:
      A :class:`~jaxcomm.WholeOptimizer` whose state is an :class:`SSDMState`. Logged as one
      ``"ring_allgather"`` of ``ceil(d / 8) + 4``-byte payloads.
    """
    lr = check_float("lr", lr, lo=0.0, lo_open=True)
    beta = check_float("momentum", momentum, lo=0.0, hi=1.0, hi_open=True)
    seed = check_int("seed", seed, lo=0)

    def init_fn(params):
        layout, d = init_layout("ssdm", params)
        state = SSDMState(
            count=jnp.zeros((), jnp.int32),
            momentum=jnp.zeros((d,), jnp.float32),
            key=jax.random.key_data(jax.random.key(seed)),
            log=empty_log(),
            layout=layout,
        )
        return worker_state(state, axis_name)

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        flat, unflatten = flatten_grads("ssdm", updates, axis_name, state.layout)
        m = beta * state.momentum + (1.0 - beta) * flat  # f32[d]
        key, next_key = jax.random.split(jax.random.wrap_key_data(state.key))
        key = jax.random.fold_in(key, lax.axis_index(axis_name))
        payload = stochastic_sign_encode(m, key)  # bits: uint8[ceil(d / 8)], scale: f32[]
        gathered = ring_all_gather(payload, axis_name)  # bits: [N, ceil(d / 8)], scale: [N]
        direction = jnp.mean(_decode_all(gathered), axis=0)  # f32[d]
        log = log_wire(empty_log(), ring_all_gather_wire(payload, n))
        new_state = SSDMState(
            count=state.count + 1,
            momentum=m,
            key=jax.random.key_data(next_key),
            log=log,
            layout=state.layout,
        )
        new_state = worker_state(new_state, axis_name)
        return unflatten(-lr * direction), new_state

    return whole_optimizer("jaxcomm.ssdm", "lr", init_fn, update_fn)


# ---------------------------------------------------------------------- cascading compression


class CascadingState(NamedTuple):
    """State of :func:`cascading_sign`, per worker.

    Attributes:
      count: ``int32[]`` steps done.
      key: ``uint32[2]`` raw PRNG key data, split every step (made distinct per worker and hop
        by folding in the worker's axis index and the hop at use).
      log: what the last step sent (one ring all-reduce of one-bit segment messages).
    """

    count: jax.Array
    key: jax.Array
    log: CommLog


def cascading_sign(axis_name: Any, *, lr: float, seed: int = 0) -> WholeOptimizer:
    """Cascading one-bit compression over a ring all-reduce (the Marsit paper's Sec. 3.2).

    The naive way to keep every hop of a multi-hop all-reduce at one bit per element, which
    the Marsit paper ("Sign Bit is Enough", DAC 2022, Sec. 3.2 and Appendix A) argues against.
    The worker's gradient ``g: f32[d]`` is cut into ``N`` segments ``f32[N, s]``,
    ``s = ceil(d / N)`` (zero-padded). In the ring reduce-scatter each segment's message
    starts as ``Q(segment)`` (SSDM's compressor, :func:`stochastic_sign_encode`), and each hop
    decompresses the received message, adds its own segment and recompresses:
    ``Q(decode(msg) + segment)``; after ``N - 1`` hops the message is the paper's
    ``Q(...Q(Q(s_1) + s_2)... + s_N)``. Every message, at every hop, is ``ceil(s / 8)`` bytes
    of packed stochastic signs plus the ``f32`` norm. A ring all-gather then circulates the
    final messages unchanged, every worker decodes them and applies
    ``-lr * (1 / N) * sum``. The direction is unbiased for ``mean_w(g_w)``, but each
    recompression multiplies the second moment by about ``s``, so
    ``E||direction - mean||^2`` grows rapidly with ``N`` (the paper's Theorem 2).

    Padding elements of the last segment are zeroed after each decode so their noise does not
    enter the next hop's norm.

    Args:
      axis_name: data-parallel mesh axis (the ring), bound by the enclosing ``shard_map``.
      lr: step size ``> 0``.
      seed: seeds the stochastic signs (``>= 0``).

    Returns:
      A :class:`~jaxcomm.WholeOptimizer` whose state is a :class:`CascadingState`. Logged as one
      ``"ring_allreduce"`` with ``message_bytes = N * (ceil(s / 8) + 4)`` (the whole vector as
      packed segment messages) and ``sent_bytes = 2 (N - 1) (ceil(s / 8) + 4)``, measured from
      the segment payload.
    """
    lr = check_float("lr", lr, lo=0.0, lo_open=True)
    seed = check_int("seed", seed, lo=0)

    def init_fn(params):
        del params
        state = CascadingState(
            count=jnp.zeros((), jnp.int32),
            key=jax.random.key_data(jax.random.key(seed)),
            log=empty_log(),
        )
        return worker_state(state, axis_name)

    def update_fn(updates, state, params=None):
        del params
        n = axis_size(axis_name)
        flat, unflatten = flatten_grads("cascading_sign", updates, axis_name)  # f32[d]
        d = flat.shape[0]
        segments = split_segments(flat, n)  # f32[N, s]
        s = segments.shape[1]
        me = lax.axis_index(axis_name)
        key, next_key = jax.random.split(jax.random.wrap_key_data(state.key))
        my_key = jax.random.fold_in(key, me)

        def valid(j):
            # bool[s]: which elements of segment j are real (not padding)
            return j * s + jnp.arange(s) < d

        def init(seg):
            # This worker starts segment (me - 1); hops use keys 0 .. N - 2, so N - 1 is free.
            return stochastic_sign_encode(seg, jax.random.fold_in(my_key, n - 1))

        def combine(msg, seg, step):
            j = (me - step - 2) % n  # the segment index carried by this hop
            received = jnp.where(valid(j), sign_decode(msg).astype(jnp.float32), 0.0)
            return stochastic_sign_encode(received + seg, jax.random.fold_in(my_key, step))

        final = ring_reduce_scatter(segments, axis_name, init=init, combine=combine)
        gathered = ring_all_gather(final, axis_name)  # bits: [N, ceil(s / 8)], scale: [N]
        total = join_segments(_decode_all(gathered), (d,))  # f32[d], sum over workers
        direction = total / n
        log = log_wire(empty_log(), ring_all_reduce_wire(final, n))  # ceil(s / 8) + 4 a hop
        new_state = CascadingState(
            count=state.count + 1, key=jax.random.key_data(next_key), log=log
        )
        new_state = worker_state(new_state, axis_name)
        return unflatten(-lr * direction), new_state

    return whole_optimizer("jaxcomm.cascading_sign", "lr", init_fn, update_fn)
