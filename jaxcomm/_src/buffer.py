"""Off-device per-sample message buffer for AQ-SGD, stored in tensorstore (zarr).

AQ-SGD ("Fine-tuning Language Models over Slow Networks using Activation Quantization with
Guarantees", Wang et al., NeurIPS 2022) keeps, at every pipeline-stage boundary and on BOTH
sides of it, the last message ``m[xi]`` the receiver reconstructed for each training sample
``xi`` (e.g. ``f32[seq, hidden]``). Over a whole dataset that is ``num_samples * seq * hidden``
values per boundary, far too large for accelerator memory, so :class:`MessageBuffer` keeps it
off-device in a tensorstore array and is accessed by sample id: read the rows of the next
microbatch before its step (:meth:`MessageBuffer.read_async`, so the I/O hides behind the
current step's compute), write the updated rows after it (:meth:`MessageBuffer.write_async`).

Storage layout (the same in memory, in a live directory and in a snapshot)::

    <root>/buffer.json   metadata: num_samples, shape, dtype, storage_bits, bucket_size, ...
    <root>/values/       zarr v2, dtype[num_samples, *shape]      (storage_bits=None)
    <root>/codes/        zarr v2, uint8[num_samples, code_bytes]  (storage_bits=1..8)
    <root>/scale/        zarr v2, float32[num_samples, nbuckets]  bucket maxima
    <root>/offset/       zarr v2, float32[num_samples, nbuckets]  bucket minima
    <root>/seen/         zarr v2, bool[num_samples]               set by ``write``

Every data array is chunked along the sample axis only (``samples_per_chunk`` samples per
chunk, one by default, uncompressed), so a batch read or write touches only the chunks of its
own samples, and a one-sample-per-chunk write replaces whole chunks without reading them.
Chunks never written are not stored and read as the fill value 0 (unseen samples read as
zeros). ``path=None`` keeps the arrays on tensorstore's ``memory`` kvstore (private to the
buffer); a ``path`` keeps them on the ``file`` kvstore under that directory.

Low-precision storage (paper appendix H.5): with ``storage_bits=b`` each sample is stored as
:func:`jaxcomm.codecs.quantize` of the flattened sample with nearest rounding on a min/max grid
(``stochastic=False, symmetric=False``), i.e. ``ceil(n*b/8)`` code bytes plus a float32 max
and min per bucket of ``bucket_size`` elements, and decoded with
:func:`jaxcomm.codecs.dequantize` on read. The error per element is at most half a grid step
of its bucket, ``(max - min) / (2 * (2**b - 1))``. The paper finds 8 bits lossless in
practice and 4 bits slightly worse.

Durability: the live store is a working copy, not a checkpoint. Writes are asynchronous and
are not atomic across arrays (values first, ``seen`` flags after the values are committed),
and a file-backed store is written without fsync. Checkpoint it with :meth:`MessageBuffer.save`,
which flushes pending writes and copies everything to a fresh directory that is then renamed
into place (so a snapshot directory is either absent or complete), and load it back with
:meth:`MessageBuffer.restore`. Later writes never touch a saved snapshot.

Threading: one buffer is meant to be driven by one thread (the training loop). Writes are
committed in issue order by a private worker thread; a read of ids that a pending write is
updating waits for that write first, so reads always see the latest write of each sample.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from jaxcomm._src._checks import check_choice, check_int
from jaxcomm._src.codecs import Quantized, dequantize, quantize, quantized_nbytes

__all__ = ["MessageBuffer", "BufferRead"]

_FORMAT = "jaxcomm.pipeline.MessageBuffer"
_VERSION = 1
_META = "buffer.json"
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_ZARR_DTYPE = {
    "float16": "<f2",
    "bfloat16": "bfloat16",
    "float32": "<f4",
    "float64": "<f8",
    "uint8": "|u1",
    "bool": "|b1",
}
_SEEN_CHUNK = 4096  # samples per chunk of the 1-byte ``seen`` flags


# --------------------------------------------------------------------------- helpers


def _cpu() -> jax.Device | None:
    """This process's host CPU device (encoding/decoding of host arrays runs there), if JAX
    has one (the first of ``jax.devices("cpu")`` belongs to process 0 in a multi-process
    run)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


