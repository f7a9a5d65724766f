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
import numpy as np
from jax import lax

from jaxcomm._src._checks import check_choice, check_finite_if_concrete, check_float, check_int
from jaxcomm._src.rng import stochastic_round

__all__ = [
    "AUTO_THRESHOLD_ABOVE",
    "SELECTIONS",
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
    "topk_indices",
    "topk_gather",
    "topk_decode",
    "ChunkTopK",
    "chunk_topk_encode",
    "chunk_topk_decode",
    "pack_uints",
    "unpack_uints",
    "LowRank",
    "lowrank_encode",
    "lowrank_decode",
    "payload_bytes",
    "payload_is_finite",
    "quantized_nbytes",
    "StatQuantized",
    "stat_quantize",
    "stat_dequantize",
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
    # Other widths: 8 codes fill exactly `bits` bytes (at most 56 bits). Each group of 8 is
    # summed into two uint32 words (fields are disjoint, so the sum is an OR; a shift by 32
    # or more gives 0 in XLA) and the words are cut into bytes. Summing reads every code
    # once; gathering each byte from the codes that overlap it would make XLA fuse the
    # code's producer (a whole quantizer) into every byte that reads it.
    pad = (-n) % 8
    if pad:
        codes = jnp.pad(codes, [(0, 0)] * len(lead) + [(0, pad)])
    group = codes.reshape(*lead, -1, 8).astype(jnp.uint32)
    pos = jnp.arange(8, dtype=jnp.uint32) * jnp.uint32(bits)  # bit offset of each code
    low = group << pos
    if bits < 4:
        lo, hi = jnp.sum(low, axis=-1, dtype=jnp.uint32), None
    else:
        spill = jnp.where(pos >= 32, group << (pos - 32), group >> (jnp.uint32(32) - pos))
        # One reduction with two outputs: two separate sums would each recompute the
        # codes' producer (for a quantizer, the whole quantizer).
        zero = jnp.uint32(0)
        lo, hi = lax.reduce(
            (low, spill),
            (zero, zero),
            lambda a, b: (a[0] | b[0], a[1] | b[1]),
            (group.ndim - 1,),
        )
    out = [((lo if k < 4 else hi) >> (8 * (k % 4))) & 0xFF for k in range(bits)]
    packed = jnp.stack(out, axis=-1).astype(jnp.uint8).reshape(*lead, -1)
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
    # Other widths: each group of `bits` bytes holds 8 codes; gather it into two uint32
    # words (one read of every byte, as in pack_codes) and cut the codes out of the words.
    nbytes = packed.shape[-1]
    pad = (-nbytes) % bits
    if pad:
        packed = jnp.pad(packed, [(0, 0)] * len(lead) + [(0, pad)])
    group = packed.reshape(*lead, -1, bits).astype(jnp.uint32)
    at = jnp.arange(bits, dtype=jnp.uint32) * 8  # bit offset of each byte in the group
    lo = jnp.sum(group << at, axis=-1, dtype=jnp.uint32)
    hi = None
    if bits > 4:
        high = jnp.where(at >= 32, group << (at - 32), jnp.uint32(0))
        hi = jnp.sum(high, axis=-1, dtype=jnp.uint32)
    mask = jnp.uint32((1 << bits) - 1)
    pos = jnp.arange(8, dtype=jnp.uint32) * jnp.uint32(bits)  # bit offset of each code
    # Broadcast shifts (one elementwise op over [groups, 8]) rather than a stack of eight
    # slices, which XLA would fuse as a per-element select between eight operands.
    codes = lo[..., None] >> pos
    if hi is not None:
        high = jnp.where(pos >= 32, hi[..., None] >> (pos - 32), hi[..., None] << (32 - pos))
        codes = jnp.where(pos == 0, codes, codes | high)
    codes = (codes & mask).astype(jnp.uint8)
    return codes.reshape(*lead, -1)[..., :n]


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
    # XLA's CPU max reduction does not always propagate NaN (vectorized max keeps the other
    # operand), so a bucket holding any NaN or Inf gets a NaN scale explicitly: it decodes
    # non-finite and the flag reaches whoever receives it.
    poisoned = jnp.where(jnp.all(jnp.isfinite(xb), axis=1), 0.0, jnp.nan)
    if symmetric:
        scale = jnp.max(jnp.abs(xb), axis=1) + poisoned
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
        scale, offset = hi + poisoned, lo + poisoned
    if stochastic:
        q = stochastic_round(y, key)
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
    if q.offset is None:
        # (2 c - L) is an exact integer and each product one rounding: the same bits
        # whichever loop XLA fuses the decode into (a division, or a product followed by a
        # sum, may be rounded differently in a vectorized loop and its scalar remainder).
        step = q.scale[:, None] * (1.0 / levels)
        return ((2.0 * codes - levels) * step).reshape(-1)[:n].reshape(q.shape).astype(q.dtype)
    t = codes / levels
    # A convex combination never overflows, even when max - min would.
    out = q.offset[:, None] * (1.0 - t) + q.scale[:, None] * t
    return out.reshape(-1)[:n].reshape(q.shape).astype(q.dtype)


# --------------------------------------------------------------------------- statistical


@_payload
@dataclasses.dataclass(frozen=True)
class StatQuantized:
    """A statistical-quantization payload (:func:`stat_quantize`).

    Attributes:
      codes: ``uint8[ceil(d * bits / 8)]`` packed codes of the ``d`` elements.
      table: ``float32[segments, 2 ** bits]``: what each code of each segment decodes to.
      sizes: elements of each segment, in order (static; they sum to ``d``).
      bits: code width, 1..8 (static).
    """

    codes: jax.Array
    table: jax.Array
    sizes: tuple[int, ...] = _static()
    bits: int = _static()


@functools.partial(jax.jit, static_argnames=("bits", "sigmas", "sizes"))
def _stat_quantize(x, bits, sigmas, sizes):
    levels = 1 << bits
    codes, tables, at = [], [], 0
    for size in sizes:
        seg = x[at : at + size]
        at += size
        mean = jnp.mean(seg)
        std = jnp.std(seg, ddof=1) if size > 1 else jnp.zeros((), jnp.float32)
        scale = sigmas * std / levels
        safe = jnp.where(scale > 0, scale, 1.0)
        q = jnp.clip(jnp.round((seg - mean) / safe + levels / 2), 0, levels - 1)
        q = jnp.where(scale > 0, q, levels // 2).astype(jnp.int32)
        # Each code decodes to the mean of the values it stands for (the bin's centre where
        # no value fell in it); a NaN or Inf in the segment makes its whole table NaN.
        total = jax.ops.segment_sum(seg, q, num_segments=levels)
        count = jax.ops.segment_sum(jnp.ones_like(seg), q, num_segments=levels)
        centre = mean + (jnp.arange(levels, dtype=jnp.float32) - levels // 2) * scale
        table = jnp.where(count > 0, total / jnp.maximum(count, 1.0), centre)
        poisoned = jnp.where(jnp.all(jnp.isfinite(seg)), 0.0, jnp.nan)
        tables.append(table + poisoned)
        codes.append(q.astype(jnp.uint8))
    packed = pack_codes(jnp.concatenate(codes), bits)
    return StatQuantized(packed, jnp.stack(tables), sizes, bits)


def stat_quantize(
    x: jax.Array, *, bits: int = 2, sigmas: float = 6.0, sizes: tuple[int, ...] | None = None
) -> StatQuantized:
    """MuLoCo's statistical quantization of ``f32[d]`` in ``bits`` bits per element.

    Per segment (``sizes``: consecutive element counts, e.g. one per tensor; default one
    segment): with the segment's mean ``mu`` and unbiased standard deviation ``sigma``,
    ``L = 2 ** bits`` bins of width ``s = sigmas * sigma / L``, and code
    ``clip(round((x - mu) / s + L / 2), 0, L - 1)``: deterministic rounding. A code decodes
    to the mean of the segment's values that got it (``L`` float32 per segment ride with the
    codes), so each bin's reconstruction is unbiased over the bin and the grid adapts to
    the values' distribution. With ``bits=2``, ``sigmas=6`` the bins are centred at
    ``mu - 3 sigma``, ``mu - 1.5 sigma``, ``mu`` and ``mu + 1.5 sigma``. A NaN or Inf in a
    segment decodes that whole segment to NaN.

    This is the ``statistical`` quantizer of the MuLoCo authors' code (Therien et al.,
    arXiv 2505.23725), with which 2-bit error-fed pseudo-gradients keep DiLoCo's quality.
    """
    bits = check_int("bits", bits, lo=1, hi=8)
    sigmas = check_float("sigmas", sigmas, lo=0.0, lo_open=True)
    x = jnp.asarray(x)
    if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x must be a 1-D floating array, got {x.dtype}{list(x.shape)}")
    d = x.shape[0]
    sizes = (d,) if sizes is None else tuple(int(v) for v in sizes)
    if not sizes or any(v < 1 for v in sizes) or sum(sizes) != d:
        raise ValueError(f"sizes must be positive element counts summing to {d}, got {sizes}")
    return _stat_quantize(x.astype(jnp.float32), bits, float(sigmas), sizes)


def stat_dequantize(p: StatQuantized) -> jax.Array:
    """Decode a :class:`StatQuantized` payload to ``f32[d]``."""
    if not isinstance(p, StatQuantized):
        raise TypeError(f"p must be a StatQuantized payload, got {type(p).__name__}")
    codes = unpack_codes(p.codes, p.bits, sum(p.sizes)).astype(jnp.int32)
    out, at = [], 0
    for s, size in enumerate(p.sizes):
        out.append(p.table[s][codes[at : at + size]])
        at += size
    return jnp.concatenate(out)


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


SELECTIONS = ("auto", "exact", "approx", "threshold", "sample")
# Below AUTO_SAMPLE_FROM entries on the CPU, and on accelerators other than CUDA GPUs
# (unmeasured), above this share of entries a threshold search beats lax.top_k (a sort):
# measured on CPU by benchmarks/topk_selection.py before the sample selection existed. On an
# H200 (1M-64M floats) lax.top_k took about half the 31-round threshold search's time at
# ratio 0.1 and was level with it at 0.01 and 0.001
# (benchmarks/results/gpu/topk_selection_first.md), so ``auto`` takes ``exact`` on CUDA.
AUTO_THRESHOLD_ABOVE = 0.02
# On the CPU, ``auto`` takes the sample selection from this many entries on (below it one
# host call costs more than lax.top_k of the whole array: benchmarks/topk_selection.py).
AUTO_SAMPLE_FROM = 1 << 15


EXACT_ROUNDS = 31  # bisection rounds over float32 bit patterns that always end exact


def _threshold_indices(mag: jax.Array, k: int, rounds: int) -> jax.Array:
    """``k`` indices of large ``mag`` entries from a bisection on the threshold.

    The search runs on the magnitudes' float32 bit patterns (as unsigned integers), which
    order non-negative floats as their values do and put Inf and NaN above every finite
    value: it keeps ``lo`` with ``count(bits >= lo) >= k`` and ``hi`` with
    ``count(bits >= hi) < k``; after ``rounds`` halvings every entry ``>= hi`` is taken,
    and the rest of the ``k`` are the first entries (by index) in ``[lo, hi)``. The bit
    patterns lie in ``[0, 2**31)``, so after :data:`EXACT_ROUNDS` (31) rounds
    ``hi = lo + 1``, ``lo`` is the k-th largest pattern itself, and the result is exactly
    the ``k`` largest patterns, ties going to the lower index (``lax.top_k``'s set for
    finite input), whatever the spread of the values (a search on the values themselves
    stops within ``max|x| / 2**rounds`` of the threshold, which one large outlier makes
    coarse). A non-finite input therefore always reaches the payload, as in ``"sample"``.
    """
    mag = jnp.abs(mag).astype(jnp.float32)
    bits = lax.bitcast_convert_type(mag, jnp.uint32) & jnp.uint32(_SIGNLESS)
    hi0 = jnp.max(bits) + jnp.uint32(1)  # <= 2**31: no overflow in uint32

    def halve(_, bracket):
        lo, hi = bracket
        mid = lo + (hi - lo) // jnp.uint32(2)
        enough = jnp.sum(bits >= mid, dtype=jnp.int32) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo, hi = lax.fori_loop(0, rounds, halve, (jnp.zeros_like(hi0), hi0))
    above = bits >= hi  # fewer than k entries: all taken
    between = (bits >= lo) & ~above  # the rest of the k, lowest indices first
    c_above = jnp.cumsum(above, dtype=jnp.int32)
    c_between = jnp.cumsum(between, dtype=jnp.int32)
    # Slot j holds the (j+1)-th entry of `above`, then of `between`: k binary searches on
    # the running counts instead of a scatter of all d entries.
    j = jnp.arange(k, dtype=jnp.int32)
    n_above = c_above[-1]
    first = jnp.searchsorted(c_above, j + 1, side="left", method="scan_unrolled")
    rest = jnp.searchsorted(c_between, j + 1 - n_above, side="left", method="scan_unrolled")
    return jnp.where(j < n_above, first, rest).astype(jnp.int32)


# The named scope around the sample selection's host call: the audit costs it by this name.
SAMPLE_TOPK_SCOPE = "jaxcomm_sample_topk"
_SIGNLESS = 0x7FFFFFFF  # float32 bits without the sign: the magnitude's bit pattern
_SAMPLE = 1 << 16  # entries of the strided sample that places the thresholds
_BLOCK = 1 << 16  # entries per block of the candidate pass (its temporaries stay in cache)


def _sample_select_host(x: np.ndarray, k: int) -> np.ndarray:
    """``int32[k]`` indices (ascending) of the ``k`` largest ``|x|``, ties to the lower index.

    Exact top-k in about one pass over ``x``: a strided sample of :data:`_SAMPLE` entries
    places two thresholds on the magnitudes' bit patterns, ``t_lo`` (at least ``k`` entries
    above it, a few standard deviations of the sample's count to spare) and ``t_hi`` (fewer
    than ``k`` above it); one blocked pass keeps the entries at or above ``t_lo`` (their
    indices and bit patterns); all of those at or above ``t_hi`` are in the top-k, and the
    rest of the ``k`` is an exact selection (a partition) among the few in between. When the
    sample misplaces a threshold (the count says so) the bound is dropped, which only costs
    time: the result is exact whatever the data. NaN and Inf have bit patterns above every
    finite magnitude, so they are always selected.
    """
    bits = np.ascontiguousarray(x, np.float32).reshape(-1).view(np.int32)
    d = bits.size
    if k >= d:
        return np.arange(d, dtype=np.int32)
    s = min(d, _SAMPLE)
    sample = bits[:: d // s][:s] & np.int32(_SIGNLESS)
    q = k / d
    spare = 4.0 * math.sqrt(q * (1.0 - q) * s) + 4.0
    r_lo, r_hi = math.ceil(q * s + spare), math.floor(q * s - spare)

    def candidates(t_lo):
        idx, val = [], []
        for start in range(0, d, _BLOCK):
            block = bits[start : start + _BLOCK] & np.int32(_SIGNLESS)
            i = np.flatnonzero(block >= t_lo)
            idx.append(i.astype(np.int32) + np.int32(start))
            val.append(block[i])
        return np.concatenate(idx), np.concatenate(val)

    idx, val = candidates(np.partition(sample, s - r_lo)[s - r_lo] if r_lo < s else 0)
    if idx.size < k:  # t_lo too high: every entry is a candidate
        idx, val = candidates(0)
    between = None
    if r_hi >= 1:
        t_hi = np.partition(sample, s - r_hi)[s - r_hi]
        between = np.flatnonzero(val < t_hi)
        if idx.size - between.size >= k:  # t_hi too low: every candidate is in between
            between = None
    if between is None:
        between = np.arange(idx.size)
    need = k - (idx.size - between.size)  # >= 1 of the entries in between
    vals = val[between]
    kth = np.partition(vals, vals.size - need)[vals.size - need]
    take = vals > kth
    ties = np.flatnonzero(vals == kth)
    take[ties[: need - int(np.count_nonzero(take))]] = True  # ties: lower indices first
    keep = np.ones(idx.size, bool)
    keep[between[~take]] = False
    return idx[keep]


def _varying_like(y: jax.Array, x: jax.Array) -> jax.Array:
    """``y`` typed as varying over the manual mesh axes ``x`` varies over (inside
    ``shard_map`` a callback's result is typed invariant, though it is computed per device)."""
    want = getattr(jax.typeof(x), "manual_axis_type", None)
    have = getattr(jax.typeof(y), "manual_axis_type", None)
    if want is None or have is None:
        return y
    missing = tuple(n for n in want.varying if n not in have.varying)
    return lax.pcast(y, missing, to="varying") if missing else y


def _sample_indices(x: jax.Array, k: int) -> jax.Array:
    """The sample selection: on the CPU the host kernel above, called from inside the
    compiled program on the device buffers themselves (``buffer_callback``: a CPU device's
    memory is host memory, so nothing is copied); on other platforms the 31-round threshold
    search, which returns the same set."""
    out = jax.ShapeDtypeStruct((k,), jnp.int32)

    def host(v):
        with jax.named_scope(SAMPLE_TOPK_SCOPE):  # the audit costs the call by this name
            return _host(v)

    def _host(v):
        try:
            from jax.experimental.buffer_callback import buffer_callback
        except ImportError:  # an older JAX: the same kernel on a copy of the array
            fn = functools.partial(_sample_select_host, k=k)
            v = lax.stop_gradient(v)
            return _varying_like(jax.pure_callback(fn, out, v, vmap_method="sequential"), v)

        def fill(_ctx, result, v):
            np.asarray(result)[...] = _sample_select_host(np.asarray(v), k)

        # The indices are integers, but a grad of the code around them differentiates the
        # callback's input; a callback has no derivative rule, and needs none.
        v = lax.stop_gradient(v)
        return _varying_like(buffer_callback(fill, out, vmap_method="sequential")(v), v)

    def device(v):
        return _threshold_indices(jnp.abs(v), k, EXACT_ROUNDS)

    return lax.platform_dependent(x, cpu=host, default=device)


def topk_indices(
    x: jax.Array, k: int, *, method: str = "auto", rounds: int = EXACT_ROUNDS
) -> jax.Array:
    """``int32[k]`` indices of the ``k`` largest-magnitude entries of a flat array.

    Args:
      x: ``f32[d]``.
      k: entries to keep, ``1 <= k <= d``.
      method: ``"auto"`` (on the CPU, ``"sample"`` from :data:`AUTO_SAMPLE_FROM` entries
        on; on a CUDA GPU ``"exact"``; otherwise ``"threshold"`` with 31 rounds when
        ``k / d`` exceeds :data:`AUTO_THRESHOLD_ABOVE`, else ``"exact"``; exact either
        way), ``"exact"``
        (``lax.top_k``: exact, ties to the lower index), ``"approx"``
        (``lax.approx_max_k``: exact on CPU and GPU, recall about 0.95 on TPU),
        ``"threshold"`` (bisection on the magnitudes' float32 bit patterns for ``rounds``
        rounds, then one pass that compacts the entries above it: with ``rounds >= 31``
        exactly ``lax.top_k``'s set, ties to the lower index; with fewer, the last slots go
        to the lowest indices inside the final bracket of ``2**(31 - rounds)`` bit
        patterns) or ``"sample"`` (exact, ties to the lower index: thresholds placed by a
        strided sample, one pass that keeps the entries above the lower one, an exact
        selection among the few between the two; on the CPU a host kernel run on the
        device buffer in one pass over ``x``, elsewhere the 31-round threshold search). A
        host kernel has limits: a program holding it is not written to JAX's persistent
        compilation cache, cannot be serialized by ``jax.export``, and cannot be vmapped
        over an axis sharded on an explicit mesh axis; use ``"exact"`` or ``"threshold"``
        there (``"auto"`` takes ``"sample"`` on the CPU from :data:`AUTO_SAMPLE_FROM`
        entries). NaN and Inf count as larger than every finite magnitude in
        ``"threshold"`` and ``"sample"`` (their bit patterns are) and are always selected.
        ``"sample"`` refuses float64 (it orders float32 bit patterns), and ``"auto"``
        takes ``"exact"`` for it and for integer input.
      rounds: bisection rounds of ``"threshold"``.
    Returned indices are a set: ``"exact"``/``"approx"`` list them by magnitude,
    ``"threshold"`` and ``"sample"`` by index.
    """
    check_choice("method", method, SELECTIONS)
    x = jnp.ravel(x)
    k = check_int("k", k, lo=1, hi=x.shape[0])
    mag = jnp.abs(x)
    wide = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 4
    if method == "sample":
        if wide:
            raise ValueError(
                f"method='sample' orders float32 bit patterns; x is {jnp.dtype(x.dtype).name}, "
                "where values that differ beyond float32 would tie: use method='exact'"
            )
        return _sample_indices(x, k)
    if method == "auto" and (wide or not jnp.issubdtype(x.dtype, jnp.floating)):
        method = "exact"  # float64 or integers: lax.top_k orders the values themselves
    if method == "auto":
        exact = functools.partial(topk_indices, k=k, method="exact")
        by_share = exact
        if k > AUTO_THRESHOLD_ABOVE * x.shape[0]:
            by_share = functools.partial(topk_indices, k=k, method="threshold", rounds=EXACT_ROUNDS)
        sample = x.shape[0] >= AUTO_SAMPLE_FROM
        cpu = functools.partial(_sample_indices, k=k) if sample else by_share
        return lax.platform_dependent(x, cpu=cpu, cuda=exact, default=by_share)
    if method == "exact":
        return lax.top_k(mag, k)[1].astype(jnp.int32)
    if method == "approx":
        return lax.approx_max_k(mag, k)[1].astype(jnp.int32)
    return _threshold_indices(mag, k, check_int("rounds", rounds, lo=1))


def _resolve_k(d: int, k: int | None, ratio: float | None) -> int:
    if (k is None) == (ratio is None):
        raise ValueError(f"give exactly one of k and ratio, got k={k!r}, ratio={ratio!r}")
    if ratio is not None:
        if not (0.0 < float(ratio) <= 1.0):
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        return max(1, math.ceil(float(ratio) * d))
    return check_int("k", k, lo=1, hi=d)


def topk_encode(
    x: jax.Array, *, k: int | None = None, ratio: float | None = None, method: str = "auto"
) -> TopK:
    """The ``k`` largest-magnitude entries of ``x`` (flattened) with their ``int32`` indices.

    Args:
      x: float array of any shape, ``d`` elements.
      k: entries to keep, in ``[1, d]``; or
      ratio: keep ``ceil(ratio * d)`` entries, ratio in ``(0, 1]``.
      method: the selection, one of :data:`SELECTIONS` (see :func:`topk_indices`):
        ``"auto"`` (the sample selection on the CPU from :data:`AUTO_SAMPLE_FROM` entries,
        ``lax.top_k`` on a CUDA GPU; otherwise a threshold search above 2% of entries,
        else ``lax.top_k``), ``"exact"``, ``"approx"``, ``"threshold"`` or ``"sample"``.

    Returns:
      :class:`TopK` of ``k * (itemsize + 4)`` bytes.
    """
    x = jnp.asarray(x)
    check_finite_if_concrete("x", x)
    check_choice("method", method, SELECTIONS)
    flat = x.reshape(-1)
    k = _resolve_k(flat.shape[0], k, ratio)
    idx = topk_indices(flat, k, method=method)
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


# --------------------------------------------------------------------------- chunk-wise top-k


def pack_uints(values: jax.Array, bits: int) -> jax.Array:
    """Pack unsigned integers below ``2**bits`` (``bits`` in 1..31) from ``[..., n]`` into
    ``uint8[..., ceil(n * bits / 8)]``, least-significant bit first (the stream layout of
    :func:`pack_codes`, for widths past 8 bits, e.g. 12-bit in-chunk indices)."""
    bits = check_int("bits", bits, lo=1, hi=31)
    values = jnp.asarray(values).astype(jnp.uint32)
    lead, n = values.shape[:-1], values.shape[-1]
    shifts = jnp.arange(bits, dtype=jnp.uint32)
    stream = ((values[..., None] >> shifts) & 1).astype(jnp.bool_)  # [..., n, bits]
    return pack_bits(stream.reshape(*lead, n * bits))


def unpack_uints(packed: jax.Array, bits: int, n: int) -> jax.Array:
    """Inverse of :func:`pack_uints`: ``uint8[..., m]`` -> ``uint32[..., n]``."""
    bits = check_int("bits", bits, lo=1, hi=31)
    packed = jnp.asarray(packed)
    lead = packed.shape[:-1]
    stream = unpack_bits(packed, n * bits).reshape(*lead, n, bits).astype(jnp.uint32)
    return jnp.sum(stream << jnp.arange(bits, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


@_payload
@dataclasses.dataclass(frozen=True)
class ChunkTopK:
    """Chunk-wise sparse payload: in each chunk of ``chunk`` consecutive entries, ``k``
    in-chunk positions and their values.

    Attributes:
      indices: ``uint8[ceil(chunks * k * index_bits / 8)]``: in-chunk positions packed in
        ``index_bits = ceil(log2(chunk))`` bits each (:func:`pack_uints`).
      values: ``float32[chunks, k]``, or a :class:`Quantized` of them with one scale per chunk.
      shape, dtype: the original array's (static).
      chunk, k: chunk length and entries kept per chunk (static).
    """

    indices: jax.Array
    values: Any
    shape: tuple[int, ...] = _static()
    dtype: str = _static()
    chunk: int = _static()
    k: int = _static()

    @property
    def index_bits(self) -> int:
        """Bits of one in-chunk position."""
        return max(1, math.ceil(math.log2(self.chunk)))


def chunk_topk_encode(
    x: jax.Array, *, chunk: int, k: int, bits: int | None = None, method: str = "exact"
) -> ChunkTopK:
    """Top-``k`` by magnitude of every chunk of ``chunk`` consecutive entries of ``x``
    (flattened; the last chunk is padded with zeros), SparseLoCo's compressor.

    Args:
      x: float array of any shape, ``d`` elements.
      chunk: entries per chunk, ``>= 2``; in-chunk positions take ``ceil(log2(chunk))`` bits.
      k: entries kept per chunk, ``1 <= k <= chunk``.
      bits: quantize the kept values to ``bits`` bits (1..8) with nearest rounding on each
        chunk's max-abs grid (one float32 scale per chunk), or None for float32 values.
        Nearest rounding is biased: pair it with error feedback. An even number of levels
        has no zero: a chunk with fewer than ``k`` non-zero entries sends zeros as the
        smallest level of either sign (``+-s/3`` at 2 bits), which error feedback takes
        back at the next call.
      method: the selection inside each chunk, as :func:`topk_indices` (``"exact"``:
        ``lax.top_k``, ties to the lower index).

    A chunk holding a NaN or Inf decodes to non-finite values (its scale, or its values, are
    made NaN), wherever in the chunk it was.

    Returns:
      :class:`ChunkTopK` of ``ceil(C k b_i / 8)`` index bytes plus ``4 C k`` value bytes
      (or ``ceil(C k bits / 8) + 4 C``), ``C = ceil(d / chunk)`` chunks.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got dtype {x.dtype}")
    if x.size == 0:
        raise ValueError(f"x must have at least one element, got shape {x.shape}")
    check_finite_if_concrete("x", x)
    chunk = check_int("chunk", chunk, lo=2)
    k = check_int("k", k, lo=1, hi=chunk)
    if bits is not None:
        bits = check_int("bits", bits, lo=1, hi=8)
    check_choice("method", method, SELECTIONS)
    flat = x.reshape(-1).astype(jnp.float32)
    d = flat.shape[0]
    rows = jnp.pad(flat, (0, (-d) % chunk)).reshape(-1, chunk)  # f32[C, chunk]
    idx = jax.vmap(lambda r: topk_indices(r, k, method=method))(rows)  # int32[C, k]
    vals = jnp.take_along_axis(rows, idx, axis=1)  # f32[C, k]
    # A non-finite entry that was not selected must still poison its chunk.
    poisoned = jnp.where(jnp.all(jnp.isfinite(rows), axis=1), 0.0, jnp.nan)[:, None]
    vals = vals + poisoned
    values: Any = vals
    if bits is not None:
        values = quantize(vals, None, bits=bits, bucket_size=k, stochastic=False)
    out = ChunkTopK(
        pack_uints(idx.reshape(-1), max(1, math.ceil(math.log2(chunk)))),
        values,
        tuple(x.shape),
        jnp.dtype(x.dtype).name,
        chunk,
        k,
    )
    return out


def chunk_topk_decode(p: ChunkTopK) -> jax.Array:
    """Scatter a :class:`ChunkTopK` payload into a dense zero array of the original shape."""
    if not isinstance(p, ChunkTopK):
        raise TypeError(f"p must be a ChunkTopK payload, got {type(p).__name__}")
    d = math.prod(p.shape)
    chunks = -(-d // p.chunk)
    idx = unpack_uints(p.indices, p.index_bits, chunks * p.k).astype(jnp.int32)
    vals = p.values if not isinstance(p.values, Quantized) else dequantize(p.values)
    vals = jnp.asarray(vals, jnp.float32).reshape(chunks, p.k)
    rows = jnp.zeros((chunks, p.chunk), jnp.float32)
    rows = jax.vmap(lambda r, i, v: r.at[i].set(v, unique_indices=True))(
        rows, idx.reshape(chunks, p.k), vals
    )
    return rows.reshape(-1)[:d].reshape(p.shape).astype(p.dtype)


# --------------------------------------------------------------------------- low rank


@_payload
@dataclasses.dataclass(frozen=True)
class LowRank:
    """Rank-``r`` payload of a matrix ``[m, n]``: ``left @ right`` with both factors
    quantized (:class:`Quantized`, one scale per factor column or row).

    Attributes:
      left: the ``[m, r]`` factor, stored transposed (``r`` buckets of ``m``).
      right: the ``[r, n]`` factor (``r`` buckets of ``n``).
      shape, dtype: the original array's (static); its last axis is ``n``.
      rank: ``r`` (static).
    """

    left: Quantized
    right: Quantized
    shape: tuple[int, ...] = _static()
    dtype: str = _static()
    rank: int = _static()


def lowrank_encode(
    x: jax.Array, key: jax.Array, *, rank: int, bits: int = 8, iters: int = 2
) -> LowRank:
    """Rank-``rank`` approximation of ``x`` seen as a matrix ``[prod(shape[:-1]), shape[-1]]``.

    A randomized range finder: ``Y = X @ G`` for a Gaussian ``G`` drawn from ``key``, then
    ``iters`` power iterations ``Y = X (X^T Y)`` (each re-orthonormalized), ``P = qr(Y)`` and
    ``R = P^T X``, so ``P R`` is close to the best rank-``rank`` approximation (the
    truncated SVD). Both factors are rounded to nearest on ``bits`` bits, one max-abs scale
    per column of ``P`` and per row of ``R``. Biased (what is beyond the rank is dropped):
    for deltas against a buffer that keeps what is not sent. A NaN or Inf in ``x`` makes the
    factors non-finite, so it reaches the decoded array.

    Args:
      x: float array with at least 2 axes, ``[..., m', n]``.
      key: PRNG key of the test matrix.
      rank: ``1 <= rank <= min(m, n)``.
      bits: factor code width, 1..8.
      iters: power iterations, >= 0.

    Returns:
      :class:`LowRank` of ``ceil(r m bits / 8) + ceil(r n bits / 8) + 8 r`` bytes.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got dtype {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 axes (a matrix), got shape {x.shape}")
    n = x.shape[-1]
    m = x.size // n
    rank = check_int("rank", rank, lo=1, hi=min(m, n))
    bits = check_int("bits", bits, lo=1, hi=8)
    iters = check_int("iters", iters, lo=0)
    a = x.reshape(m, n).astype(jnp.float32)
    y = a @ jax.random.normal(key, (n, rank), jnp.float32)
    for _ in range(iters):
        y = a @ (a.T @ jnp.linalg.qr(y)[0])
    p = jnp.linalg.qr(y)[0]  # [m, r], orthonormal columns
    r = p.T @ a  # [r, n]
    poisoned = jnp.where(jnp.all(jnp.isfinite(a)), 0.0, jnp.nan)  # QR may hide a NaN
    left = quantize(p.T + poisoned, None, bits=bits, bucket_size=m, stochastic=False)
    right = quantize(r + poisoned, None, bits=bits, bucket_size=n, stochastic=False)
    return LowRank(left, right, tuple(x.shape), jnp.dtype(x.dtype).name, rank)


def lowrank_decode(p: LowRank) -> jax.Array:
    """``left @ right`` of a :class:`LowRank` payload, in the original shape and dtype."""
    if not isinstance(p, LowRank):
        raise TypeError(f"p must be a LowRank payload, got {type(p).__name__}")
    n = p.shape[-1]
    m = math.prod(p.shape) // n
    # Both sides of a pipeline boundary decode inside one compiled program, where XLA may
    # fuse a decode into different loops (vectorized or not, a product and a sum contracted
    # to one fused multiply-add or not) and round differently by an ulp. Finished factors,
    # then each rank's product and the running sum materialized on their own, come out
    # bit-identical wherever the decode runs.
    left, right = lax.optimization_barrier(
        (dequantize(p.left).reshape(p.rank, m), dequantize(p.right).reshape(p.rank, n))
    )
    out = lax.optimization_barrier(left[0][:, None] * right[0][None, :])
    for j in range(1, p.rank):
        out = lax.optimization_barrier(
            out + lax.optimization_barrier(left[j][:, None] * right[j][None, :])
        )
    return out.reshape(p.shape).astype(p.dtype)
