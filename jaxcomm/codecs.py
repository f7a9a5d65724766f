"""Wire codecs: packed bits, stochastic uniform quantization, signs and top-k.

Every encoder is a pure, jit-able function of arrays (and a PRNG key where it rounds
stochastically) that returns a *payload*: a pytree whose array leaves are exactly the bytes
that cross the wire (``uint8`` codes, ``int32`` indices, ``float32`` scales). Static facts
(shape, dtype, bit width) ride in the pytree's metadata and cost nothing on the wire, since
both sides of a link know them from the program. ``payload_bytes`` sums the leaves, so wire
bytes are counted, never estimated.

Bit order: element ``j`` of a packed stream lives in byte ``j // 8``, bit ``j % 8``
(least-significant bit first). A ``b``-bit code occupies bits ``j*b .. j*b+b-1`` of the
stream, least-significant bit first, so ``n`` codes of ``b`` bits take ``ceil(n*b/8)`` bytes.

Non-finite inputs: the encoders raise ``ValueError`` on concrete (eager) arrays that hold
NaN or Inf. Under ``jit`` they cannot raise; a non-finite element then makes its bucket's
scale non-finite, so the decoded bucket is non-finite too (never a finite wrong value), and
``payload_is_finite`` reports it. The trainers check every step and stop with an error.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxcomm._checks import check_choice, check_finite_if_concrete, check_int

__all__ = [
    "Quantized",
    "SignCode",
    "TopK",
    "quantize",
    "dequantize",
    "pack_bits",
    "unpack_bits",
    "pack_codes",
    "unpack_codes",
    "sign_encode",
    "sign_decode",
    "topk_encode",
    "topk_gather",
    "topk_decode",
    "payload_bytes",
    "payload_is_finite",
    "quantized_nbytes",
]


# --------------------------------------------------------------------------- bits


def pack_bits(bits: jax.Array) -> jax.Array:
    """Pack booleans along the last axis, 8 per byte, least-significant bit first.

    Args:
      bits: ``bool[..., n]`` (any integer array is read as ``!= 0``).

    Returns:
      ``uint8[..., ceil(n / 8)]``; the unused high bits of the last byte are zero.
    """
    bits = jnp.asarray(bits)
    n = bits.shape[-1]
    pad = (-n) % 8
    b = (bits != 0).astype(jnp.uint8)
    if pad:
        b = jnp.pad(b, [(0, 0)] * (b.ndim - 1) + [(0, pad)])
    b = b.reshape(*b.shape[:-1], -1, 8)
    weights = jnp.left_shift(jnp.uint8(1), jnp.arange(8, dtype=jnp.uint8))
    return jnp.sum(b * weights, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, n: int) -> jax.Array:
    """Inverse of :func:`pack_bits`: ``uint8[..., m]`` -> ``bool[..., n]`` with ``n <= 8 m``."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    n = check_int("n", n, lo=0, hi=8 * packed.shape[-1])
    shifts = jnp.arange(8, dtype=jnp.uint8)
    bits = (jnp.right_shift(packed[..., None], shifts) & jnp.uint8(1)).astype(jnp.bool_)
    return bits.reshape(*packed.shape[:-1], -1)[..., :n]


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Pack ``bits``-bit codes ``uint8[..., n]`` into ``uint8[..., ceil(n * bits / 8)]``.

    Widths that divide 8 pack whole codes per byte; other widths go through a bit stream.
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    codes = jnp.asarray(codes).astype(jnp.uint8)
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    if bits == 8:
        return codes
    if 8 % bits == 0:
        per = 8 // bits
        pad = (-n) % per
        if pad:
            codes = jnp.pad(codes, [(0, 0)] * len(lead) + [(0, pad)])
        codes = codes.reshape(*lead, -1, per)
        shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
        # Fields do not overlap, so the sum is a bitwise OR.
        return jnp.sum(jnp.left_shift(codes, shifts), axis=-1, dtype=jnp.uint8)
    # Other widths: 8 codes fill exactly `bits` bytes; each byte gathers the (at most two)
    # codes overlapping it with static shifts, so no per-bit intermediate is formed.
    pad = (-n) % 8
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * len(lead) + [(0, pad)])
    group = codes.reshape(*lead, -1, 8).astype(jnp.uint32)
    out = []
    for k in range(bits):
        acc = jnp.zeros(group.shape[:-1], jnp.uint32)
        for j in range(8):
            shift = j * bits - 8 * k
            if -bits < shift < 8:
                part = group[..., j]
                acc = acc | (part << shift if shift >= 0 else part >> -shift)
        out.append((acc & 0xFF).astype(jnp.uint8))
    packed = jnp.stack(out, axis=-1).reshape(*lead, -1)
    return packed[..., : -(-n * bits // 8)]


def unpack_codes(packed: jax.Array, bits: int, n: int) -> jax.Array:
    """Inverse of :func:`pack_codes`: ``uint8[..., m]`` -> ``uint8[..., n]`` codes."""
    bits = check_int("bits", bits, lo=1, hi=8)
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8, got {packed.dtype}")
    lead = packed.shape[:-1]
    if bits == 8:
        return packed[..., :n]
    if 8 % bits == 0:
        per = 8 // bits
        shifts = (jnp.arange(per, dtype=jnp.uint8) * bits).astype(jnp.uint8)
        mask = jnp.uint8((1 << bits) - 1)
        codes = jnp.right_shift(packed[..., None], shifts) & mask
        return codes.reshape(*lead, -1)[..., :n]
    nbytes = packed.shape[-1]
    pad = (-nbytes) % bits
    if pad:
        packed = jnp.pad(packed, [(0, 0)] * len(lead) + [(0, pad)])
    group = packed.reshape(*lead, -1, bits).astype(jnp.uint32)
    mask = jnp.uint32((1 << bits) - 1)
    codes = []
    for j in range(8):
        acc = jnp.zeros(group.shape[:-1], jnp.uint32)
        for k in range(bits):
            shift = 8 * k - j * bits
            if -8 < shift < bits:
                part = group[..., k]
                acc = acc | (part << shift if shift >= 0 else part >> -shift)
        codes.append((acc & mask).astype(jnp.uint8))
    return jnp.stack(codes, axis=-1).reshape(*lead, -1)[..., :n]


# --------------------------------------------------------------------------- payloads


def _payload(cls):
    data = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("static")]
    meta = [f.name for f in dataclasses.fields(cls) if f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def _static(**kw: Any) -> Any:
    return dataclasses.field(metadata={"static": True}, **kw)


@_payload
@dataclasses.dataclass(frozen=True)
class Quantized:
    """A bucketed uniform-quantization payload.

    Attributes:
      codes: ``uint8[ceil(n * bits / 8)]`` packed codes, ``n = prod(shape)``.
      scale: ``float32[num_buckets]``; max-abs per bucket (``symmetric``) or the bucket max.
      offset: ``float32[num_buckets]`` bucket minimum (min/max grid), or ``None`` (symmetric).
      shape, dtype: the original array's (static).
      bits: code width in bits, 1..8 (static).
      bucket_size: elements per bucket (static); the last bucket may be short.
    """

    codes: jax.Array
    scale: jax.Array
    offset: jax.Array | None
    shape: tuple[int, ...] = _static()
    dtype: str = _static()
    bits: int = _static()
    bucket_size: int = _static()


@_payload
@dataclasses.dataclass(frozen=True)
class SignCode:
    """Packed sign bits (1 for ``x > 0``, else 0) and an optional scale.

    Attributes:
      bits: ``uint8[..., ceil(n / 8)]`` packed along the last axis.
      scale: ``float32[]`` magnitude decoded for every element, or ``None`` (decode to +-1).
      shape, dtype: the original array's (static).
    """

    bits: jax.Array
    scale: jax.Array | None
    shape: tuple[int, ...] = _static()
    dtype: str = _static()


@_payload
@dataclasses.dataclass(frozen=True)
class TopK:
    """Sparse payload: ``values[k]`` at flat ``indices[k]`` (``int32``) of an array of ``shape``."""

    values: jax.Array
    indices: jax.Array
    shape: tuple[int, ...] = _static()
    dtype: str = _static()


def payload_bytes(payload: Any) -> int:
    """Bytes on the wire: the sum of ``size * itemsize`` over the payload's array leaves.

    Works on concrete arrays, tracers and ``jax.ShapeDtypeStruct`` leaves; static metadata
    (shapes, bit widths) costs nothing.
    """
    total = 0
    for leaf in jax.tree_util.tree_leaves(payload):
        total += int(math.prod(jnp.shape(leaf))) * jnp.dtype(leaf.dtype).itemsize
    return total


def payload_is_finite(payload: Any) -> jax.Array:
    """``bool[]``: True when every floating leaf of the payload is finite."""
    ok = jnp.bool_(True)
    for leaf in jax.tree_util.tree_leaves(payload):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            ok = ok & jnp.all(jnp.isfinite(leaf))
    return ok


# --------------------------------------------------------------------------- quantizer


def quantized_nbytes(n: int, *, bits: int, bucket_size: int, symmetric: bool = True) -> int:
    """Wire bytes of :func:`quantize` for ``n`` elements: codes plus 4-byte scales (and offsets)."""
    buckets = -(-n // bucket_size)
    return -(-n * bits // 8) + 4 * buckets * (1 if symmetric else 2)


@functools.partial(jax.jit, static_argnames=("bits", "bucket_size", "stochastic", "symmetric"))
def _quantize(x, key, bits, bucket_size, stochastic, symmetric):
    shape, dtype = x.shape, x.dtype
    flat = x.reshape(-1).astype(jnp.float32)
    n = flat.shape[0]
    pad = (-n) % bucket_size
    # Edge padding repeats a real value, so it never widens the last bucket's range.
    xb = jnp.pad(flat, (0, pad), mode="edge").reshape(-1, bucket_size)
    levels = float((1 << bits) - 1)
    if symmetric:
        scale = jnp.max(jnp.abs(xb), axis=1)
        safe = jnp.where(scale > 0, scale, 1.0)
        y = (xb / safe[:, None] + 1.0) * (levels / 2.0)
        offset = None
    else:
        hi = jnp.max(xb, axis=1)
        lo = jnp.min(xb, axis=1)
        # Halves keep hi - lo finite for inputs near the float32 limit.
        half_range = hi * 0.5 - lo * 0.5
        safe = jnp.where(half_range > 0, half_range, 1.0)
        y = (xb * 0.5 - lo[:, None] * 0.5) / safe[:, None] * levels
        scale, offset = hi, lo
    if stochastic:
        u = jax.random.uniform(key, xb.shape, jnp.float32)
        q = jnp.floor(y + u)
    else:
        q = jnp.round(y)
    q = jnp.clip(q, 0.0, levels).astype(jnp.uint8).reshape(-1)[:n]
    codes = pack_codes(q, bits)
    return Quantized(codes, scale, offset, tuple(shape), jnp.dtype(dtype).name, bits, bucket_size)


def quantize(
    x: jax.Array,
    key: jax.Array | None,
    *,
    bits: int,
    bucket_size: int = 512,
    stochastic: bool = True,
    symmetric: bool = True,
) -> Quantized:
    """Uniform ``bits``-bit quantization in buckets, unbiased with stochastic rounding.

    ``x`` is flattened and cut into buckets of ``bucket_size`` consecutive elements. Each
    bucket's range is split into ``2**bits - 1`` equal intervals: ``[-s, s]`` with ``s`` the
    bucket's max-abs (``symmetric=True``, one float32 per bucket), or ``[min, max]``
    (``symmetric=False``, two float32 per bucket: tighter for one-signed data such as
    post-GELU activations). With ``stochastic=True`` a value at fractional grid position
    ``y`` rounds up with probability ``y - floor(y)``, so ``E[dequantize(quantize(x))] = x``;
    otherwise it rounds to the nearest level (biased, lower variance).

    Args:
      x: float array of any shape.
      key: PRNG key, required when ``stochastic``.
      bits: code width, 1..8.
      bucket_size: elements per scale, >= 1.
      stochastic: stochastic (unbiased) or nearest rounding.
      symmetric: max-abs grid or min/max grid.

    Returns:
      A :class:`Quantized` payload of ``quantized_nbytes(x.size, ...)`` bytes.
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    bucket_size = check_int("bucket_size", bucket_size, lo=1)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got dtype {x.dtype}")
    if x.size == 0:
        raise ValueError(f"x must have at least one element, got shape {x.shape}")
    check_finite_if_concrete("x", x)
    if stochastic and key is None:
        raise ValueError("key must be a PRNG key when stochastic=True, got None")
    if key is None:
        key = jax.random.key(0)
    return _quantize(x, key, bits, bucket_size, bool(stochastic), bool(symmetric))


def dequantize(q: Quantized) -> jax.Array:
    """Decode a :class:`Quantized` payload to an array of the original shape and dtype."""
    if not isinstance(q, Quantized):
        raise TypeError(f"q must be a Quantized payload, got {type(q).__name__}")
    n = math.prod(q.shape)
    nb = q.scale.shape[0]
    levels = float((1 << q.bits) - 1)
    codes = unpack_codes(q.codes, q.bits, n).astype(jnp.float32)
    codes = jnp.pad(codes, (0, nb * q.bucket_size - n)).reshape(nb, q.bucket_size)
    t = codes / levels
    if q.offset is None:
        out = (2.0 * t - 1.0) * q.scale[:, None]
    else:
        # A convex combination never overflows, even when max - min would.
        out = q.offset[:, None] * (1.0 - t) + q.scale[:, None] * t
    return out.reshape(-1)[:n].reshape(q.shape).astype(q.dtype)


# --------------------------------------------------------------------------- signs


def sign_encode(x: jax.Array, *, scale: bool = False) -> SignCode:
    """One bit per element: 1 where ``x > 0``, else 0, packed along the last axis.

    Args:
      x: float array ``[..., n]``.
      scale: also send ``mean(|x|)`` (4 bytes), decoded as the magnitude (EF-signSGD style).

    Returns:
      :class:`SignCode` of ``prod(x.shape[:-1]) * ceil(n / 8)`` bytes (plus 4 with ``scale``).
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    check_finite_if_concrete("x", x)
    s = jnp.mean(jnp.abs(x.astype(jnp.float32))) if scale else None
    return SignCode(pack_bits(x > 0), s, tuple(x.shape), jnp.dtype(x.dtype).name)


def sign_decode(code: SignCode) -> jax.Array:
    """Decode a :class:`SignCode` to ``+-scale`` (``+-1`` without a scale) of the original shape."""
    if not isinstance(code, SignCode):
        raise TypeError(f"code must be a SignCode payload, got {type(code).__name__}")
    bits = unpack_bits(code.bits, code.shape[-1])
    out = jnp.where(bits, 1.0, -1.0).astype(jnp.float32)
    if code.scale is not None:
        out = out * code.scale
    return out.astype(code.dtype)


# --------------------------------------------------------------------------- top-k


def _resolve_k(d: int, k: int | None, ratio: float | None) -> int:
    if (k is None) == (ratio is None):
        raise ValueError(f"give exactly one of k and ratio, got k={k!r}, ratio={ratio!r}")
    if ratio is not None:
        if not (0.0 < float(ratio) <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        return max(1, math.ceil(float(ratio) * d))
    return check_int("k", k, lo=1, hi=d)


def topk_encode(
    x: jax.Array, *, k: int | None = None, ratio: float | None = None, method: str = "exact"
) -> TopK:
    """The ``k`` largest-magnitude entries of ``x`` (flattened) with their ``int32`` indices.

    Args:
      x: float array of any shape, ``d`` elements.
      k: entries to keep, in ``[1, d]``; or
      ratio: keep ``ceil(ratio * d)`` entries, ratio in ``(0, 1]``.
      method: ``"exact"`` (``lax.top_k``) or ``"approx"`` (``lax.approx_max_k``, faster on
        accelerators, exact on CPU).

    Returns:
      :class:`TopK` of ``k * (itemsize + 4)`` bytes.
    """
    x = jnp.asarray(x)
    check_finite_if_concrete("x", x)
    check_choice("method", method, ("exact", "approx"))
    flat = x.reshape(-1)
    k = _resolve_k(flat.shape[0], k, ratio)
    mag = jnp.abs(flat)
    if method == "exact":
        _, idx = jax.lax.top_k(mag, k)
    else:
        _, idx = jax.lax.approx_max_k(mag, k)
    idx = idx.astype(jnp.int32)
    return TopK(flat[idx], idx, tuple(x.shape), jnp.dtype(x.dtype).name)


def topk_gather(x: jax.Array, indices: jax.Array) -> TopK:
    """Entries of ``x`` (flattened) at given ``int32[k]`` indices, as a :class:`TopK` payload."""
    x = jnp.asarray(x)
    indices = jnp.asarray(indices).astype(jnp.int32)
    return TopK(x.reshape(-1)[indices], indices, tuple(x.shape), jnp.dtype(x.dtype).name)


def topk_decode(p: TopK) -> jax.Array:
    """Scatter a :class:`TopK` payload into a dense zero array of the original shape."""
    if not isinstance(p, TopK):
        raise TypeError(f"p must be a TopK payload, got {type(p).__name__}")
    n = math.prod(p.shape)
    out = jnp.zeros((n,), p.dtype).at[p.indices].add(p.values.astype(p.dtype))
    return out.reshape(p.shape)
