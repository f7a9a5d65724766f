"""One codec protocol: ``encode(x, key) -> payload``, ``decode(payload) -> array``,
``nbytes(shape)``.

Each codec is a frozen dataclass of its settings (hashable, so it can be a static argument of
a compiled function) over the encoders of :mod:`jaxcomm._src.codecs`. A payload's class names
its decoder (:func:`decode`), so a receiver decodes whatever arrives without knowing the
sender's settings, as the wire requires. Two adapters use nothing but the protocol: a codec
compresses each row of a pipeline boundary (:class:`jaxcomm.pipeline.RowCodec`), and it is
the compressor of an error-fed gradient aggregator (:func:`jaxcomm.error_fed`). Adding a
codec is one subclass here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from jaxcomm._src._checks import check_float, check_int
from jaxcomm._src.codecs import (
    ChunkTopK,
    LowRank,
    Quantized,
    SignCode,
    StatQuantized,
    TopK,
    chunk_topk_decode,
    chunk_topk_encode,
    dequantize,
    lowrank_decode,
    lowrank_encode,
    payload_bytes,
    quantize,
    sign_decode,
    sign_encode,
    stat_dequantize,
    stat_quantize,
    topk_decode,
    topk_encode,
    unpack_uints,
)

__all__ = [
    "Codec",
    "QuantizeCodec",
    "StatQuantizeCodec",
    "SignCodec",
    "TopKCodec",
    "ChunkTopKCodec",
    "LowRankCodec",
    "CODECS",
    "decode",
    "is_payload",
]


def _field(default: Any = dataclasses.MISSING, *, doc: str, config: bool = True) -> Any:
    """A codec setting with its one-line meaning (config help reads it); ``config=False``
    marks one the library sets itself."""
    return dataclasses.field(default=default, metadata={"doc": doc, "config": config})


#: Every codec class by its :attr:`Codec.name`.
CODECS: dict[str, type[Codec]] = {}
# What each payload class decodes with (filled by the codec classes).
_DECODERS: dict[type, Callable[[Any], jax.Array]] = {}


def decode(payload: Any) -> jax.Array:
    """Decode any codec's payload (the payload's class names its decoder)."""
    fn = _DECODERS.get(type(payload))
    if fn is None:
        raise TypeError(
            f"payload must be one of {sorted(t.__name__ for t in _DECODERS)}, "
            f"got {type(payload).__name__}"
        )
    return fn(payload)


def is_payload(obj: Any) -> bool:
    """Whether ``obj`` is a payload of one of the codecs (a class :func:`decode` knows)."""
    return type(obj) in _DECODERS


@dataclasses.dataclass(frozen=True)
class Codec:
    """A wire codec. Subclasses set :attr:`name` and :attr:`payload` and define
    :meth:`encode`; :meth:`decode` and :meth:`nbytes` follow from the payload.

    Attributes:
      name: the codec's registry name (:data:`CODECS`).
      payload: the payload class :meth:`encode` returns; its array leaves are the wire bytes.
      unbiased: ``E[decode(encode(x, key))] = x`` over keys.
      keyed: :meth:`encode` draws from its key (else it ignores it).
      flat: the codec takes a flat ``f32[d]`` (one tensor or a pytree fused) and decodes to
        ``f32[d]``; else any shape it accepts, decoded to that shape.
      needs_matrix: the codec factors a matrix (at least 2 axes).
      sparse: a payload names the entries it sends (:meth:`sent_mask`).
    """

    name: ClassVar[str] = ""
    payload: ClassVar[type] = type(None)
    unbiased: ClassVar[bool] = False
    keyed: ClassVar[bool] = False
    flat: ClassVar[bool] = False
    needs_matrix: ClassVar[bool] = False
    sparse: ClassVar[bool] = False

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.name:
            CODECS[cls.name] = cls
            _DECODERS[cls.payload] = cls._decode

    @staticmethod
    def _decode(payload: Any) -> jax.Array:
        raise NotImplementedError

    def encode(self, x: jax.Array, key: jax.Array | None) -> Any:
        """The payload of ``x`` (``key``: PRNG key of a stochastic codec, else unused)."""
        raise NotImplementedError

    def decode(self, payload: Any) -> jax.Array:
        """The array a payload of this codec stands for."""
        if not isinstance(payload, self.payload):
            raise TypeError(
                f"payload must be {self.payload.__name__}, got {type(payload).__name__}"
            )
        return self._decode(payload)

    def nbytes(self, shape: Sequence[int]) -> int:
        """Wire bytes of :meth:`encode` of a float32 array of ``shape``, read from the
        payload's leaves (``jax.eval_shape``: nothing is computed)."""
        struct = jax.ShapeDtypeStruct(tuple(shape), jnp.float32)
        return payload_bytes(jax.eval_shape(self.encode, struct, jax.random.key(0)))

    def sent_mask(self, payload: Any) -> jax.Array:
        """``f32`` of the decoded shape: 1 at the entries a sparse codec's payload sends,
        else 0 (from its positions alone: a sent entry counts whatever it decodes to)."""
        raise TypeError(f"codec {self.label!r} is not sparse: its payloads send every entry")

    def bind(self, sizes: tuple[int, ...]) -> Codec:
        """This codec for a fused vector of tensors of ``sizes`` elements (a codec with
        per-tensor statistics takes them; the others return themselves)."""
        del sizes
        return self

    @property
    def label(self) -> str:
        """Short name for tables, e.g. ``q2/b1024``."""
        return self.name


