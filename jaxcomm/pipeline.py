"""GPipe-style pipeline parallelism over a ``stage`` mesh axis, with pluggable boundary codecs.

Each device on the ``stage`` axis holds one stage's parameters. A batch is cut into ``M``
microbatches; at tick ``t`` stage ``s`` runs microbatch ``t - s`` (when ``0 <= t - s < M``),
then sends its output to stage ``s + 1`` with ``ppermute``. ``M + S - 1`` ticks fill and drain
the pipeline; ``jax.grad`` of the summed loss runs the backward pipeline, with the transposed
``ppermute`` carrying activation gradients from stage ``s + 1`` back to ``s``.

What crosses a boundary is decided by a :class:`Boundary`: the sender ``encode``s its output
against the boundary's previous message for those samples and the receiver ``decode``s the
payload into the activation it consumes (FP32, DirectQ and AQ-SGD are such codecs). The
backward message is the activation gradient, optionally quantized to ``bw_bits``
(stochastic, unbiased) before it is sent back. Both sides of a boundary keep their own copy
of the previous messages (``prev_out`` on the sender, ``prev_in`` on the receiver); the codecs
make them agree bit for bit.

Shapes (per device, inside ``shard_map`` over ``axis_name``): microbatched inputs
``[M, mb, ...]``; boundary state ``prev_in``, ``prev_out``: ``[M, mb, *act]``; ``seen``:
``bool[M, mb]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm._checks import axis_size, check_int
from jaxcomm.aqsgd import aqsgd_decode, aqsgd_encode, directq_decode, directq_encode
from jaxcomm.aqsgd import wire_bytes as aqsgd_wire_bytes
from jaxcomm.codecs import dequantize, payload_bytes, quantize, quantized_nbytes

__all__ = [
    "Boundary",
    "BoundaryState",
    "aqsgd_boundary",
    "directq_boundary",
    "fp32_boundary",
    "gpipe",
]


@dataclasses.dataclass(frozen=True)
class Boundary:
    """How activations cross a stage boundary.

    Attributes:
      encode: ``(activation, prev, seen, key) -> (payload, new_prev)`` on the sender;
        ``activation``/``prev``: ``f32[mb, *act]``, ``seen``: ``bool[mb]``.
      decode: ``(payload, prev, seen) -> new_prev`` on the receiver; ``new_prev`` is what the
        next stage consumes and must equal the sender's ``new_prev``.
      bw_bits: bits of the activation gradient sent back (``None``: float32).
      bw_bucket: bucket size of the backward quantizer (``None``: the activation's last
        axis, one scale per token).
      wire_bytes: ``(payload, seen) -> int32[]`` bytes of a payload that actually cross the
        link (``None``: all of the payload's arrays).
    """

    encode: Callable
    decode: Callable
    bw_bits: int | None = None
    bw_bucket: int | None = None
    wire_bytes: Callable | None = None


def fp32_boundary(bw_bits: int | None = None) -> Boundary:
    """Uncompressed forward: the activation itself; its gradient back (optionally quantized)."""
    return Boundary(
        encode=lambda a, prev, seen, key: (a, a),
        decode=lambda payload, prev, seen: payload,
        bw_bits=bw_bits,
    )


def directq_boundary(fw_bits: int, bw_bits: int | None) -> Boundary:
    """DirectQ baseline: the activation itself quantized to ``fw_bits``, no message buffer."""
    fw_bits = check_int("fw_bits", fw_bits, lo=1, hi=8)

    def encode(a, prev, seen, key):
        payload = directq_encode(a, key, bits=fw_bits)
        return payload, directq_decode(payload)

    return Boundary(
        encode=encode, decode=lambda payload, prev, seen: directq_decode(payload), bw_bits=bw_bits
    )


def aqsgd_boundary(fw_bits: int, bw_bits: int | None) -> Boundary:
    """AQ-SGD: quantized deltas against the per-sample previous messages, ``fw_bits`` bits.

    A sample's first visit crosses in full precision; later visits send
    ``Q(activation - previous)`` and both sides set ``previous += dequantize``.
    """
    fw_bits = check_int("fw_bits", fw_bits, lo=1, hi=8)
    return Boundary(
        encode=lambda a, prev, seen, key: aqsgd_encode(a, prev, seen, key, bits=fw_bits),
        decode=aqsgd_decode,
        bw_bits=bw_bits,
        wire_bytes=aqsgd_wire_bytes,
    )


class BoundaryState(NamedTuple):
    """Per-device boundary messages for one step.

    Attributes:
      prev_in: ``f32[M, mb, *act]`` previous messages of the incoming boundary (receiver).
      prev_out: ``f32[M, mb, *act]`` previous messages of the outgoing boundary (sender).
      seen_in: ``bool[M, mb]`` samples seen before at the incoming boundary.
      seen_out: ``bool[M, mb]`` samples seen before at the outgoing boundary.
    """

    prev_in: jax.Array
    prev_out: jax.Array
    seen_in: jax.Array
    seen_out: jax.Array


def _take(tree: Any, i: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(buf: jax.Array, value: jax.Array, i: jax.Array, ok: jax.Array) -> jax.Array:
    old = lax.dynamic_index_in_dim(buf, i, keepdims=False)
    return lax.dynamic_update_index_in_dim(buf, jnp.where(ok, value, old), i, 0)


def _make_transfer(boundary: Boundary, axis_name: Any, n: int):
    fwd_perm = [(j, j + 1) for j in range(n - 1)]
    bwd_perm = [(j + 1, j) for j in range(n - 1)]

    def send(y, prev_out, seen_out, prev_in, seen_in, key):
        payload, new_out = boundary.encode(y, prev_out, seen_out, key)
        received = lax.ppermute(payload, axis_name, fwd_perm)
        new_in = boundary.decode(received, prev_in, seen_in)
        return new_in, new_out, payload

    def count(payload, seen):
        if boundary.wire_bytes is None:
            return jnp.int32(payload_bytes(payload))
        return boundary.wire_bytes(payload, seen)

    @jax.custom_vjp
    def transfer(y, prev_out, seen_out, prev_in, seen_in, key):
        new_in, new_out, payload = send(y, prev_out, seen_out, prev_in, seen_in, key)
        return new_in, new_out, lax.stop_gradient(count(payload, seen_out))

    def fwd(y, prev_out, seen_out, prev_in, seen_in, key):
        return transfer(y, prev_out, seen_out, prev_in, seen_in, key), key

    def bwd(key, cotangents):
        g_in = cotangents[0]  # gradient w.r.t. what the receiver consumed
        if boundary.bw_bits is None:
            back = lax.ppermute(g_in, axis_name, bwd_perm)
        else:
            k = jax.random.fold_in(key, 1)
            bucket = boundary.bw_bucket or g_in.shape[-1]
            q = quantize(g_in, k, bits=boundary.bw_bits, bucket_size=bucket)
            back = dequantize(lax.ppermute(q, axis_name, bwd_perm))
        # Straight-through: d(received)/d(sent activation) is the identity; the previous
        # messages and flags are state, not differentiated.
        return (back, None, None, None, None, None)

    transfer.defvjp(fwd, bwd)
    return transfer


def gpipe(
    first_fn: Callable[[Any, Any], jax.Array],
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    last_fn: Callable[[Any, jax.Array, Any], jax.Array],
    *,
    axis_name: Any = "stage",
    boundary: Boundary | None = None,
) -> Callable:
    """Build a per-device pipelined loss for use inside ``shard_map`` over ``axis_name``.

    Args:
      first_fn: ``(params, micro_inputs) -> f32[mb, *act]``, stage 0's input layer (e.g.
        the embedding); evaluated on every stage, used only on stage 0.
      stage_fn: ``(params, h) -> h`` this stage's layers.
      last_fn: ``(params, h, micro_inputs) -> f32[]`` loss of one microbatch (mean over its
        samples) on the last stage.
      axis_name: the pipeline mesh axis.
      boundary: codec of the stage boundaries (default :func:`fp32_boundary`).

    Returns:
      ``loss_fn(params, inputs, state, key) -> (loss, (new_state, fw_bytes, bw_bytes))``:
      ``inputs`` is a pytree of ``[M, mb, ...]`` arrays (replicated over stages), ``state`` a
      :class:`BoundaryState`; ``loss`` is the mean microbatch loss, the same on every stage;
      ``fw_bytes`` (``int32[]``) the forward bytes this stage sent in the step, counted from
      the payloads (0 on the last stage), and ``bw_bytes`` (Python int) the activation-gradient
      bytes each non-first stage sends back.
      Differentiate ``loss`` w.r.t. ``params`` with ``jax.grad``/``value_and_grad``
      (``has_aux=True``).
    """
    boundary = boundary or fp32_boundary()

    def loss_fn(params, inputs, state: BoundaryState, key):
        n = axis_size(axis_name)
        s = lax.axis_index(axis_name)
        m_total = jax.tree_util.tree_leaves(inputs)[0].shape[0]
        check_int("number of microbatches", m_total, lo=1)
        transfer = _make_transfer(boundary, axis_name, n)
        h0 = first_fn(params, _take(inputs, 0))

        def tick(carry, t):
            h_recv, st, total, sent = carry
            m = t - s
            mi = jnp.clip(m, 0, m_total - 1)
            micro = _take(inputs, mi)
            x = jnp.where(s == 0, first_fn(params, micro), h_recv)
            y = stage_fn(params, x)
            ok = (m >= 0) & (m < m_total)
            total = total + jnp.where(ok & (s == n - 1), last_fn(params, y, micro), 0.0)
            # Receiver side of this tick's transfer handles microbatch m + 1 next tick.
            mr = jnp.clip(m + 1, 0, m_total - 1)
            ok_out = ok & (s < n - 1)
            ok_in = (m + 1 >= 0) & (m + 1 < m_total) & (s > 0)
            k = jax.random.fold_in(jax.random.fold_in(key, t), s)
            new_in, new_out, nbytes = transfer(
                y,
                lax.stop_gradient(_take(st.prev_out, mi)),
                _take(st.seen_out, mi),
                lax.stop_gradient(_take(st.prev_in, mr)),
                _take(st.seen_in, mr),
                k,
            )
            st = BoundaryState(
                prev_in=_put(st.prev_in, lax.stop_gradient(new_in), mr, ok_in),
                prev_out=_put(st.prev_out, lax.stop_gradient(new_out), mi, ok_out),
                seen_in=_put(st.seen_in, jnp.ones_like(st.seen_in[0]), mr, ok_in),
                seen_out=_put(st.seen_out, jnp.ones_like(st.seen_out[0]), mi, ok_out),
            )
            sent = sent + jnp.where(ok_out, nbytes, 0)
            return (new_in, st, total, sent), None

        ticks = jnp.arange(m_total + n - 1)
        init = (jnp.zeros_like(h0), state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        (_, new_state, total, fw_bytes), _ = lax.scan(tick, init, ticks)
        # The value is the loss summed over stages (only the last one has it); the gradient
        # is this stage's own, since the backward pipeline already reaches the earlier
        # stages through the transposed ppermute (a psum here would scale it by N).
        local = total / m_total
        loss = lax.psum(lax.stop_gradient(local), axis_name) + (local - lax.stop_gradient(local))
        if boundary.bw_bits is None:
            grad_msg = 4 * h0.size
        else:
            bucket = boundary.bw_bucket or h0.shape[-1]
            grad_msg = quantized_nbytes(h0.size, bits=boundary.bw_bits, bucket_size=bucket)
        bw_bytes = m_total * grad_msg if n > 1 else 0
        return loss, (new_state, fw_bytes, bw_bytes)

    return loss_fn