@functools.cache
def _encoder(bits: int, bucket_size: int) -> Callable[[jax.Array], Quantized]:
    """Jitted ``f[B, *shape] -> Quantized`` (codes ``u8[B, nbytes]``, scales ``f32[B, nb]``)."""

    def one(x: jax.Array) -> Quantized:
        return quantize(
            x, None, bits=bits, bucket_size=bucket_size, stochastic=False, symmetric=False
        )

    return jax.jit(jax.vmap(one))


_decoder = jax.jit(jax.vmap(dequantize))


def _fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename into it) to disk; a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_meta(root: Path, meta: dict[str, Any]) -> None:
    """Write ``root/buffer.json`` atomically (temp file, fsync, rename)."""
    tmp = root / f".{_META}.tmp"
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / _META)
    _fsync_dir(root)


def _read_meta(root: Path) -> dict[str, Any]:
    """Parse ``root/buffer.json``; ValueError when it is missing or not a buffer's."""
    meta_path = root / _META
    if not meta_path.is_file():
        raise ValueError(f"{root} holds no MessageBuffer: {meta_path} does not exist")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != _FORMAT:
        raise ValueError(
            f"{meta_path} is not a MessageBuffer's metadata (format={meta.get('format')!r})"
        )
    if meta.get("version") != _VERSION:
        raise ValueError(f"{meta_path} has version {meta.get('version')!r}, expected {_VERSION}")
    return meta


def _describe(meta: dict[str, Any]) -> str:
    s = (
        f"num_samples={meta['num_samples']}, shape={tuple(meta['shape'])}, "
        f"dtype={meta['dtype']}, storage_bits={meta['storage_bits']}"
    )
    if meta["storage_bits"] is not None:
        s += f", bucket_size={meta['bucket_size']}"
    return s


# --------------------------------------------------------------------------- read handle


class BufferRead:
    """Handle of an in-flight :meth:`MessageBuffer.read_async`.

    The tensorstore reads are issued before the handle is made. With ``storage_bits`` the
    decode also runs in the background (on the buffer's decode thread, once the reads land),
    so :meth:`result` only waits.
    """

    def __init__(self, values_future: Any, seen_future: Any) -> None:
        self._values_future = values_future
        self._seen_future = seen_future

    def done(self) -> bool:
        """True when the values (decoded) and the seen flags are ready: ``result`` won't block."""
        return self._values_future.done() and self._seen_future.done()

    def result(self, timeout: float | None = None) -> np.ndarray:
        """The values, ``dtype[len(ids), *shape]`` in the order of ``ids`` (unseen rows are 0)."""
        return self._values_future.result(timeout=timeout)

    def seen(self, timeout: float | None = None) -> np.ndarray:
        """``bool[len(ids)]`` seen flags of the same ids, read concurrently with the values."""
        return np.asarray(self._seen_future.result(timeout=timeout), dtype=bool)


def _done_future(value: Any = None) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    f.set_result(value)
    return f


# --------------------------------------------------------------------------- buffer