@dataclasses.dataclass(frozen=True)
class QuantizeCodec(Codec):
    """Uniform quantization to ``bits`` bits with one scale per ``bucket_size`` elements
    (``None``: the array's last axis) (:func:`jaxcomm.codecs.quantize`). Stochastic
    rounding (unbiased) or nearest (``stochastic=False``, for error feedback)."""

    bits: int = _field(doc="bits of each code, 1..8")
    bucket_size: int | None = _field(None, doc="elements per scale (unset: the last axis)")
    stochastic: bool = _field(True, doc="stochastic rounding (unbiased), else nearest")
    symmetric: bool = _field(True, doc="a max-abs grid, else a min-max grid")

    name: ClassVar[str] = "quantize"
    payload: ClassVar[type] = Quantized

    def __post_init__(self):
        check_int("bits", self.bits, lo=1, hi=8)
        if self.bucket_size is not None:
            check_int("bucket_size", self.bucket_size, lo=1)

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.stochastic

    @property
    def keyed(self) -> bool:  # type: ignore[override]
        return self.stochastic

    def encode(self, x: jax.Array, key: jax.Array | None) -> Quantized:
        x = jnp.asarray(x)
        bucket = x.shape[-1] if self.bucket_size is None else self.bucket_size
        return quantize(
            x,
            key if self.stochastic else None,
            bits=self.bits,
            bucket_size=bucket,
            stochastic=self.stochastic,
            symmetric=self.symmetric,
        )

    _decode = staticmethod(dequantize)

    @property
    def label(self) -> str:
        return f"q{self.bits}" + (f"/b{self.bucket_size}" if self.bucket_size else "")


@dataclasses.dataclass(frozen=True)
class StatQuantizeCodec(Codec):
    """Statistical quantization (MuLoCo's): ``bits`` bits per entry over bins spanning
    ``sigmas`` standard deviations, each code decoded to the mean of what it stands for,
    per tensor of :meth:`bind`'s sizes (:func:`jaxcomm.codecs.stat_quantize`). Flat."""

    bits: int = _field(2, doc="bits of each code, 1..8")
    sigmas: float = _field(6.0, doc="the bins span this many standard deviations")
    sizes: tuple[int, ...] | None = _field(None, doc="tensor sizes (set by bind)", config=False)

    name: ClassVar[str] = "stat_quantize"
    payload: ClassVar[type] = StatQuantized
    flat: ClassVar[bool] = True

    def __post_init__(self):
        check_int("bits", self.bits, lo=1, hi=8)
        check_float("sigmas", self.sigmas, lo=0.0, lo_open=True)

    def bind(self, sizes: tuple[int, ...]) -> StatQuantizeCodec:
        return dataclasses.replace(self, sizes=tuple(sizes))

    def encode(self, x: jax.Array, key: jax.Array | None) -> StatQuantized:
        del key
        return stat_quantize(jnp.ravel(x), bits=self.bits, sigmas=self.sigmas, sizes=self.sizes)

    _decode = staticmethod(stat_dequantize)

    @property
    def label(self) -> str:
        return f"stat{self.bits}"


@dataclasses.dataclass(frozen=True)
class SignCodec(Codec):
    """One bit per element, the sign, with an optional ``mean(|x|)`` scale
    (:func:`jaxcomm.codecs.sign_encode`)."""

    scale: bool = _field(False, doc="also send mean(|x|) as the magnitude")

    name: ClassVar[str] = "sign"
    payload: ClassVar[type] = SignCode

    def encode(self, x: jax.Array, key: jax.Array | None) -> SignCode:
        del key
        return sign_encode(x, scale=self.scale)

    _decode = staticmethod(sign_decode)

    @property
    def label(self) -> str:
        return "sign" + ("/scaled" if self.scale else "")


