"""GPipe-style pipeline parallelism over a ``stage`` mesh axis, with pluggable boundary codecs.

Each device on the ``stage`` axis holds one stage's parameters. A batch is cut into ``M``
microbatches; at tick ``t`` stage ``s`` runs microbatch ``t - s`` (when ``0 <= t - s < M``),
then sends its output to stage ``s + 1``. ``M + S - 1`` ticks fill and drain the pipeline;
``jax.grad`` of the summed loss runs the backward pipeline, whose transfers carry activation
gradients from stage ``s + 1`` back to ``s``.

**Only real messages cross.** The stages that hold a microbatch at tick ``t`` are known when
the program is built, so each tick's ``ppermute`` lists only the boundaries that carry one:
a bubble tick sends nothing, the last stage sends nothing forward and the first nothing
back. Ticks with the same set of active boundaries run as one ``lax.scan`` (the steady
state), the others (filling and draining) are unrolled, so the compiled program has at most
``2 S - 1`` tick bodies. Each message is one packed ``uint8`` buffer (codes and scales
together, see :func:`jaxcomm.collectives.send`). The embedding runs only on stage 0 and the
loss head only on the last stage (``lax.cond`` on the stage index).

What crosses a boundary is decided by a :class:`Boundary`: the sender ``encode``s its output
against the boundary's previous message for those samples and the receiver ``decode``s the
payload into the activation it consumes (FP32, DirectQ and AQ-SGD, the codecs of
:mod:`jaxcomm.aqsgd`). The backward message is the activation gradient, optionally quantized
to ``bw_bits`` with :func:`jaxcomm.aqsgd.directq_encode` (stochastic, unbiased). Both sides of
a boundary keep their own copy of the previous messages (``prev_in`` on the receiver,
``prev_out`` on the sender); the codecs make them agree bit for bit.

Every transfer gets its own key ``fold_in(fold_in(key, tick), stage)``, split once into the
forward and backward rounding keys (each then split per row), so no two roundings share
noise.

Shapes (per device, inside ``shard_map`` over ``axis_name``): microbatched inputs
``[M, mb, ...]``; boundary state ``prev_in``, ``prev_out``: ``[M, mb, *act]``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._src._checks import axis_size, check_int
from jaxcomm._src.aqsgd import (
    RowCodec,
    aqsgd_decode,
    aqsgd_encode,
    delta_decode,
    delta_encode,
    directq_decode,
    directq_encode,
    fp32_decode,
    fp32_encode,
    quantized_rows,
)
from jaxcomm._src.codecs import payload_bytes
from jaxcomm._src.collectives import psum, psum_wire, send
from jaxcomm._src.network import CommLog, empty_log, log_collective, log_wire, words_table

__all__ = [
    "Boundary",
    "BoundaryState",
    "delta_boundary",
    "aqsgd_boundary",
    "directq_boundary",
    "fp32_boundary",
    "GPipeTimeline",
    "boundary_message_bytes",
    "gpipe",
    "gpipe_timeline",
    "gpipe_value_and_grad",
    "pipeline_ticks",
    "TICK_SCOPE",
    "FIRST_SCOPE",
    "LAST_SCOPE",
]

TICK_SCOPE = "gpipe_tick"  # jax.named_scope of a tick's ops (its backward: transpose(...))
# jax.named_scope of the first stage's input function and the last stage's loss inside a
# tick: each runs under a lax.cond on the stage index, so a cost model that cannot tell
# the branch per device can find their ops by name.
FIRST_SCOPE = "gpipe_first"
LAST_SCOPE = "gpipe_last"


# Set while :func:`gpipe_value_and_grad` traces a loss: only then does a boundary's gradient
# memory come back (as a cotangent), so a loss differentiated otherwise refuses it.
_MEMORY_PASS = contextvars.ContextVar("jaxcomm_gpipe_memory_pass", default=False)


@contextlib.contextmanager
def _memory_pass():
    token = _MEMORY_PASS.set(True)
    try:
        yield
    finally:
        _MEMORY_PASS.reset(token)


def _scoped(scope: str, fn: Callable, *args: Any) -> Any:
    with jax.named_scope(scope):
        return fn(*args)


@dataclasses.dataclass(frozen=True)
class Boundary:
    """How activations cross a stage boundary.

    Attributes:
      encode: ``(activation, prev, key, seen) -> (payload, new_prev)`` on the sender;
        ``activation``/``prev``: ``f32[mb, *act]``, ``seen`` a static bool (the microbatch
        crossed before). The payload's arrays are exactly the bytes sent.
      decode: ``(payload, prev) -> new_prev`` on the receiver; ``new_prev`` is what the next
        stage consumes and must equal the sender's ``new_prev``.
      bw_bits: bits of the activation gradient sent back (``None``: float32), quantized
        stochastically (:func:`jaxcomm.pipeline.quantized_rows`).
      bw_bucket: bucket size of the backward quantizer (``None``: the activation's last
        axis, one scale per token).
      uses_buffer: whether ``encode``/``decode`` read the previous messages (AQ-SGD), so the
        caller must keep a message buffer.
      backward: the activation gradient's codec, any :class:`jaxcomm.pipeline.RowCodec` (e.g.
        :func:`jaxcomm.pipeline.topk_rows`); when given, ``bw_bits`` and ``bw_bucket`` are unused.
      bw_memory: the activation gradient crosses as a delta against a per-sample gradient
        memory (``BoundaryState.grad_in``/``grad_out``), as the forward does against the
        previous messages; differentiate with :func:`gpipe_value_and_grad` to get it back.
    """

    encode: Callable
    decode: Callable
    bw_bits: int | None = None
    bw_bucket: int | None = None
    uses_buffer: bool = False
    backward: RowCodec | None = None
    bw_memory: bool = False

    def __post_init__(self):
        if not isinstance(self.bw_memory, bool):
            raise TypeError(f"bw_memory must be a bool, got {self.bw_memory!r}")
        if self.bw_memory and self.bw_codec is None:
            raise ValueError(
                "bw_memory=True needs a compressed backward (backward or bw_bits): a float32 "
                "gradient loses nothing that a memory could keep"
            )

    @property
    def bw_codec(self) -> RowCodec | None:
        """The codec of the activation gradient sent back (``None``: float32)."""
        if self.backward is not None:
            return self.backward
        return None if self.bw_bits is None else quantized_rows(self.bw_bits, self.bw_bucket)


def _bw(bw_bits: int | None) -> int | None:
    return None if bw_bits is None else check_int("bw_bits", bw_bits, lo=1, hi=8)


def fp32_boundary(bw_bits: int | None = None) -> Boundary:
    """Uncompressed forward: the activation itself; its gradient back (optionally quantized)."""
    return Boundary(
        encode=lambda a, prev, key, seen: (fp32_encode(a), a),
        decode=lambda payload, prev: fp32_decode(payload),
        bw_bits=_bw(bw_bits),
    )


def directq_boundary(fw_bits: int, bw_bits: int | None) -> Boundary:
    """DirectQ baseline: the activation itself quantized to ``fw_bits``, no message buffer."""
    fw_bits = check_int("fw_bits", fw_bits, lo=1, hi=8)

    def encode(a, prev, key, seen):
        payload = directq_encode(a, key, bits=fw_bits)
        return payload, directq_decode(payload)

    return Boundary(
        encode=encode, decode=lambda payload, prev: directq_decode(payload), bw_bits=_bw(bw_bits)
    )


def aqsgd_boundary(fw_bits: int, bw_bits: int | None) -> Boundary:
    """AQ-SGD: quantized deltas against the per-sample previous messages, ``fw_bits`` bits.

    A microbatch's first visit (``seen=False``) crosses in float32; later visits send
    ``Q(activation - previous)`` and both sides set ``previous += dequantize``
    (:func:`jaxcomm.pipeline.aqsgd_encode`).
    """
    fw_bits = check_int("fw_bits", fw_bits, lo=1, hi=8)
    return Boundary(
        encode=lambda a, prev, key, seen: aqsgd_encode(a, prev, seen, key, bits=fw_bits),
        decode=aqsgd_decode,
        bw_bits=_bw(bw_bits),
        uses_buffer=True,
    )


def delta_boundary(
    forward: RowCodec,
    backward: RowCodec | None = None,
    *,
    first: RowCodec | None = None,
    backward_memory: bool = False,
) -> Boundary:
    """AQ-SGD's delta scheme with any codec each way.

    Forward: a microbatch's first visit crosses in float32 (or compressed by ``first``, a
    deviation from the paper); later visits send ``forward(activation - previous)`` and both
    sides add exactly what was sent to their previous messages
    (:func:`jaxcomm.pipeline.delta_encode`), so with a biased codec such as
    :func:`jaxcomm.pipeline.topk_rows` what was not sent stays in the buffer for the next visit.
    Backward: the activation gradient by ``backward`` (``None``: float32); there is no
    buffer on that side, so a biased codec's loss is not fed back.
    ``aqsgd_boundary(f, b)`` is ``delta_boundary(quantized_rows(f), quantized_rows(b))``.

    AQ-SGD's guarantee (convergence at the rate of uncompressed SGD when the activations'
    changes shrink) is proved for an unbiased forward quantizer and an unbiased backward
    one: it covers :func:`jaxcomm.pipeline.quantized_rows` each way at any bucket size (its
    constants grow with the quantizer's variance, so with the bucket). It does not
    cover :func:`jaxcomm.pipeline.topk_rows` or :func:`jaxcomm.pipeline.lowrank_rows`
    (biased): forward, the
    buffer keeps what they leave out and sends it at later visits (error feedback, whose
    own analyses bound the error for contractive codes like these); backward there is no
    buffer, and what they drop of the activation gradient is lost (as in meProp's top-k
    backpropagation). A compressed first visit starts the buffer off the activation, which
    later deltas correct.

    ``backward_memory=True`` (not in the AQ-SGD paper) gives the backward direction the
    forward's scheme: each sample's activation gradient crosses as
    ``backward(gradient - memory)`` and both sides add what was sent to a per-sample
    gradient memory, which the receiver backpropagates. What a biased ``backward`` leaves
    out is then sent at the sample's later visits instead of being lost (error feedback
    per sample); the price is that the gradient used lags the true one by that residual.
    The memory is ``BoundaryState.grad_in``/``grad_out`` (as large as the message buffer),
    returned by :func:`gpipe_value_and_grad`. A gradient's first visit (``seen=False``)
    crosses by ``backward`` itself (``first`` is the forward's) and starts the memory.
    """
    for name, codec in (("forward", forward), ("backward", backward), ("first", first)):
        if not isinstance(codec, RowCodec) and (codec is not None or name == "forward"):
            raise TypeError(f"{name} must be a RowCodec, got {type(codec).__name__}")
    if not isinstance(backward_memory, bool):
        raise TypeError(f"backward_memory must be a bool, got {backward_memory!r}")
    if backward_memory and backward is None:
        raise ValueError(
            "backward_memory=True needs a backward codec: a float32 gradient loses nothing "
            "that a memory could keep"
        )
    return Boundary(
        encode=lambda a, prev, key, seen: delta_encode(a, prev, seen, key, forward, first=first),
        decode=delta_decode,
        uses_buffer=True,
        backward=backward,
        bw_memory=backward_memory,
    )


class BoundaryState(NamedTuple):
    """Per-device boundary messages for one step.

    Attributes:
      prev_in: ``f32[M, mb, *act]`` previous messages of the incoming boundary (receiver).
      prev_out: ``f32[M, mb, *act]`` previous messages of the outgoing boundary (sender).
      grad_in: ``f32[M, mb, *act]`` gradient memory of the incoming boundary (this device
        sends its gradients), only with a boundary's ``bw_memory``; else ``None``.
      grad_out: ``f32[M, mb, *act]`` gradient memory of the outgoing boundary (this device
        receives the gradients), only with ``bw_memory``; else ``None``.
    """

    prev_in: jax.Array
    prev_out: jax.Array
    grad_in: jax.Array | None = None
    grad_out: jax.Array | None = None


def pipeline_ticks(microbatches: int, stages: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """The GPipe schedule as runs of ticks: ``[(start, stop, senders), ...]``.

    Ticks ``start .. stop - 1`` share the set ``senders`` of stages that send a microbatch
    forward (stage ``s`` sends at tick ``t`` when ``0 <= t - s < M`` and ``s < S - 1``); the
    runs cover ticks ``0 .. M + S - 2``. The last tick sends nothing.
    """
    m = check_int("microbatches", microbatches, lo=1)
    n = check_int("stages", stages, lo=1)
    runs: list[tuple[int, int, tuple[int, ...]]] = []
    for t in range(m + n - 1):
        senders = tuple(s for s in range(n - 1) if 0 <= t - s < m)
        if runs and runs[-1][2] == senders:
            runs[-1] = (runs[-1][0], t + 1, senders)
        else:
            runs.append((t, t + 1, senders))
    return runs


def _take(tree: Any, i: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(buf: jax.Array, value: jax.Array, i: jax.Array, ok: jax.Array) -> jax.Array:
    old = lax.dynamic_index_in_dim(buf, i, keepdims=False)
    return lax.dynamic_update_index_in_dim(buf, jnp.where(ok, value, old), i, 0)


def _make_transfer(boundary: Boundary, axis_name: Any, senders: tuple[int, ...], seen: bool):
    """One tick's transfer over the boundaries ``s -> s + 1`` for ``s`` in ``senders``."""
    fwd_perm = [(j, j + 1) for j in senders]
    bwd_perm = [(j + 1, j) for j in senders]

    # ``mem_in``/``mem_out``: this tick's rows of the gradient memory (``None`` without
    # ``bw_memory``); ``ok_in``/``ok_out``: whether the tick receives / sends a microbatch.
    @jax.custom_vjp
    def transfer(y, prev_out, prev_in, key, mem_in, mem_out, ok_in, ok_out):
        k_fw, _ = jax.random.split(key)
        payload, new_out = boundary.encode(y, prev_out, k_fw, seen)
        new_in = boundary.decode(send(payload, axis_name, fwd_perm), prev_in)
        return new_in, new_out

    def fwd(y, prev_out, prev_in, key, mem_in, mem_out, ok_in, ok_out):
        out = transfer(y, prev_out, prev_in, key, mem_in, mem_out, ok_in, ok_out)
        return out, (key, mem_in, mem_out, ok_in, ok_out)

    codec = boundary.bw_codec

    def bwd(res, cotangents):
        key, mem_in, mem_out, ok_in, ok_out = res
        g_in = cotangents[0]  # gradient w.r.t. what the receiver consumed
        d_in = d_out = None
        if codec is None:
            back = send(g_in, axis_name, bwd_perm)
        elif mem_in is None:
            _, k_bw = jax.random.split(key)
            back = codec.decode(send(codec.encode(g_in, k_bw), axis_name, bwd_perm))
        else:
            # A delta against the gradient memory, the first visit sent by the same codec.
            # The memories' cotangents carry their new rows (zero where the tick sends or
            # receives no microbatch), bit-identical on both sides.
            _, k_bw = jax.random.split(key)
            payload, mine = delta_encode(g_in, mem_in, seen, k_bw, codec, first=codec)
            # A tick that sent no microbatch forward receives nothing; its memory row
            # must not leak into the bubble's gradient.
            back = jnp.where(ok_out, delta_decode(send(payload, axis_name, bwd_perm), mem_out), 0.0)
            d_in = jnp.where(ok_in, mine, 0.0)
            d_out = back
        # Straight-through: d(received)/d(sent activation) is the identity; the previous
        # messages are state, not differentiated.
        return (back, None, None, None, d_in, d_out, None, None)

    transfer.defvjp(fwd, bwd)
    return transfer


def boundary_message_bytes(
    boundary: Boundary, act: jax.ShapeDtypeStruct, seen: bool
) -> tuple[int, int]:
    """Bytes of one forward and one backward message of ``boundary`` for an activation of
    shape ``act`` (one microbatch), read from the payloads' shapes: ``(forward, backward)``.
    ``seen`` is the boundary mode (AQ-SGD sends deltas once every sample was seen)."""
    key = jax.random.key(0)
    fw = jax.eval_shape(lambda a: boundary.encode(a, a, key, seen)[0], act)
    codec = boundary.bw_codec
    if codec is None:
        return payload_bytes(fw), payload_bytes(act)
    return payload_bytes(fw), codec.nbytes(act.shape)


def _p2p_log(log: CommLog, runs, message: int, sent: list[int], index: Any, m: int) -> CommLog:
    """Log one direction's point-to-point traffic: ``m`` messages per boundary, one round per
    tick that carries any (``message`` bytes along the path each such tick)."""
    ticks = sum(stop - start for start, stop, senders in runs if senders)
    return log_collective(
        log,
        "p2p",
        sum(sent),
        words_table(sent)[index],
        rounds=ticks,
        path_bytes=ticks * message,
        calls=max(m, 1),
    )


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
        the embedding); runs on stage 0 only.
      stage_fn: ``(params, h) -> h`` this stage's layers.
      last_fn: ``(params, h, micro_inputs) -> f32[]`` loss of one microbatch (mean over its
        samples); runs on the last stage only.
      axis_name: the pipeline mesh axis.
      boundary: codec of the stage boundaries (default :func:`fp32_boundary`).

    Returns:
      ``loss_fn(params, inputs, state, key, seen=False, backward=True)`` returning
      ``(loss, (new_state, log))``:
      ``inputs`` is a pytree of ``[M, mb, ...]`` arrays (replicated over stages), ``state`` a
      :class:`BoundaryState`, ``seen`` a static bool (every sample of the step crossed the
      boundaries before; AQ-SGD then sends deltas, see :mod:`jaxcomm.aqsgd`). ``loss`` is
      the mean microbatch loss, the same on every stage; ``log`` a :class:`CommLog` of this
      device's traffic in the step: ``p2p`` messages (forward activations and backward
      gradients, one round per tick that carries any) and the 4-byte ``allreduce`` that
      shares the loss. The backward messages are logged unless ``backward=False`` (a
      forward-only call, e.g. evaluation, sends none). Differentiate ``loss`` w.r.t.
      ``params`` with ``jax.grad`` or ``value_and_grad`` (``has_aux=True``); with a
      boundary that keeps a gradient memory (``bw_memory``), use
      :func:`gpipe_value_and_grad`, which also returns the memory's new rows.
    """
    boundary = boundary or fp32_boundary()

    def loss_fn(params, inputs, state: BoundaryState, key, seen: bool = False, backward=True):
        if isinstance(seen, np.bool_):
            seen = bool(seen)
        if not isinstance(seen, bool):
            raise TypeError(
                f"seen must be a static bool (Python or NumPy), got {type(seen).__name__} "
                f"{seen!r}; a traced flag cannot choose the payload layout"
            )
        n = axis_size(axis_name)
        s = lax.axis_index(axis_name)
        leaves = jax.tree_util.tree_leaves_with_path(inputs)
        shapes = {jax.tree_util.keystr(k): tuple(jnp.shape(x)) for k, x in leaves}
        if not leaves or any(len(v) == 0 for v in shapes.values()):
            raise ValueError(
                f"inputs must be a non-empty pytree of [M, mb, ...] arrays, got shapes {shapes}"
            )
        m_total = check_int("number of microbatches", leaves[0][1].shape[0], lo=1)
        if len({v[0] for v in shapes.values()}) != 1:
            raise ValueError(
                "inputs leaves must share their leading (microbatch) dimension M, got shapes "
                f"{shapes}"
            )
        act = jax.eval_shape(first_fn, params, _take(inputs, 0))
        want = (m_total, *act.shape)
        memory = boundary.bw_memory
        if memory and backward and not _MEMORY_PASS.get():
            raise ValueError(
                "this boundary keeps a gradient memory (bw_memory): differentiate the loss "
                "with jaxcomm.pipeline.gpipe_value_and_grad(loss_fn), which returns the memory's "
                "new "
                "rows (jax.value_and_grad would leave the memory unchanged); pass "
                "backward=False for a forward-only call"
            )
        for name in ("prev_in", "prev_out", "grad_in", "grad_out"):
            value = getattr(state, name)
            if name.startswith("grad") and not memory:
                continue
            if value is None:
                raise ValueError(
                    f"state.{name} is None; a boundary with bw_memory needs the gradient "
                    f"memory as well, shape [M, *activation] = {want}"
                )
            got = tuple(jnp.shape(value))
            if got != want:
                raise ValueError(
                    f"state.{name} must have shape [M, *activation] = {want}, got {got}"
                )
        zero_act = jnp.zeros(act.shape, act.dtype)

        def tick(carry, t, senders):
            with jax.named_scope(TICK_SCOPE):
                return tick_body(carry, t, senders)

        def tick_body(carry, t, senders):
            h_recv, st, total = carry
            m = t - s
            mi = jnp.clip(m, 0, m_total - 1)
            micro = _take(inputs, mi)
            x = lax.cond(
                s == 0, lambda: _scoped(FIRST_SCOPE, first_fn, params, micro), lambda: h_recv
            )
            y = stage_fn(params, x)
            ok = (m >= 0) & (m < m_total)
            loss = lax.cond(
                ok & (s == n - 1),
                lambda: _scoped(LAST_SCOPE, last_fn, params, y, micro).astype(jnp.float32),
                lambda: jnp.zeros((), jnp.float32),
            )
            if not senders:
                return (h_recv, st, total + loss), None
            # Receiver side of this tick's transfer handles microbatch m + 1 next tick.
            mr = jnp.clip(m + 1, 0, m_total - 1)
            ok_out = ok & (s < n - 1)
            ok_in = (m + 1 >= 0) & (m + 1 < m_total) & (s > 0)
            k = jax.random.fold_in(jax.random.fold_in(key, t), s)
            new_in, new_out = _make_transfer(boundary, axis_name, senders, seen)(
                y,
                lax.stop_gradient(_take(st.prev_out, mi)),
                lax.stop_gradient(_take(st.prev_in, mr)),
                k,
                _take(st.grad_in, mr) if memory else None,
                _take(st.grad_out, mi) if memory else None,
                ok_in,
                ok_out,
            )
            st = st._replace(
                prev_in=_put(st.prev_in, lax.stop_gradient(new_in), mr, ok_in),
                prev_out=_put(st.prev_out, lax.stop_gradient(new_out), mi, ok_out),
            )
            return (new_in, st, total + loss), None

        runs = pipeline_ticks(m_total, n)
        given = state
        if not memory:
            state = state._replace(grad_in=None, grad_out=None)
        carry = (zero_act, state, jnp.zeros((), jnp.float32))
        for start, stop, senders in runs:
            body = lambda c, t, senders=senders: tick(c, t, senders)  # noqa: E731
            if stop - start == 1:
                carry, _ = body(carry, jnp.int32(start))
            else:
                carry, _ = lax.scan(body, carry, jnp.arange(start, stop, dtype=jnp.int32))
        _, new_state, total = carry
        # The gradient memory's new rows come back as its cotangent
        # (:func:`gpipe_value_and_grad`); the value returned here is the one passed in.
        new_state = new_state._replace(grad_in=given.grad_in, grad_out=given.grad_out)
        # The value is the loss summed over stages (only the last one has it); the gradient
        # is this stage's own, since the backward pipeline already reaches the earlier
        # stages through the transposed transfers (a psum here would scale it by N).
        local = total / m_total
        shared = psum(lax.stop_gradient(local), axis_name)
        loss = shared + (local - lax.stop_gradient(local))

        fw_msg, bw_msg = boundary_message_bytes(boundary, act, seen)
        log = _p2p_log(empty_log(), runs, fw_msg, [m_total * fw_msg] * (n - 1) + [0], s, m_total)
        if backward:  # sent only when the loss is differentiated
            log = _p2p_log(log, runs, bw_msg, [0] + [m_total * bw_msg] * (n - 1), s, m_total)
        log = log_wire(log, psum_wire(local, n), s)
        return loss, (new_state, log)

    loss_fn.bw_memory = boundary.bw_memory  # read by gpipe_value_and_grad
    return loss_fn


def gpipe_value_and_grad(loss_fn: Callable) -> Callable:
    """``jax.value_and_grad`` of a :func:`gpipe` loss w.r.t. ``params`` that also updates
    the boundaries' gradient memory (``bw_memory``, see :func:`jaxcomm.pipeline.delta_boundary`).

    The memory's new rows are its cotangent: the backward pass writes, at each boundary,
    exactly what was sent (both sides bit-identical), and zero where nothing crossed (the
    first stage's ``grad_in``, the last stage's ``grad_out``). Without a memory this is
    ``jax.value_and_grad(loss_fn, has_aux=True)``.

    Returns:
      ``f(params, inputs, state, key, seen=False) -> ((loss, (new_state, log)), grads)``
      with ``new_state`` carrying the new gradient memory.
    """

    def value_and_grad(params, inputs, state: BoundaryState, key, seen: bool = False):
        # A loss not made by gpipe (a wrapper) says nothing: its memory, if any, is taken.
        keeps = getattr(loss_fn, "bw_memory", True)
        plain = state.grad_in is None and state.grad_out is None
        if plain or not keeps:  # a memory given to a boundary without one passes through
            with _memory_pass():  # (a missing memory is then named by the loss's own check)
                f = jax.value_and_grad(loss_fn, has_aux=True)
                return f(params, inputs, state, key, seen)
        memory = (state.grad_in, state.grad_out)

        def with_memory(params, memory):
            st = state._replace(grad_in=memory[0], grad_out=memory[1])
            return loss_fn(params, inputs, st, key, seen)

        f = jax.value_and_grad(with_memory, argnums=(0, 1), has_aux=True)
        with _memory_pass():
            (loss, (new_state, log)), (grads, new_memory) = f(params, memory)
        new_state = new_state._replace(grad_in=new_memory[0], grad_out=new_memory[1])
        return (loss, (new_state, log)), grads

    return value_and_grad


@dataclasses.dataclass(frozen=True)
class GPipeTimeline:
    """Event times of one GPipe step (see :func:`gpipe_timeline`), in seconds.

    Attributes:
      seconds: the step: when the last backward ends.
      forward: ``float64[S, M, 2]`` start and end of stage ``s``'s forward of microbatch
        ``m``.
      backward: ``float64[S, M, 2]`` the same for the backward.
    """

    seconds: float
    forward: np.ndarray
    backward: np.ndarray


def gpipe_timeline(
    stages: int,
    microbatches: int,
    forward_s: Any,
    backward_s: Any,
    forward_transfer_s: Any = 0.0,
    backward_transfer_s: Any = 0.0,
    *,
    overlap: bool = False,
) -> GPipeTimeline:
    """Seconds of one GPipe step (all forwards, then all backwards), event by event.

    Stage ``s`` runs the forward of microbatches ``0 .. M-1`` in order, each once it holds
    the microbatch's input (stage 0 always does; stage ``s > 0`` once stage ``s - 1``'s
    message arrived) and its previous microbatch is done, then sends the output to
    ``s + 1``. A boundary carries one message at a time, so a message also waits for the
    one before it. The backward starts on each stage after its last forward (GPipe's
    flush) and runs the microbatches ``M-1 .. 0`` from the last stage to the first the same
    way, each gradient sent to ``s - 1``. With ``overlap=False`` a stage does not compute
    while it sends (a send blocks it until delivered); with ``overlap=True`` sends proceed
    beside the next compute. Without overlap and with equal stages this is the lockstep
    schedule of :func:`gpipe`: ``(M + S - 1) (f + b) + (M + S - 2) (t_f + t_b)``.

    Args:
      stages: ``S >= 1``.
      microbatches: ``M >= 1``.
      forward_s, backward_s: one microbatch's compute seconds on each stage: a number or
        ``[S]``.
      forward_transfer_s, backward_transfer_s: seconds of one message over boundary
        ``s -> s + 1`` (forward) and ``s + 1 -> s`` (backward): a number, ``[S - 1]``, or
        ``[S - 1, M]`` for each microbatch's message on its own (e.g. with latency jitter).
      overlap: whether a stage computes while its messages are on the wire.

    Returns:
      A :class:`GPipeTimeline`.
    """
    n = check_int("stages", stages, lo=1)
    m = check_int("microbatches", microbatches, lo=1)

    def seconds(name, value, size, per_message=False):
        a = np.asarray(value, np.float64)
        if a.ndim == 0:
            a = np.full(size, float(a))
        if per_message and a.ndim == 1 and a.shape == (size,):
            a = np.repeat(a[:, None], m, axis=1)
        want = (size, m) if per_message else (size,)
        if a.shape != want or not np.isfinite(a).all() or (a < 0).any():
            shapes = f"{size} or [{size}, {m}]" if per_message else str(size)
            raise ValueError(
                f"{name} must be one number or {shapes} finite seconds >= 0, got {value!r}"
            )
        return a

    f = seconds("forward_s", forward_s, n)
    b = seconds("backward_s", backward_s, n)
    tf = seconds("forward_transfer_s", forward_transfer_s, n - 1, per_message=True)
    tb = seconds("backward_transfer_s", backward_transfer_s, n - 1, per_message=True)

    def sweep(order, compute, transfer, ready, mbs):
        # order: stages in the direction of travel; transfer[i, j]: microbatch j's message
        # over link order[i] -> order[i+1].
        # Returns the events and when each stage is free again (its sends delivered, if it
        # may not compute beside them).
        out, done = np.zeros((n, m, 2)), np.zeros(n)
        arrive = np.zeros(m)
        for i, s in enumerate(order):
            free = ready[s]
            link = -np.inf  # when the outgoing link is free
            sends = i + 1 < len(order)
            nxt = np.zeros(m)
            for j in mbs:
                start = max(free, arrive[j] if i else 0.0)
                free = start + compute[s]
                out[s, j] = start, free
                if sends:
                    link = nxt[j] = max(free, link) + transfer[i, j]
                    if not overlap:
                        free = link
            arrive, done[s] = nxt, free
        return out, done

    fwd, ready = sweep(list(range(n)), f, tf, np.zeros(n), range(m))
    bwd, _ = sweep(list(range(n - 1, -1, -1)), b, tb[::-1], ready, range(m - 1, -1, -1))
    return GPipeTimeline(float(bwd[:, :, 1].max()), fwd, bwd)