class MessageBuffer:
    """Per-sample previous messages in tensorstore, keyed by integer sample id.

    Holds ``num_samples`` rows of ``dtype[*shape]`` (e.g. ``f32[seq, hidden]``), each with a
    ``seen`` flag. Rows never written read as zeros with ``seen == False``.

    Args:
      num_samples: number of samples (valid ids are ``0 .. num_samples - 1``), >= 1.
      shape: shape of one sample's message, every dim >= 1 (``()`` for a scalar).
      dtype: value dtype returned by :meth:`read`: float16, bfloat16, float32 or float64.
        With ``storage_bits=None`` values are stored exactly in this dtype (written values are
        cast to it first).
      path: ``None`` for an in-memory buffer; otherwise a directory for a zarr store on disk.
        An absent or empty directory is created; a directory holding a buffer is opened, and
        must hold the same ``num_samples``, ``shape``, ``dtype``, ``storage_bits`` (and
        ``bucket_size`` when quantized), else ``ValueError``. The stored chunking wins over
        ``samples_per_chunk`` when opening.
      storage_bits: ``None`` (exact) or 1..8: store each sample quantized to that many bits
        with nearest rounding on a per-bucket min/max grid.
      bucket_size: elements per (max, min) float32 pair when quantized, >= 1.
      samples_per_chunk: samples per zarr chunk along the sample axis, >= 1. One sample per
        chunk makes every write a blind overwrite of whole chunks; more per chunk means fewer
        files (a big dataset on disk) at the cost of read-modify-write of partial chunks.

    Attributes:
      num_samples, shape, dtype (``np.dtype``), storage_bits, bucket_size, samples_per_chunk,
      path (``Path`` or ``None``), bytes_per_sample, nbytes.
    """

    def __init__(
        self,
        num_samples: int,
        shape: Sequence[int],
        *,
        dtype: Any = "float32",
        path: str | os.PathLike | None = None,
        storage_bits: int | None = None,
        bucket_size: int = 256,
        samples_per_chunk: int = 1,
    ) -> None:
        num_samples = check_int("num_samples", num_samples, lo=1)
        if isinstance(shape, int | np.integer) or not isinstance(shape, Sequence | np.ndarray):
            raise TypeError(f"shape must be a tuple of ints, got {shape!r}")
        shape = tuple(check_int(f"shape[{i}]", d, lo=1) for i, d in enumerate(shape))
        try:
            dtype_name = jnp.dtype(dtype).name
        except TypeError:
            dtype_name = str(dtype)
        check_choice("dtype", dtype_name, _FLOAT_DTYPES)
        if storage_bits is not None:
            storage_bits = check_int("storage_bits", storage_bits, lo=1, hi=8)
        bucket_size = check_int("bucket_size", bucket_size, lo=1)
        samples_per_chunk = check_int("samples_per_chunk", samples_per_chunk, lo=1)

        meta: dict[str, Any] = {
            "format": _FORMAT,
            "version": _VERSION,
            "num_samples": num_samples,
            "shape": list(shape),
            "dtype": dtype_name,
            "storage_bits": storage_bits,
            "bucket_size": bucket_size,
            "samples_per_chunk": samples_per_chunk,
        }
        self.path: Path | None = None if path is None else Path(path).absolute()
        # A private context: its own memory kvstore (buffers never share keys), no cache
        # (the data is streamed, not reused), and no fsync on the live store (see module doc).
        self._context = ts.Context({"file_io_sync": False})
        if self.path is None:
            self._arrays = self._open_arrays(meta, create=True)
        elif (self.path / _META).exists():
            held = _read_meta(self.path)
            keys = ["num_samples", "shape", "dtype", "storage_bits"]
            if storage_bits is not None:
                keys.append("bucket_size")
            if any(held[k] != meta[k] for k in keys):
                diff = ", ".join(k for k in keys if held[k] != meta[k])
                raise ValueError(
                    f"{self.path} holds a MessageBuffer with {_describe(held)}, but "
                    f"{_describe(meta)} was asked (mismatch in {diff})"
                )
            meta["bucket_size"] = held["bucket_size"]
            meta["samples_per_chunk"] = held["samples_per_chunk"]
            self._arrays = self._open_arrays(meta, create=False)
        else:
            if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
                raise ValueError(
                    f"{self.path} exists and is not an empty directory, but holds no "
                    f"MessageBuffer ({_META} is missing); asked for {_describe(meta)}"
                )
            self.path.mkdir(parents=True, exist_ok=True)
            self._arrays = self._open_arrays(meta, create=True)
            _write_meta(self.path, meta)  # last: its presence means the arrays exist

        self._meta = meta
        self.num_samples: int = num_samples
        self.shape: tuple[int, ...] = shape
        self.dtype: np.dtype = jnp.dtype(dtype_name)
        self.storage_bits: int | None = storage_bits
        self.bucket_size: int = meta["bucket_size"]
        self.samples_per_chunk: int = meta["samples_per_chunk"]
        self._n = math.prod(shape)
        self._lock = threading.RLock()
        self._pending: list[tuple[np.ndarray, concurrent.futures.Future]] = []
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="MessageBuffer-commit"
        )
        self._decode_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="MessageBuffer-decode"
        )
        self._closed = False

    # ------------------------------------------------------------------ layout

    @staticmethod
    def _layout(meta: dict[str, Any]) -> dict[str, tuple[list[int], list[int], str]]:
        """Array name -> (shape, chunk shape, dtype name) for a buffer's metadata."""
        n_s = meta["num_samples"]
        c = min(meta["samples_per_chunk"], n_s)
        shape = list(meta["shape"])
        bits = meta["storage_bits"]
        out: dict[str, tuple[list[int], list[int], str]] = {}
        if bits is None:
            out["values"] = ([n_s, *shape], [c, *shape], meta["dtype"])
        else:
            n = math.prod(shape)
            code_bytes = -(-n * bits // 8)
            nb = -(-n // meta["bucket_size"])
            out["codes"] = ([n_s, code_bytes], [c, code_bytes], "uint8")
            out["scale"] = ([n_s, nb], [c, nb], "float32")
            out["offset"] = ([n_s, nb], [c, nb], "float32")
        out["seen"] = ([n_s], [min(_SEEN_CHUNK, n_s)], "bool")
        return out

    @staticmethod
    def _spec(kvstore: dict[str, Any], shape: list[int], chunks: list[int], dtype: str) -> dict:
        """The tensorstore spec of one array: zarr v2, uncompressed, C order, fill 0."""
        return {
            "driver": "zarr",
            "kvstore": kvstore,
            "metadata": {
                "shape": shape,
                "chunks": chunks,
                "dtype": _ZARR_DTYPE[dtype],
                "compressor": None,
                "fill_value": False if dtype == "bool" else 0,
                "order": "C",
            },
        }

    def _kvstore(self, root: Path | None, name: str) -> dict[str, Any]:
        if root is None:
            return {"driver": "memory", "path": f"{name}/"}
        return {"driver": "file", "path": str(root / name) + "/"}

    def _open_arrays(self, meta: dict[str, Any], *, create: bool) -> dict[str, ts.TensorStore]:
        futures = {
            name: ts.open(
                self._spec(self._kvstore(self.path, name), shape, chunks, dtype),
                create=create,
                open=not create,
                context=self._context,
            )
            for name, (shape, chunks, dtype) in self._layout(meta).items()
        }
        return {name: f.result() for name, f in futures.items()}

    # ------------------------------------------------------------------ sizes

    @property
    def bytes_per_sample(self) -> int:
        """Stored bytes of one sample's values (the 1-byte ``seen`` flag not included).

        ``n * itemsize`` with ``storage_bits=None``; otherwise
        ``ceil(n * b / 8) + 8 * ceil(n / bucket_size)`` (codes plus a float32 max and min per
        bucket), with ``n = prod(shape)`` and ``b = storage_bits``.
        """
        if self.storage_bits is None:
            return self._n * self.dtype.itemsize
        return quantized_nbytes(
            self._n, bits=self.storage_bits, bucket_size=self.bucket_size, symmetric=False
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the full buffer: ``num_samples * (bytes_per_sample + 1)``.

        The ``+ 1`` is the ``seen`` flag. Chunks never written are not stored, so an
        in-memory or on-disk buffer uses less until every sample has been seen (plus a few
        bytes of zarr metadata).
        """
        return self.num_samples * (self.bytes_per_sample + 1)

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        where = "memory" if self.path is None else repr(str(self.path))
        return (
            f"MessageBuffer(num_samples={self.num_samples}, shape={self.shape}, "
            f"dtype={self.dtype.name}, storage_bits={self.storage_bits}, "
            f"bucket_size={self.bucket_size}, path={where}, "
            f"bytes_per_sample={self.bytes_per_sample}, nbytes={self.nbytes})"
        )

    # ------------------------------------------------------------------ validation

    def _check_ids(self, ids: Any) -> np.ndarray:
        """``int64[k]`` ids after checking they are 1-D, integer, in range and unique."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"ids must be a 1-D array of sample ids, got shape {arr.shape}")
        if arr.size == 0:
            return np.zeros((0,), np.int64)
        if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"ids must be integers, got dtype {arr.dtype}")
        bad = np.flatnonzero((arr < 0) | (arr >= self.num_samples))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"ids must be in [0, {self.num_samples}) (num_samples={self.num_samples}), "
                f"got id {int(arr[i])} at position {i}"
            )
        arr = arr.astype(np.int64)
        srt = np.sort(arr)
        dup = srt[1:][srt[1:] == srt[:-1]]
        if dup.size:
            raise ValueError(
                f"ids must be unique within a call, got id {int(dup[0])} more than once "
                f"(allowed range [0, {self.num_samples}))"
            )
        return arr

    def _check_values(self, ids: np.ndarray, values: Any) -> Any:
        """Cast ``values`` to the storage dtype; check shape ``[len(ids), *shape]`` and finiteness.

        A ``jax.Array`` stays on its device when quantized (it is encoded there and only the
        codes cross to the host); everything else becomes a fresh numpy array.
        """
        expected = (len(ids), *self.shape)
        on_device = isinstance(values, jax.Array) and self.storage_bits is not None
        x = values if on_device else np.asarray(values)
        if tuple(x.shape) != expected:
            raise ValueError(
                f"values must have shape [len(ids), *shape] = {list(expected)}, got {list(x.shape)}"
            )
        if on_device:
            # float64 buffers are encoded from float32 (the grid is float32 anyway).
            x = x.astype(jnp.float32 if self.dtype == np.float64 else self.dtype)
            finite = np.asarray(jnp.isfinite(x).reshape(len(ids), -1).all(axis=1))
        else:
            if x.dtype.kind in "bcmMOSU":
                raise TypeError(f"values must be real numbers, got dtype {x.dtype}")
            with np.errstate(over="ignore"):
                x = np.array(x, dtype=self.dtype, order="C", copy=True)
            finite = np.isfinite(x.astype(np.float32)).reshape(len(ids), -1).all(axis=1)
        if not finite.all():
            rows = np.flatnonzero(~finite)
            raise ValueError(
                f"values hold non-finite entries (NaN or Inf, after casting to "
                f"{self.dtype.name}) in {rows.size} sample(s), first at sample id "
                f"{int(ids[rows[0]])} (row {int(rows[0])}); the buffer never stores them"
            )
        return x

    # ------------------------------------------------------------------ pending writes

    def _prune(self) -> None:
        self._pending = [(i, f) for i, f in self._pending if not f.done()]

    def _wait_overlapping(self, ids: np.ndarray) -> None:
        """Wait for pending writes that touch any of ``ids`` (so reads see the latest write)."""
        with self._lock:
            self._prune()
            waits = [f for i, f in self._pending if np.isin(i, ids, assume_unique=True).any()]
        for f in waits:
            f.result()

    def flush(self) -> None:
        """Block until every write issued so far is committed; re-raise a failed write's error."""
        with self._lock:
            pending, self._pending = self._pending, []
        for _, f in pending:
            f.result()

    def close(self) -> None:
        """Flush pending writes and stop the worker threads (``read`` and ``seen`` still work)."""
        if not self._closed:
            try:
                self.flush()
            finally:
                self._executor.shutdown(wait=True)
                self._decode_pool.shutdown(wait=True)
                self._closed = True

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (writes are refused; reads still work)."""
        return self._closed

    def __enter__(self) -> MessageBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ reads

    def read_async(self, ids: Any) -> BufferRead:
        """Issue the reads of ``ids`` and return at once; ``.result()`` gives the values.

        Args:
          ids: ``int[k]`` unique sample ids in ``[0, num_samples)``.

        Returns:
          A :class:`BufferRead`; ``.result()`` is ``dtype[k, *shape]`` (unseen rows are 0),
          ``.seen()`` the ``bool[k]`` flags. Waits first (only) for pending writes of these ids.
        """
        ids = self._check_ids(ids)
        self._wait_overlapping(ids)
        k = len(ids)
        if k == 0:
            empty = np.zeros((0, *self.shape), self.dtype)
            return BufferRead(_done_future(empty), _done_future(np.zeros((0,), bool)))
        with self._lock:
            futures = {
                name: arr.oindex[ids].read() for name, arr in self._arrays.items() if name != "seen"
            }
            seen_future = self._arrays["seen"].oindex[ids].read()
        if self.storage_bits is None:
            return BufferRead(futures["values"], seen_future)
        if self._closed:  # no decode thread any more: decode now
            decoded = _done_future(self._decode({k: f.result() for k, f in futures.items()}))
            return BufferRead(decoded, seen_future)
        decoded = self._decode_pool.submit(
            lambda: self._decode({k: f.result() for k, f in futures.items()})
        )
        return BufferRead(decoded, seen_future)

    def _decode(self, raw: dict[str, np.ndarray]) -> np.ndarray:
        """``codes u8[k, nbytes]``, ``scale/offset f32[k, nb]`` -> ``dtype[k, *shape]``."""
        k = raw["codes"].shape[0]
        q = Quantized(
            raw["codes"],
            raw["scale"],
            raw["offset"],
            self.shape,
            "float32",
            self.storage_bits,
            self.bucket_size,
        )
        with jax.default_device(_cpu()):
            out = _decoder(q)
        return np.asarray(out).reshape(k, *self.shape).astype(self.dtype)

    def read(self, ids: Any) -> np.ndarray:
        """Values of ``ids``: ``dtype[len(ids), *shape]``, zeros for unseen samples."""
        return self.read_async(ids).result()

    def seen(self, ids: Any) -> np.ndarray:
        """``bool[len(ids)]``: whether each sample has been written."""
        ids = self._check_ids(ids)
        if len(ids) == 0:
            return np.zeros((0,), bool)
        self._wait_overlapping(ids)
        return np.asarray(self._arrays["seen"].oindex[ids].read().result(), dtype=bool)

    # ------------------------------------------------------------------ writes

    def _encode(self, values: Any) -> dict[str, np.ndarray]:
        if self.storage_bits is None:
            return {"values": values}
        enc = _encoder(self.storage_bits, self.bucket_size)
        x = values
        if isinstance(x, np.ndarray):
            if x.dtype == np.float64:
                x = x.astype(np.float32)  # the grid is computed in float32 anyway
            with jax.default_device(_cpu()):
                q = enc(x)
        else:
            q = enc(x.astype(jnp.float32) if x.dtype == jnp.float64 else x)
        return {
            "codes": np.array(q.codes, np.uint8),
            "scale": np.array(q.scale, np.float32),
            "offset": np.array(q.offset, np.float32),
        }

    def write_async(self, ids: Any, values: Any) -> concurrent.futures.Future:
        """Store ``values`` for ``ids`` and set their ``seen`` flags, without waiting.

        Validation and (``storage_bits``) encoding run now, on the calling thread, and raise
        there; ``values`` is copied, so the caller may reuse it at once. The tensorstore writes
        go to one worker thread that issues them in order, waits for them to commit, then
        writes the ``seen`` flags. Reads of these ids issued later wait for this write.

        Args:
          ids: ``int[k]`` unique sample ids in ``[0, num_samples)``.
          values: ``float[k, *shape]``, finite after casting to ``dtype``.

        Returns:
          A ``concurrent.futures.Future`` whose ``.result()`` (``None``) returns once values and
          flags are committed, or raises the write's error. Call it (or :meth:`flush`) before
          relying on the data outside this object; :meth:`save` flushes by itself.
        """
        if self._closed:
            raise RuntimeError("write to a closed MessageBuffer")
        ids = self._check_ids(ids)
        values = self._check_values(ids, values)
        if len(ids) == 0:
            return _done_future()
        data = self._encode(values)
        with self._lock:
            future = self._executor.submit(self._commit, ids, data)
            self._prune()
            self._pending.append((ids, future))
        return future

    def _commit(self, ids: np.ndarray, data: dict[str, np.ndarray]) -> None:
        """Worker: write the data, wait for it to commit, then set ``seen`` (flags never
        precede data). One worker thread runs the writes in the order they were issued:
        tensorstore does not order concurrent non-transactional writes to one region, so two
        writes of the same ids in flight at once could otherwise land in either order."""
        self._write_data(ids, data)
        self._write_seen(ids)

    def _write_data(self, ids: np.ndarray, data: dict[str, np.ndarray]) -> None:
        writes = [
            self._arrays[name].oindex[ids].write(arr, can_reference_source_data_indefinitely=True)
            for name, arr in data.items()
        ]
        for w in writes:
            w.commit.result()

    def _write_seen(self, ids: np.ndarray) -> None:
        self._arrays["seen"].oindex[ids].write(True).result()

    def write(self, ids: Any, values: Any) -> None:
        """Blocking :meth:`write_async`: returns when values and ``seen`` flags are committed."""
        self.write_async(ids, values).result()

    # ------------------------------------------------------------------ snapshots

    def save(self, directory: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write a consistent snapshot of the whole buffer to ``directory``, atomically.

        Pending writes are flushed first and new writes wait until the copy is done, so the
        snapshot is the state after every write issued before the call. The arrays and
        ``buffer.json`` are written (with fsync) to a temporary directory next to
        ``directory`` that is renamed to ``directory`` only when complete: a crash leaves
        either no ``directory`` (and a stale ``.<name>.tmp-*``) or a complete snapshot.

        Args:
          directory: where the snapshot goes (the same layout as an on-disk buffer, so
            ``MessageBuffer(..., path=directory)`` can also open it).
          overwrite: replace an existing ``directory``. The old snapshot is renamed aside,
            the new one renamed in, then the old one deleted; a crash between the two
            renames leaves the old one at ``.<name>.old-*`` and the new one at
            ``.<name>.tmp-*``, both complete. Without it an existing ``directory`` raises
            ``FileExistsError``.

        Returns:
          The snapshot's absolute path.
        """
        directory = Path(directory).absolute()
        if self.path is not None and (directory == self.path or self.path in directory.parents):
            raise ValueError(f"cannot save a snapshot inside the live store at {self.path}")
        parent = directory.parent
        parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.flush()
            if directory.exists() and not overwrite:
                raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it")
            tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=parent))
            try:
                ctx = ts.Context()  # file_io_sync on: the snapshot is durable before the rename
                copies = []
                for name, (shape, chunks, dtype) in self._layout(self._meta).items():
                    spec = self._spec(self._kvstore(tmp, name), shape, chunks, dtype)
                    dst = ts.open(spec, create=True, context=ctx).result()
                    copies.append(dst.write(self._arrays[name]))
                for c in copies:
                    c.result()
                _write_meta(tmp, self._meta)
                for sub in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
                    _fsync_dir(sub)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=parent))
            os.rmdir(old)
            os.replace(directory, old)
            os.replace(tmp, directory)
            _fsync_dir(parent)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
            _fsync_dir(parent)
        return directory

    @classmethod
    def restore(
        cls, directory: str | os.PathLike, path: str | os.PathLike | None = None
    ) -> MessageBuffer:
        """Load a snapshot written by :meth:`save` into a new buffer.

        Args:
          directory: the snapshot directory (it is only read).
          path: ``None`` for an in-memory buffer, or a directory for an on-disk one: created
            if absent; an existing buffer there must match the snapshot's num_samples, shape,
            dtype and storage_bits (else ``ValueError``) and is overwritten with it.

        Returns:
          A :class:`MessageBuffer` holding exactly the snapshot's values and ``seen`` flags.
        """
        directory = Path(directory).absolute()
        if not directory.is_dir():
            raise FileNotFoundError(f"no MessageBuffer snapshot at {directory}")
        if path is not None and Path(path).absolute() == directory:
            raise ValueError(f"restore into the snapshot itself ({directory}); give another path")
        meta = _read_meta(directory)
        buf = cls(
            meta["num_samples"],
            tuple(meta["shape"]),
            dtype=meta["dtype"],
            path=path,
            storage_bits=meta["storage_bits"],
            bucket_size=meta["bucket_size"],
            samples_per_chunk=meta["samples_per_chunk"],
        )
        ctx = ts.Context()
        copies = []
        for name, (shape, chunks, dtype) in cls._layout(meta).items():
            src = ts.open(
                buf._spec(buf._kvstore(directory, name), shape, chunks, dtype),
                open=True,
                read=True,
                context=ctx,
            ).result()
            copies.append(buf._arrays[name].write(src))
        for c in copies:
            c.result()
        return buf
