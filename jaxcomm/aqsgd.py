"""AQ-SGD boundary codecs: quantized activation *deltas* across a pipeline stage boundary.

Implements the forward/backward compression of AQ-SGD from "Fine-tuning Language Models over
Slow Networks using Activation Quantization with Guarantees" (Wang et al., NeurIPS 2022),
plus the two baselines of that paper (FP32 and DirectQ). Everything here is a pure, jit-able
function of one microbatch; the per-sample message buffer lives with the caller (the
pipeline), which reads ``previous`` rows for the microbatch's samples and writes
``new_previous`` back.

The algorithm, per stage boundary, for a sample ``xi`` with activation ``a = stage(input)``
and message buffer ``m[xi]`` held by BOTH sides of the boundary:

* forward, first visit of ``xi``: send ``a`` in full precision; both sides set ``m[xi] = a``;
* forward, later visits: send ``q = Q_fw(a - m[xi])``; both sides set
  ``m[xi] = m[xi] + dequant(q)``; the next stage consumes ``m[xi]``;
* backward: the next stage sends ``Q_bw(grad wrt its input)`` (direct, no delta) back, and the
  sender uses it as the gradient of ``a`` (straight-through: ``d m[xi] / d a := I``).

``Q`` is :func:`jaxcomm.codecs.quantize`: unbiased stochastic uniform quantization with one
max-abs scale per bucket. Here every sample (row of the batch) is quantized on its own, with
buckets along the flattened sample (default: one bucket per row of the last axis, i.e. one
scale per token over ``hidden`` as the paper does), so the bytes of each row are separable
and a row can be sent or skipped on its own.

Shapes: ``activation``, ``previous``: ``f32[B, *sample_shape]`` (e.g. ``[B, T, H]``);
``seen``: ``bool[B]``. Row-batched :class:`~jaxcomm.codecs.Quantized` payloads produced here
carry a leading ``B`` axis on every array leaf (``codes: uint8[B, ceil(n*bits/8)]``,
``scale: f32[B, ceil(n/bucket)]``, ``n = prod(sample_shape)``) and the *sample* shape in their
static metadata; decode them with :func:`directq_decode` (or ``jax.vmap(dequantize)``).

Deviations from the paper: the optional low-precision storage of the buffer and the
uncompressed warm-up epoch are left to the caller (``mode="fp32"`` of :func:`boundary` sends
full precision and returns ``new_previous = activation``, which is what a warm-up epoch
needs). For static shapes the AQ-SGD payload holds both a quantized delta and a
full-precision block for every row; :func:`wire_bytes` counts only the half each row needs
(see :class:`AQPayload`). The "seen" test is per sample of the microbatch, as in the
algorithm, with the flags kept by the caller on both sides (never sent).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._checks import check_choice, check_finite_if_concrete, check_int, is_concrete
from jaxcomm.codecs import Quantized, dequantize, payload_bytes, quantize

__all__ = [
    "AQPayload",
    "aqsgd_encode",
    "aqsgd_decode",
    "wire_bytes",
    "directq_encode",
    "directq_decode",
    "fp32_encode",
    "fp32_decode",
    "quantize_grad",
    "grad_wire_bytes",
    "boundary",
]

_INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------- payload


@functools.partial(jax.tree_util.register_dataclass, data_fields=["delta", "full"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class AQPayload:
    """What AQ-SGD puts on the wire for one microbatch, with static shapes.

    Which rows are sent in full precision depends on ``seen``, a runtime value, while jit
    needs static shapes. So the payload carries BOTH encodings for all ``B`` rows, each
    filled only where it applies, and :func:`wire_bytes` counts, per row, the bytes of the
    one encoding that row actually needs (``seen`` is known to both sides of the boundary,
    so it never has to be sent). A real transport sends, for row ``i``, ``delta``'s row ``i``
    when ``seen[i]`` and ``full``'s row ``i`` otherwise; the zero-filled halves are never
    sent. This keeps the codec one branch-free jit-able function whose payload is an
    ordinary pytree (it can go through ``ppermute`` as is), at the cost of materialising
    both halves in memory.

    Attributes:
      delta: row-batched :class:`~jaxcomm.codecs.Quantized` of ``activation - previous``
        (leaves ``[B, ...]``; rows of unseen samples quantize zeros and are not sent).
      full: ``f32[B, *sample_shape]``: the activation on unseen rows, zeros on seen rows
        (those are not sent).
    """

    delta: Quantized
    full: jax.Array


# --------------------------------------------------------------------------- helpers


def _check_activation(name: str, x: jax.Array) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating array, got dtype {x.dtype}")
    if x.ndim < 2 or x.size == 0:
        raise ValueError(
            f"{name} must have shape [B, *sample_shape] with at least 2 axes and no empty "
            f"axis, got shape {x.shape}"
        )
    return x


def _check_pair(
    activation: jax.Array, previous: jax.Array, seen: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    activation = _check_activation("activation", activation)
    previous = jnp.asarray(previous)
    seen = jnp.asarray(seen)
    if previous.shape != activation.shape:
        raise ValueError(
            f"previous must have the activation's shape: activation shape {activation.shape}, "
            f"previous shape {previous.shape}"
        )
    if previous.dtype != activation.dtype:
        raise TypeError(
            f"previous must have the activation's dtype: activation dtype {activation.dtype}, "
            f"previous dtype {previous.dtype}"
        )
    if seen.shape != activation.shape[:1]:
        raise ValueError(
            f"seen must have shape [B] = {activation.shape[:1]} for activation shape "
            f"{activation.shape}, got seen shape {seen.shape}"
        )
    if seen.dtype != jnp.bool_:
        raise TypeError(f"seen must be a bool array, got dtype {seen.dtype}")
    return activation, previous, seen


def _bucket(bucket_size: int | None, shape: Sequence[int], name: str = "bucket_size") -> int:
    return shape[-1] if bucket_size is None else check_int(name, bucket_size, lo=1)


def _rows(seen: jax.Array, ndim: int) -> jax.Array:
    """``bool[B]`` -> ``bool[B, 1, ..., 1]`` broadcastable against a ``ndim``-d batch."""
    return seen.reshape(seen.shape + (1,) * (ndim - 1))


def _quantize_rows(x: jax.Array, key: jax.Array, bits: int, bucket_size: int) -> Quantized:
    """Quantize each row ``x[i]`` on its own, with its own key: row-batched ``Quantized``."""
    keys = jax.random.split(key, x.shape[0])
    return jax.vmap(lambda r, k: quantize(r, k, bits=bits, bucket_size=bucket_size))(x, keys)


@jax.jit
def _dequantize_rows(q: Quantized) -> jax.Array:
    # Always compiled, eager calls included: XLA folds the decode's constants (it rewrites
    # ``(2 * codes / levels - 1) * scale``), so an op-by-op eager decode could differ from a
    # jitted one in the last bit; compiled everywhere, every caller gets the same bits.
    return jax.vmap(dequantize)(q)


def _row_bytes(tree, batch: int) -> int:
    """Bytes of ONE row of a row-batched payload, counted from its leaves' sizes."""
    total = payload_bytes(tree)
    if total % batch:
        raise ValueError(f"payload of {total} bytes does not split into {batch} equal rows")
    return total // batch


