"""AQ-SGD boundary codecs: quantized activation *deltas* across a pipeline stage boundary.

Implements the forward/backward compression of AQ-SGD from "Fine-tuning Language Models over
Slow Networks using Activation Quantization with Guarantees" (Wang et al., NeurIPS 2022),
plus the two baselines of that paper (FP32 and DirectQ). Everything here is a pure, jit-able
function of one microbatch; the per-sample message buffer lives with the caller (the
pipeline), which reads ``previous`` rows for the microbatch's samples and writes
``new_previous`` back. :mod:`jaxcomm.pipeline` sends exactly the payloads made here.

The algorithm, per stage boundary, for a sample ``xi`` with activation ``a = stage(input)``
and message buffer ``m[xi]`` held by BOTH sides of the boundary:

* forward, first visit of ``xi``: send ``a`` in full precision; both sides set ``m[xi] = a``;
* forward, later visits: send ``q = Q_fw(a - m[xi])``; both sides set
  ``m[xi] = m[xi] + dequant(q)``; the next stage consumes ``m[xi]``;
* backward: the next stage sends ``Q_bw(grad wrt its input)`` (direct, no delta) back, and the
  sender uses it as the gradient of ``a`` (straight-through: ``d m[xi] / d a := I``).

``Q`` is :func:`jaxcomm.codecs.quantize`: unbiased stochastic uniform quantization with one
max-abs scale per bucket. Every sample (row of the batch) is quantized on its own, with its
own key and buckets along the flattened sample (default: one bucket per row of the last
axis, i.e. one scale per token over ``hidden`` as the paper does).

**A payload is exactly what crosses the link.** Whether a microbatch goes as deltas or in
full precision is a *static* choice (``seen`` is a Python bool, or a concrete ``bool[B]``
that is all True or all False): a seen microbatch's payload is the row-batched
:class:`~jaxcomm.codecs.Quantized` of its deltas (``ceil(n * bits / 8)`` code bytes plus
``4 * ceil(n / bucket)`` scale bytes per row, ``n`` elements per sample), an unseen one's is
the float32 activation. Nothing else rides along, so :func:`jaxcomm.codecs.payload_bytes` of the
payload is the wire count, and a ``ppermute`` of it moves those bytes. The caller compiles
one program per case: in training, the first epoch runs the full-precision program and
later epochs the delta program (the host knows which samples crossed before; see
:class:`jaxcomm.pipeline.MessageBuffer`). A microbatch mixing seen and unseen samples (possible
when an epoch does not cover every sample) is sent as unseen: the seen rows go in full
precision too and their buffer rows are reset to the activation, which costs bytes, never
correctness. A per-row choice would need data-dependent shapes (or a full float32 block per
row, which is what this design removes).

Shapes: ``activation``, ``previous``: ``f32[B, *sample_shape]`` (e.g. ``[B, T, H]``).
Row-batched payloads carry a leading ``B`` axis on every array leaf
(``codes: uint8[B, ceil(n*bits/8)]``, ``scale: f32[B, ceil(n/bucket)]``) and the *sample*
shape in their static metadata.

Deviations from the paper: the optional low-precision storage of the buffer and the
uncompressed warm-up epoch are left to the caller (send unseen payloads for a warm-up).
The seen test is per microbatch, not per sample (above).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomm._src._checks import check_finite_if_concrete, check_int, is_concrete
from jaxcomm._src.codec import (
    ChunkTopKCodec,
    Codec,
    LowRankCodec,
    QuantizeCodec,
    decode,
    is_payload,
)
from jaxcomm._src.codecs import Quantized, payload_bytes

__all__ = [
    "RowCodec",
    "quantized_rows",
    "topk_rows",
    "lowrank_rows",
    "FirstVisit",
    "delta_encode",
    "delta_decode",
    "uniform_seen",
    "aqsgd_encode",
    "aqsgd_decode",
    "directq_encode",
    "directq_decode",
    "fp32_encode",
    "fp32_decode",
    "quantize_grad",
    "grad_wire_bytes",
]


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


def _check_previous(activation: jax.Array, previous: jax.Array) -> jax.Array:
    previous = jnp.asarray(previous)
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
    return previous


def uniform_seen(seen: Any, batch: int | None = None) -> bool:
    """``seen`` as one static bool: whether the whole microbatch crossed the boundary before.

    Args:
      seen: a Python bool, or a concrete ``bool[B]`` array whose entries are all equal.
      batch: the microbatch size ``B`` the array must have (None: any).

    Raises:
      TypeError: ``seen`` is traced (the payload's shape depends on it, so it must be known
        when the program is built) or not boolean.
      ValueError: the array has the wrong shape, or mixes seen and unseen rows.
    """
    if isinstance(seen, (bool, np.bool_)):
        return bool(seen)
    if not is_concrete(seen):
        raise TypeError(
            "seen must be a Python bool or a concrete bool[B] array (the payload's shape "
            "depends on it: deltas for a seen microbatch, float32 for an unseen one), got a "
            "traced value; decide it outside jit and compile one program per case"
        )
    arr = np.asarray(seen)
    if arr.dtype != np.bool_:
        raise TypeError(f"seen must be a bool or a bool array, got dtype {arr.dtype}")
    if arr.ndim != 1 or (batch is not None and arr.shape != (batch,)):
        want = f"({batch},)" if batch is not None else "[B]"
        raise ValueError(f"seen must have shape {want} (one flag per row), got shape {arr.shape}")
    if arr.size and arr.any() != arr.all():
        seen_rows = np.flatnonzero(arr).tolist()
        unseen_rows = np.flatnonzero(~arr).tolist()
        raise ValueError(
            "seen must be uniform over the microbatch (all rows seen: deltas; none seen: "
            f"first visits), got seen rows {seen_rows} and unseen rows {unseen_rows}; send a "
            "mixed microbatch as unseen (seen=False)"
        )
    return bool(arr.all()) if arr.size else False


def _bucket(bucket_size: int | None, shape: Sequence[int], name: str = "bucket_size") -> int:
    return shape[-1] if bucket_size is None else check_int(name, bucket_size, lo=1)


def _quantize_rows(x: jax.Array, key: jax.Array, bits: int, bucket_size: int) -> Quantized:
    """Quantize each row ``x[i]`` on its own, with its own key: row-batched ``Quantized``."""
    return RowCodec(QuantizeCodec(bits, bucket_size)).encode(x, key)


@jax.jit
def _decode_rows(payload: Any) -> jax.Array:
    # Always compiled, eager calls included: XLA folds a decode's constants (it rewrites
    # ``(2 * codes / levels - 1) * scale``), so an op-by-op eager decode could differ from a
    # jitted one in the last bit; compiled everywhere, every caller gets the same bits.
    return jax.vmap(decode)(payload)


@jax.jit
def _add_delta(previous: jax.Array, delta: Any) -> jax.Array:
    # Compiled for the same reason as ``_decode_rows``: sender and receiver run the same
    # compiled arithmetic on the same bits.
    # The barrier keeps the decoded delta a finished array: fused with the addition, XLA
    # may contract a product of the decode and this sum into one fused multiply-add on one
    # side of a boundary and not on the other (both sit in one pipeline program).
    return previous + lax.optimization_barrier(_decode_rows(delta)).reshape(previous.shape)


def _rows(payload: Any) -> int:
    """The rows of a row-batched payload: the leading axis every array leaf shares."""
    leaves = jax.tree_util.tree_leaves(payload)
    lead = {leaf.shape[0] if leaf.ndim else None for leaf in leaves}
    if len(lead) != 1 or None in lead:
        shapes = [tuple(leaf.shape) for leaf in leaves]
        raise ValueError(
            "payload must be row-batched (leaves with a leading batch axis, as made by "
            f"RowCodec.encode), got leaves of shapes {shapes}"
        )
    return lead.pop()


# --------------------------------------------------------------------------- row codecs


@dataclasses.dataclass(frozen=True)
class RowCodec:
    """Any :class:`~jaxcomm.codecs.Codec` applied to every row (sample) of a
    ``[B, *sample_shape]`` array on its own, each row with its own key: the compression of a
    pipeline boundary.

    Made by :func:`quantized_rows` (stochastic uniform quantization, unbiased: AQ-SGD's and
    DirectQ's ``Q``), :func:`topk_rows` (chunk-wise top-k of each row with packed in-chunk
    positions and low-bit values) or :func:`lowrank_rows` (a rank-``r`` factorization of each
    sample's ``[T, W]`` matrix with low-bit factors), or from any codec, ``RowCodec(codec)``;
    biased codecs suit deltas against a buffer that keeps what was not sent. A payload's
    leaves carry a leading ``B`` axis and its bytes are ``B`` times one row's.

    Attributes:
      codec: what compresses one row.
    """

    codec: Codec

    def __post_init__(self):
        if not isinstance(self.codec, Codec):
            raise TypeError(
                f"codec must be a jaxcomm.codecs.Codec, got {type(self.codec).__name__}"
            )

    def encode(self, x: jax.Array, key: jax.Array | None) -> Any:
        """Row-batched payload of ``x`` (``f32[B, *sample_shape]``); ``key`` is split into
        one key per row (a deterministic codec ignores it)."""
        x = _check_activation("x", x)
        if key is None:
            return jax.vmap(lambda row: self.codec.encode(row, None))(x)
        return jax.vmap(self.codec.encode)(x, jax.random.split(key, x.shape[0]))

    def decode(self, payload: Any) -> jax.Array:
        """``[B, *sample_shape]`` from a row-batched payload of :meth:`encode`."""
        if not isinstance(payload, self.codec.payload):
            raise TypeError(
                f"payload must be {self.codec.payload.__name__}, got {type(payload).__name__}"
            )
        _rows(payload)
        return _decode_rows(payload)

    def nbytes(self, shape: Sequence[int]) -> int:
        """Wire bytes of :meth:`encode` of an array of ``shape`` ``[B, *sample_shape]``,
        read from the payload's leaves (``jax.eval_shape``; nothing is computed)."""
        struct = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
        return payload_bytes(jax.eval_shape(self.encode, struct, jax.random.key(0)))

    @property
    def label(self) -> str:
        """Short name, e.g. ``q2/b1024`` or ``top4of256/q4``."""
        return self.codec.label


def quantized_rows(bits: int, bucket_size: int | None = None) -> RowCodec:
    """Stochastic uniform quantization of each row to ``bits`` bits, one max-abs scale per
    ``bucket_size`` elements (default the sample's last axis: one per token). Unbiased:
    ``E[decode(encode(x))] = x``. A row costs ``ceil(n * bits / 8) + 4 * ceil(n / bucket)``
    bytes for ``n`` elements."""
    return RowCodec(QuantizeCodec(bits, bucket_size))


def topk_rows(chunk: int, k: int, bits: int | None = None) -> RowCodec:
    """Chunk-wise top-``k`` of each row: in every ``chunk`` consecutive entries of a
    flattened sample the ``k`` largest in magnitude (ties to the lower position), sent as
    ``ceil(log2 chunk)``-bit positions and values rounded to nearest on ``bits`` bits with
    one float32 scale per chunk (``None``: float32 values), by
    :func:`jaxcomm.codecs.chunk_topk_encode`. Biased (the rest decodes to zero): use it
    where what is not sent is kept, as AQ-SGD's buffer keeps the unsent part of a delta.
    A chunk holding a NaN or Inf decodes to non-finite values. A row of ``n`` elements in
    ``C = ceil(n / chunk)`` chunks costs ``ceil(C k ceil(log2 chunk) / 8)`` position bytes
    plus ``ceil(C k bits / 8) + 4 C`` value bytes (``4 C k`` in float32)."""
    return RowCodec(ChunkTopKCodec(chunk, k, bits))


def lowrank_rows(rank: int, bits: int = 8) -> RowCodec:
    """Each sample ``[..., W]`` as a rank-``rank`` matrix ``P R`` (``P``: ``[T, r]`` with
    ``T`` the product of the other axes, ``R``: ``[r, W]``), found by a randomized range
    finder with two power iterations and sent as ``bits``-bit factors rounded to nearest,
    one float32 scale per factor column and row (:func:`jaxcomm.codecs.lowrank_encode`).
    Biased: what lies beyond the rank is not sent, so use it where a buffer keeps it. A row
    costs ``ceil(r T bits / 8) + ceil(r W bits / 8) + 8 r`` bytes."""
    return RowCodec(LowRankCodec(rank, bits))


# --------------------------------------------------------------------------- deltas, any codec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FirstVisit:
    """A first visit's payload (the activation itself, compressed by ``first``), marked so
    the receiver tells it from a delta of the same codec. Only ``payload``'s leaves cross."""

    payload: Any


def _as_received(payload: Any) -> Any:
    """The payload behind an optimization barrier: the sender then decodes it as the
    receiver does, from finished arrays. Inside one compiled program (a pipeline step holds
    both sides of a boundary) XLA would otherwise fuse the sender's decode into its encode
    and may reorder its float arithmetic there (a rank's factors, a scale's division), one
    ulp away from the receiver's."""
    return lax.optimization_barrier(payload)


def delta_encode(
    activation: jax.Array,
    previous: jax.Array,
    seen: bool | np.ndarray,
    key: jax.Array,
    codec: RowCodec,
    *,
    first: RowCodec | None = None,
) -> tuple[Any, jax.Array]:
    """AQ-SGD's sender with any :class:`RowCodec`: send ``codec(activation - previous)``.

    :func:`aqsgd_encode` is this with :func:`quantized_rows`. With :func:`topk_rows` only a
    few entries of each delta cross; the buffer (both sides) takes exactly what was sent, so
    what was not sent stays in the next visit's delta (error feedback by construction).

    Args:
      activation, previous, seen, key: as :func:`aqsgd_encode`.
      codec: how a seen microbatch's deltas are compressed.
      first: how a first visit's activation is sent (``None``: float32, as the paper).
        Compressing it (e.g. ``quantized_rows(4)``) is a deviation from the paper: the
        buffer starts from the decoded activation, and later deltas correct it.

    Returns:
      ``(payload, new_previous)``; ``new_previous`` is bit-identical to what
      :func:`delta_decode` rebuilds on the receiver, and the payload's bytes
      (:func:`jaxcomm.codecs.payload_bytes`) are the bytes on the wire.
    """
    if not isinstance(codec, RowCodec):
        raise TypeError(f"codec must be a RowCodec, got {type(codec).__name__}")
    if first is not None and not isinstance(first, RowCodec):
        raise TypeError(f"first must be a RowCodec or None, got {type(first).__name__}")
    activation = _check_activation("activation", activation)
    previous = _check_previous(activation, previous)
    seen = uniform_seen(seen, activation.shape[0])
    check_finite_if_concrete("activation", activation)
    if not seen:
        if first is None:
            return activation, activation
        payload = _as_received(first.encode(activation, key))
        return FirstVisit(payload), _decode_rows(payload).reshape(activation.shape)
    check_finite_if_concrete("previous", previous)
    payload = _as_received(codec.encode(activation - previous, key))
    return payload, _add_delta(previous, payload)


def delta_decode(payload: Any, previous: jax.Array) -> jax.Array:
    """Receiver side of :func:`delta_encode`: the new messages ``f32[B, *sample_shape]``.

    A delta payload gives ``previous + decode(payload)`` by the sender's compiled function
    (both sides bit-identical); a :class:`FirstVisit` gives its decoded activation, and a
    float32 array (an uncompressed first visit) is the message itself.
    """
    previous = jnp.asarray(previous)
    if isinstance(payload, FirstVisit):
        out = _decode_rows(payload.payload)
        if out.size == previous.size:  # a flat codec decodes each row to one axis
            out = out.reshape(previous.shape)
        _check_previous(out, previous)
        return out
    if is_payload(payload):
        rows = _rows(payload)
        sample = getattr(payload, "shape", previous.shape[1:])
        if (rows, *sample) != previous.shape:
            raise ValueError(
                f"payload holds {rows} rows of shape {sample}, previous shape {previous.shape}"
            )
        return _add_delta(previous, payload)
    payload = _check_activation("payload", payload)
    _check_previous(payload, previous)
    return payload


# --------------------------------------------------------------------------- AQ-SGD


def aqsgd_encode(
    activation: jax.Array,
    previous: jax.Array,
    seen: bool | np.ndarray,
    key: jax.Array,
    *,
    bits: int,
    bucket_size: int | None = None,
) -> tuple[Quantized | jax.Array, jax.Array]:
    """Sender side of AQ-SGD for one microbatch.

    Args:
      activation: ``f32[B, *sample_shape]`` this stage's output.
      previous: ``f32[B, *sample_shape]`` the buffer rows ``m[xi]`` of these samples (read
        only when ``seen``; may hold anything otherwise, NaN included).
      seen: whether the microbatch crossed this boundary before: a Python bool or a concrete
        ``bool[B]`` that is uniform (see :func:`uniform_seen`).
      key: PRNG key of the stochastic rounding (split into one key per row).
      bits: forward code width, 1..8 (the paper uses 2-4).
      bucket_size: elements per scale, default ``sample_shape[-1]``.

    Returns:
      ``(payload, new_previous)``. Seen: the row-batched ``Quantized`` of
      ``activation - previous`` and ``previous + dequantize(payload)``. Unseen: the
      activation itself (float32, sent in full) and the activation. ``new_previous`` is
      bit-identical to what :func:`aqsgd_decode` rebuilds on the receiver; the payload's
      bytes (:func:`jaxcomm.codecs.payload_bytes`) are the bytes on the wire.
    """
    codec = quantized_rows(bits, bucket_size)
    return delta_encode(activation, previous, seen, key, codec)


def aqsgd_decode(payload: Quantized | jax.Array, previous: jax.Array) -> jax.Array:
    """Receiver side: rebuild the message ``m`` the next stage consumes.

    A delta payload (``Quantized``) gives ``previous + dequantize(payload)``, computed by the
    same compiled function as the sender's, so both sides hold the same array bit for bit;
    a float32 payload (a first visit) is the message itself.

    Args:
      payload: what :func:`aqsgd_encode` sent.
      previous: ``f32[B, *sample_shape]`` the receiver's copy of the previous messages.

    Returns:
      ``f32[B, *sample_shape]`` the new messages (also the receiver's next ``previous``).
    """
    if isinstance(payload, FirstVisit):
        raise TypeError("payload is a FirstVisit; AQ-SGD sends first visits in float32")
    return delta_decode(payload, previous)


# --------------------------------------------------------------------------- baselines


def directq_encode(
    activation: jax.Array, key: jax.Array, *, bits: int, bucket_size: int | None = None
) -> Quantized:
    """DirectQ baseline (and the backward ``Q_bw``): quantize the array itself, per row.

    Args:
      activation: ``f32[B, *sample_shape]``.
      key: PRNG key (one split per row).
      bits: code width, 1..8.
      bucket_size: elements per scale, default ``sample_shape[-1]``.

    Returns:
      Row-batched :class:`~jaxcomm.codecs.Quantized` (leaves ``[B, ...]``) of
      ``B * (ceil(n * bits / 8) + 4 * ceil(n / bucket_size))`` bytes
      (:func:`jaxcomm.codecs.payload_bytes`).
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    activation = _check_activation("activation", activation)
    bucket_size = _bucket(bucket_size, activation.shape)
    check_finite_if_concrete("activation", activation)
    return _quantize_rows(activation, key, bits, bucket_size)


def directq_decode(payload: Quantized) -> jax.Array:
    """Decode a row-batched payload of :func:`directq_encode` to ``f32[B, *sample_shape]``."""
    if not isinstance(payload, Quantized):
        raise TypeError(f"payload must be a Quantized payload, got {type(payload).__name__}")
    _rows(payload)
    return _decode_rows(payload)


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
    g_hat = directq_decode(directq_encode(g, key, bits=bits, bucket_size=bucket_size))
    return g_hat.astype(g.dtype), None


_quantize_grad.defvjp(_quantize_grad_fwd, _quantize_grad_bwd)


def quantize_grad(
    x: jax.Array, key: jax.Array, *, bits: int, bucket_size: int | None = None
) -> jax.Array:
    """Identity forward; the VJP quantizes the incoming cotangent (the paper's ``Q_bw``).

    The cotangent goes through :func:`directq_encode` / :func:`directq_decode`, the codec the
    pipeline sends backward: stochastic rounding at ``bits`` bits, per row, in buckets of
    ``bucket_size`` (default the last axis), so ``E[grad] = cotangent``. ``key`` receives no
    gradient; use a fresh key per step and boundary.

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

    Read from the payload's leaves (via ``jax.eval_shape``; nothing is computed):
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