@dataclasses.dataclass(frozen=True)
class TopKCodec(Codec):
    """The ``k`` (or ``ratio`` of the) largest-magnitude entries with ``int32`` positions
    (:func:`jaxcomm.codecs.topk_encode`)."""

    k: int | None = _field(None, doc="entries sent (or set ratio)")
    ratio: float | None = _field(None, doc="share of entries sent (or set k)")
    method: str = _field("auto", doc="selection: auto, exact, approx, threshold or sample")

    name: ClassVar[str] = "topk"
    payload: ClassVar[type] = TopK
    sparse: ClassVar[bool] = True

    def __post_init__(self):
        if (self.k is None) == (self.ratio is None):
            raise ValueError(
                f"TopKCodec takes exactly one of k and ratio, got k={self.k!r}, "
                f"ratio={self.ratio!r}"
            )

    def encode(self, x: jax.Array, key: jax.Array | None) -> TopK:
        del key
        return topk_encode(x, k=self.k, ratio=self.ratio, method=self.method)

    _decode = staticmethod(topk_decode)

    def sent_mask(self, payload: TopK) -> jax.Array:
        mask = jnp.zeros((math.prod(payload.shape),), jnp.float32).at[payload.indices].set(1.0)
        return mask.reshape(payload.shape)

    @property
    def label(self) -> str:
        return f"top{self.k}" if self.k is not None else f"top{self.ratio:g}"


@dataclasses.dataclass(frozen=True)
class ChunkTopKCodec(Codec):
    """In every ``chunk`` consecutive entries the ``k`` largest in magnitude, positions
    packed, values on ``bits`` bits (``None``: float32)
    (:func:`jaxcomm.codecs.chunk_topk_encode`)."""

    chunk: int = _field(doc="entries per chunk, >= 2")
    k: int = _field(doc="entries sent per chunk, at most chunk")
    bits: int | None = _field(None, doc="value bits, 1..8 (unset: float32)")

    name: ClassVar[str] = "chunk_topk"
    payload: ClassVar[type] = ChunkTopK
    sparse: ClassVar[bool] = True

    def __post_init__(self):
        check_int("chunk", self.chunk, lo=2)
        check_int("k", self.k, lo=1, hi=self.chunk)
        if self.bits is not None:
            check_int("bits", self.bits, lo=1, hi=8)

    def encode(self, x: jax.Array, key: jax.Array | None) -> ChunkTopK:
        del key
        return chunk_topk_encode(x, chunk=self.chunk, k=self.k, bits=self.bits)

    @staticmethod
    def _decode(payload: ChunkTopK) -> jax.Array:
        return chunk_topk_decode(payload).astype(jnp.float32)

    def sent_mask(self, payload: ChunkTopK) -> jax.Array:
        d = math.prod(payload.shape)
        chunks = -(-d // payload.chunk)
        idx = unpack_uints(payload.indices, payload.index_bits, chunks * payload.k)
        rows = jnp.zeros((chunks, payload.chunk), jnp.float32)
        rows = jax.vmap(lambda r, i: r.at[i].set(1.0, unique_indices=True))(
            rows, idx.astype(jnp.int32).reshape(chunks, payload.k)
        )
        return rows.reshape(-1)[:d].reshape(payload.shape)

    @property
    def label(self) -> str:
        return f"top{self.k}of{self.chunk}" + (f"/q{self.bits}" if self.bits else "")


@dataclasses.dataclass(frozen=True)
class LowRankCodec(Codec):
    """A rank-``rank`` factorisation of ``x`` seen as a matrix ``[prod(shape[:-1]),
    shape[-1]]`` with ``bits``-bit factors (:func:`jaxcomm.codecs.lowrank_encode`; the key
    draws the range finder's test matrix)."""

    rank: int = _field(doc="rank of the factorisation")
    bits: int = _field(8, doc="bits of the factors' codes, 1..8")

    name: ClassVar[str] = "lowrank"
    payload: ClassVar[type] = LowRank
    keyed: ClassVar[bool] = True
    needs_matrix: ClassVar[bool] = True

    def __post_init__(self):
        check_int("rank", self.rank, lo=1)
        check_int("bits", self.bits, lo=1, hi=8)

    def encode(self, x: jax.Array, key: jax.Array | None) -> LowRank:
        if key is None:
            raise ValueError("LowRankCodec draws its test matrix from key: pass a PRNG key")
        return lowrank_encode(x, key, rank=self.rank, bits=self.bits)

    @staticmethod
    def _decode(payload: LowRank) -> jax.Array:
        return lowrank_decode(payload).astype(jnp.float32)

    @property
    def label(self) -> str:
        return f"rank{self.rank}/q{self.bits}"