# --------------------------------------------------------------------------- AQ-SGD


@jax.jit
def _reconstruct(
    delta: Quantized, previous: jax.Array, full: jax.Array, seen: jax.Array
) -> jax.Array:
    # Compiled for the same reason as ``_dequantize_rows``.
    dq = _dequantize_rows(delta)
    return jnp.where(_rows(seen, previous.ndim), previous + dq, full)


def aqsgd_decode(payload: AQPayload, previous: jax.Array, seen: jax.Array) -> jax.Array:
    """Receiver side: rebuild the message ``m`` the next stage consumes.

    ``new_previous[i] = previous[i] + dequantize(delta)[i]`` where ``seen[i]``, else
    ``payload.full[i]`` (the activation, sent in full precision). The sender's
    :func:`aqsgd_encode` calls this very function, so both sides of the boundary compute the
    same array bit for bit: the reconstruction is one jitted function (also when called
    eagerly, since XLA constant-folds the decode's ``(2 * codes / levels - 1) * scale`` and an
    op-by-op evaluation would round differently), so sender and receiver run the same
    compiled arithmetic on the same bits.

    Args:
      payload: :class:`AQPayload` from :func:`aqsgd_encode`.
      previous: ``f32[B, *sample_shape]`` the receiver's copy of the previous messages.
      seen: ``bool[B]``.

    Returns:
      ``f32[B, *sample_shape]`` the new messages (also the receiver's next ``previous``).
    """
    if not isinstance(payload, AQPayload):
        raise TypeError(f"payload must be an AQPayload, got {type(payload).__name__}")
    full, previous, seen = _check_pair(payload.full, previous, seen)
    if (payload.delta.codes.shape[0],) + tuple(payload.delta.shape) != previous.shape:
        raise ValueError(
            f"payload delta holds {payload.delta.codes.shape[0]} rows of shape "
            f"{payload.delta.shape}, previous shape {previous.shape}"
        )
    return _reconstruct(payload.delta, previous, full, seen)


def aqsgd_encode(
    activation: jax.Array,
    previous: jax.Array,
    seen: jax.Array,
    key: jax.Array,
    *,
    bits: int,
    bucket_size: int | None = None,
) -> tuple[AQPayload, jax.Array]:
    """Sender side of AQ-SGD for one microbatch.

    Unseen rows go in full precision; seen rows send ``Q(activation - previous)`` at
    ``bits`` bits, quantized per row in buckets of ``bucket_size`` consecutive elements of
    the flattened sample (default: the last axis, one scale per token).

    Args:
      activation: ``f32[B, *sample_shape]`` this stage's output.
      previous: ``f32[B, *sample_shape]`` the buffer rows ``m[xi]`` of these samples
        (ignored on unseen rows; may hold anything there, NaN included).
      seen: ``bool[B]`` whether each sample crossed this boundary before.
      key: PRNG key of the stochastic rounding (split into one key per row).
      bits: forward code width, 1..8 (the paper uses 2-4).
      bucket_size: elements per scale, default ``sample_shape[-1]``.

    Returns:
      ``(payload, new_previous)``: the :class:`AQPayload` (bytes on the wire:
      :func:`wire_bytes`) and ``f32[B, *sample_shape]``, equal to ``previous +
      dequantize(q)`` on seen rows and to ``activation`` on unseen ones; bit-identical to
      what :func:`aqsgd_decode` rebuilds on the receiver.
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    activation, previous, seen = _check_pair(activation, previous, seen)
    bucket_size = _bucket(bucket_size, activation.shape)
    check_finite_if_concrete("activation", activation)
    if is_concrete(previous) and is_concrete(seen):
        check_finite_if_concrete("previous (seen rows)", np.asarray(previous)[np.asarray(seen)])
    rows = _rows(seen, activation.ndim)
    # Unseen rows quantize zeros (and never read the buffer, which may be uninitialised).
    delta = jnp.where(rows, activation - previous, jnp.zeros_like(activation))
    q = _quantize_rows(delta, key, bits, bucket_size)
    full = jnp.where(rows, jnp.zeros_like(activation), activation)
    payload = AQPayload(delta=q, full=full)
    return payload, aqsgd_decode(payload, previous, seen)


def wire_bytes(payload: AQPayload, seen: jax.Array) -> jax.Array:
    """Bytes an :class:`AQPayload` puts on the wire, given which rows were ``seen``.

    Counted per row from the payload's leaves (``size * itemsize`` over the leaves, divided
    by ``B``), not from a formula: a seen row costs one row of ``delta`` (packed codes +
    4-byte scales: ``ceil(n * bits / 8) + 4 * ceil(n / bucket_size)`` bytes for ``n`` elements
    per sample), an unseen row one row of ``full`` (``n * itemsize``, ``4 n`` for float32).

    Args:
      payload: :class:`AQPayload` (arrays, tracers or ``jax.ShapeDtypeStruct`` leaves).
      seen: ``bool[B]``, may be traced.

    Returns:
      ``int32[]`` the byte count (a traced value under jit, since ``seen`` is data).
    """
    if not isinstance(payload, AQPayload):
        raise TypeError(
            f"payload must be an AQPayload, got {type(payload).__name__} "
            "(use jaxcomm.payload_bytes for payloads with no per-row choice)"
        )
    batch = payload.full.shape[0]
    seen = jnp.asarray(seen)
    if seen.shape != (batch,):
        raise ValueError(f"seen must have shape ({batch},), got seen shape {seen.shape}")
    per_seen = _row_bytes(payload.delta, batch)
    per_unseen = _row_bytes(payload.full, batch)
    if batch * max(per_seen, per_unseen) > _INT32_MAX:
        raise ValueError(
            f"a microbatch of {batch} rows of up to {max(per_seen, per_unseen)} bytes "
            "overflows the int32 byte count; use smaller microbatches"
        )
    n_seen = jnp.sum(seen.astype(jnp.int32))
    return n_seen * per_seen + (batch - n_seen) * per_unseen


# --------------------------------------------------------------------------- baselines


def directq_encode(
    activation: jax.Array, key: jax.Array, *, bits: int, bucket_size: int | None = None
) -> Quantized:
    """DirectQ baseline: quantize the activation itself (no buffer), per row.

    Args:
      activation: ``f32[B, *sample_shape]``.
      key: PRNG key (one split per row).
      bits: code width, 1..8.
      bucket_size: elements per scale, default ``sample_shape[-1]``.

    Returns:
      Row-batched :class:`~jaxcomm.codecs.Quantized` (leaves ``[B, ...]``) of
      ``B * (ceil(n * bits / 8) + 4 * ceil(n / bucket_size))`` bytes
      (:func:`jaxcomm.payload_bytes`).
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    activation = _check_activation("activation", activation)
    bucket_size = _bucket(bucket_size, activation.shape)
    check_finite_if_concrete("activation", activation)
    return _quantize_rows(activation, key, bits, bucket_size)


def directq_decode(payload: Quantized) -> jax.Array:
    """Decode a row-batched DirectQ payload to ``f32[B, *sample_shape]``."""
    if not isinstance(payload, Quantized):
        raise TypeError(f"payload must be a Quantized payload, got {type(payload).__name__}")
    if payload.codes.ndim != 2:
        raise ValueError(
            "payload must be row-batched (leaves with a leading batch axis, as made by "
            f"directq_encode), got codes of shape {payload.codes.shape}"
        )
    return _dequantize_rows(payload)


def fp32_encode(activation: jax.Array) -> jax.Array:
    """FP32 baseline: the payload is the activation itself (``B * n * itemsize`` bytes)."""
    return _check_activation("activation", activation)


def fp32_decode(payload: jax.Array) -> jax.Array:
    """FP32 baseline: the received payload is the activation."""
    return jnp.asarray(payload)


# --------------------------------------------------------------------------- backward


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _quantize_grad(x: jax.Array, key: jax.Array, bits: int, bucket_size: int) -> jax.Array:
    return x


def _quantize_grad_fwd(x, key, bits, bucket_size):
    return x, key


def _quantize_grad_bwd(bits, bucket_size, key, g):
    g_hat = _dequantize_rows(_quantize_rows(g, key, bits, bucket_size)).astype(g.dtype)
    return g_hat, None


_quantize_grad.defvjp(_quantize_grad_fwd, _quantize_grad_bwd)


def quantize_grad(
    x: jax.Array, key: jax.Array, *, bits: int, bucket_size: int | None = None
) -> jax.Array:
    """Identity forward; the VJP quantizes the incoming cotangent (the paper's ``Q_bw``).

    The activation gradient that the next stage sends back is quantized directly (no delta,
    no buffer) with stochastic rounding at ``bits`` bits, per row, in buckets of
    ``bucket_size`` (default the last axis), so it stays unbiased:
    ``E[grad] = cotangent``. ``key`` is an ordinary argument that receives no gradient;
    use a fresh key per step and boundary.

    Args:
      x: ``f32[B, *sample_shape]``.
      key: PRNG key of the backward rounding.
      bits: backward code width, 1..8 (the paper uses 4-8).
      bucket_size: elements per scale.

    Returns:
      ``x`` unchanged; its cotangent is replaced by its quantized-then-dequantized value,
      whose wire size is :func:`grad_wire_bytes` ``(x.shape, bits, bucket_size)``.
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    x = _check_activation("x", x)
    return _quantize_grad(x, key, bits, _bucket(bucket_size, x.shape))


def grad_wire_bytes(shape: Sequence[int], bits: int, bucket_size: int | None = None) -> int:
    """Bytes of the quantized activation gradient of shape ``[B, *sample_shape]``.

    Counted from the payload's leaves (via ``jax.eval_shape``; nothing is computed):
    ``B * (ceil(n * bits / 8) + 4 * ceil(n / bucket_size))`` with ``n = prod(sample_shape)``.
    """
    shape = tuple(check_int("shape entry", s, lo=1) for s in shape)
    if len(shape) < 2:
        raise ValueError(f"shape must be [B, *sample_shape] with at least 2 axes, got {shape}")
    bits = check_int("bits", bits, lo=1, hi=8)
    bucket_size = _bucket(bucket_size, shape)
    payload = jax.eval_shape(
        lambda x, k: _quantize_rows(x, k, bits, bucket_size),
        jax.ShapeDtypeStruct(shape, jnp.float32),
        jax.random.key(0),
    )
    return payload_bytes(payload)


# --------------------------------------------------------------------------- boundary


@jax.custom_vjp
def _straight_through(x: jax.Array, value: jax.Array) -> jax.Array:
    return value


def _st_fwd(x, value):
    return value, None


def _st_bwd(_, g):
    return g, None


_straight_through.defvjp(_st_fwd, _st_bwd)


def boundary(
    activation: jax.Array,
    previous: jax.Array,
    seen: jax.Array,
    key: jax.Array,
    *,
    fw_bits: int | None,
    bw_bits: int | None,
    mode: str = "aqsgd",
    fw_bucket: int | None = None,
    bw_bucket: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One stage boundary, both directions, in one differentiable call.

    Forward value (what the next stage consumes):

    * ``"aqsgd"``: ``m = new_previous`` from :func:`aqsgd_encode` (``= activation`` on unseen
      rows, ``previous + dequantize(Q(activation - previous))`` on seen rows);
    * ``"directq"``: ``dequantize(Q(activation))``;
    * ``"fp32"``: ``activation``.

    Gradient path: let ``g`` be the cotangent of the returned ``received_activation`` (the
    receiver's input gradient). It is quantized at ``bw_bits`` (per row, stochastic,
    unbiased; float32 when ``bw_bits`` is None) as the message sent back, and that message
    is the cotangent of ``activation``: the Jacobian of the forward codec is taken to be the
    identity (straight-through), as in the paper, where the predecessor updates with
    ``Q(grad_a (f o b)|_m) * grad_x a``, i.e. ``d m / d a := I``. ``previous`` and ``seen``
    are state and get no gradient. In ``"fp32"`` mode with ``bw_bits=None`` the boundary is
    the exact identity.

    Args:
      activation: ``f32[B, *sample_shape]`` the sender's output.
      previous: ``f32[B, *sample_shape]`` buffer rows (used by ``"aqsgd"`` only).
      seen: ``bool[B]`` (used by ``"aqsgd"``; also by its byte count).
      key: PRNG key; forward and backward rounding use independent keys folded from it.
      fw_bits: forward bits, 1..8 (ignored and may be None in ``"fp32"`` mode).
      bw_bits: backward bits, 1..8, or None for a float32 gradient.
      mode: ``"aqsgd"``, ``"directq"`` or ``"fp32"``.
      fw_bucket, bw_bucket: bucket sizes (default ``sample_shape[-1]``).

    Returns:
      ``(received_activation, new_previous, wire_bytes_fw, wire_bytes_bw)``: the next
      stage's input ``f32[B, *sample_shape]``; the buffer rows to store (both sides hold the
      same; for ``"directq"`` the decoded message, for ``"fp32"`` the activation, so a
      full-precision warm-up epoch leaves a valid buffer); ``int32[]`` bytes sent forward
      and backward for this microbatch.
    """
    check_choice("mode", mode, ("aqsgd", "directq", "fp32"))
    activation, previous, seen = _check_pair(activation, previous, seen)
    if mode != "fp32" and fw_bits is None:
        raise ValueError(f"fw_bits must be an int in [1, 8] for mode={mode!r}, got None")
    k_fw, k_bw = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    a = lax.stop_gradient(activation)

    if mode == "aqsgd":
        payload, new_previous = aqsgd_encode(
            a, lax.stop_gradient(previous), seen, k_fw, bits=fw_bits, bucket_size=fw_bucket
        )
        value = new_previous
        fw = wire_bytes(payload, seen)
    elif mode == "directq":
        payload = directq_encode(a, k_fw, bits=fw_bits, bucket_size=fw_bucket)
        value = directq_decode(payload)
        new_previous = value
        fw = jnp.int32(payload_bytes(payload))
    else:
        value = new_previous = a
        fw = jnp.int32(payload_bytes(a))

    if bw_bits is None:
        src = activation
        bw = jnp.int32(payload_bytes(activation))
    else:
        bw_bits = check_int("bw_bits", bw_bits, lo=1, hi=8)
        src = quantize_grad(activation, k_bw, bits=bw_bits, bucket_size=bw_bucket)
        bw = jnp.int32(grad_wire_bytes(activation.shape, bw_bits, bw_bucket))
    received = src if mode == "fp32" else _straight_through(src, value)
    return received, new_previous, fw, bw
