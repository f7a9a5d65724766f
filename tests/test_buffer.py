"""Tests of jaxcomm.pipeline.MessageBuffer: the off-device AQ-SGD per-sample message buffer."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm._src.buffer as buffer_mod
from jaxcomm._src.buffer import MessageBuffer

SHAPE = (4, 24)  # one sample's message, e.g. [seq, hidden]
N = 50


def _values(rng: np.random.Generator, k: int, shape=SHAPE) -> np.ndarray:
    return rng.standard_normal((k, *shape), dtype=np.float32)


def _tree_hash(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root``."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# --------------------------------------------------------------------------- round trips


def test_fp32_roundtrip_random_ids_exact():
    rng = np.random.default_rng(0)
    buf = MessageBuffer(N, SHAPE)
    ids = rng.choice(N, 17, replace=False)
    vals = _values(rng, 17)
    buf.write(ids, vals)
    np.testing.assert_array_equal(buf.read(ids), vals)
    # Another order and a subset read the same rows.
    perm = rng.permutation(17)[:9]
    np.testing.assert_array_equal(buf.read(ids[perm]), vals[perm])
    # Overwrite a few: the latest write wins, the others are untouched.
    new = _values(rng, 3)
    buf.write(ids[:3], new)
    np.testing.assert_array_equal(buf.read(ids), np.concatenate([new, vals[3:]]))
    assert buf.read(ids).dtype == np.float32


def test_unseen_reads_zero_and_seen_flags():
    rng = np.random.default_rng(1)
    for bits in (None, 4):
        buf = MessageBuffer(N, SHAPE, storage_bits=bits, bucket_size=16)
        assert not buf.seen(np.arange(N)).any()
        np.testing.assert_array_equal(buf.read([0, 7, N - 1]), np.zeros((3, *SHAPE)))
        buf.write([7, 3], _values(rng, 2))
        seen = buf.seen(np.arange(N))
        assert seen.dtype == bool
        np.testing.assert_array_equal(np.flatnonzero(seen), [3, 7])
        np.testing.assert_array_equal(buf.read([0, N - 1]), np.zeros((2, *SHAPE)))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_other_dtypes_store_exactly(dtype):
    rng = np.random.default_rng(2)
    buf = MessageBuffer(N, SHAPE, dtype=dtype)
    vals = _values(rng, 5).astype(jnp.dtype(dtype))
    buf.write(np.arange(5), vals)
    out = buf.read(np.arange(5))
    assert out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(out.astype(np.float64), vals.astype(np.float64))
    assert buf.bytes_per_sample == math.prod(SHAPE) * jnp.dtype(dtype).itemsize


@settings(max_examples=25, deadline=None)
@given(
    ids=st.sets(st.integers(0, N - 1), min_size=1, max_size=N).map(sorted),
    seed=st.integers(0, 2**31 - 1),
    shuffle=st.booleans(),
)
def test_any_unique_ids_roundtrip(ids, seed, shuffle):
    rng = np.random.default_rng(seed)
    ids = np.asarray(ids)
    if shuffle:
        ids = rng.permutation(ids)
    buf = MessageBuffer(N, SHAPE)
    vals = _values(rng, len(ids))
    buf.write(ids, vals)
    np.testing.assert_array_equal(buf.read(ids), vals)
    expected_seen = np.isin(np.arange(N), ids)
    np.testing.assert_array_equal(buf.seen(np.arange(N)), expected_seen)
    rest = np.flatnonzero(~expected_seen)
    assert not buf.read(rest).any()


def test_in_memory_buffers_are_independent():
    a, b = MessageBuffer(N, SHAPE), MessageBuffer(N, SHAPE)
    a.write([1], np.ones((1, *SHAPE)))
    assert not b.seen([1])[0]
    assert not b.read([1]).any()


def test_read_after_write_async_sees_latest():
    rng = np.random.default_rng(3)
    buf = MessageBuffer(N, SHAPE, storage_bits=8)
    ids = np.arange(10)
    last = None
    for _ in range(40):  # tensorstore alone would not order these writes
        last = _values(rng, 10)
        buf.write_async(ids, last)  # never waited on: reads of these ids must wait
    ref = MessageBuffer(N, SHAPE, storage_bits=8)
    ref.write(ids, last)
    np.testing.assert_array_equal(buf.read(ids), ref.read(ids))
    assert buf.seen(ids).all()


def test_reads_wait_for_slow_pending_writes_of_their_ids(monkeypatch):
    rng = np.random.default_rng(12)
    buf = MessageBuffer(N, SHAPE)
    commit = buf._commit
    release = threading.Event()

    def slow_commit(ids, data):  # a slow disk: the commit lands when the test says so
        release.wait(120)  # only so that a read which wrongly waits cannot hang the test
        commit(ids, data)

    monkeypatch.setattr(buf, "_commit", slow_commit)
    vals = _values(rng, 3)
    fut = buf.write_async([5, 6, 7], vals)
    # Other ids do not wait for it: the read returns while the commit is still held back.
    assert not buf.seen([1, 2]).any()
    assert not fut.done()
    # These ids do: flags and values are the new ones.
    release.set()
    assert buf.seen([7, 1]).tolist() == [True, False]
    assert fut.done()
    np.testing.assert_array_equal(buf.read([5, 6, 7]), vals)


# --------------------------------------------------------------------------- on disk


@pytest.mark.parametrize("bits", [None, 8])
def test_zarr_on_disk_reopen(tmp_path, bits):
    rng = np.random.default_rng(4)
    path = tmp_path / "live"
    buf = MessageBuffer(N, SHAPE, path=path, storage_bits=bits)
    assert buf.path == path.absolute()
    ids = rng.choice(N, 12, replace=False)
    buf.write(ids, _values(rng, 12))
    before, seen_before = buf.read(np.arange(N)), buf.seen(np.arange(N))
    buf.close()
    del buf
    assert (path / "buffer.json").is_file()
    again = MessageBuffer(N, SHAPE, path=str(path), storage_bits=bits)
    np.testing.assert_array_equal(again.read(np.arange(N)), before)
    np.testing.assert_array_equal(again.seen(np.arange(N)), seen_before)
    # Chunks along the sample axis: one file per written sample, none for unseen ones.
    sub = "values" if bits is None else "codes"
    chunks = [p for p in (path / sub).iterdir() if not p.name.startswith(".")]
    assert len(chunks) == 12


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"num_samples": N + 1}, "num_samples"),
        ({"shape": (4, 25)}, "shape"),
        ({"dtype": "float16"}, "dtype"),
        ({"storage_bits": 8}, "storage_bits"),
    ],
)
def test_reopen_with_different_layout_raises(tmp_path, kwargs, field):
    path = tmp_path / "live"
    MessageBuffer(N, SHAPE, path=path).close()
    args = {"num_samples": N, "shape": SHAPE, "dtype": "float32", "storage_bits": None} | kwargs
    n = args.pop("num_samples")
    shape = args.pop("shape")
    with pytest.raises(ValueError, match=rf"holds a MessageBuffer with .*mismatch in {field}") as e:
        MessageBuffer(n, shape, path=path, **args)
    assert str(path) in str(e.value)
    assert "shape=(4, 24)" in str(e.value)


def test_reopen_quantized_with_other_bucket_size_raises(tmp_path):
    MessageBuffer(N, SHAPE, path=tmp_path / "q", storage_bits=4, bucket_size=16).close()
    with pytest.raises(ValueError, match="mismatch in bucket_size"):
        MessageBuffer(N, SHAPE, path=tmp_path / "q", storage_bits=4, bucket_size=32)


def test_path_with_foreign_files_raises(tmp_path):
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(ValueError, match="holds no MessageBuffer"):
        MessageBuffer(N, SHAPE, path=tmp_path)


# --------------------------------------------------------------------------- low precision


def _bucket_half_steps(vals: np.ndarray, bits: int, bucket: int) -> np.ndarray:
    """Per element: half the grid step ``(max - min) / (2 (2^b - 1))`` of its bucket."""
    k = vals.shape[0]
    flat = vals.reshape(k, -1).astype(np.float64)
    n = flat.shape[1]
    nb = -(-n // bucket)
    half = np.empty_like(flat)
    for j in range(nb):
        sl = slice(j * bucket, min(n, (j + 1) * bucket))
        rng_ = flat[:, sl].max(axis=1) - flat[:, sl].min(axis=1)
        half[:, sl] = (rng_ / (2 * ((1 << bits) - 1)))[:, None]
    return half.reshape(vals.shape)


def test_quantized_storage_error_bounds():
    rng = np.random.default_rng(5)
    bucket = 40  # does not divide n = 96: the last bucket of each sample is short
    ids = rng.choice(N, 20, replace=False)
    # Different scales per sample and per region, so per-bucket ranges differ.
    vals = _values(rng, 20) * rng.uniform(0.01, 10, size=(20, 1, 1)).astype(np.float32)
    vals[:, :2] += 3.0
    errs = {}
    for bits in (4, 8):
        buf = MessageBuffer(N, SHAPE, storage_bits=bits, bucket_size=bucket)
        buf.write(ids, vals)
        out = buf.read(ids)
        assert out.shape == vals.shape and out.dtype == np.float32
        err = np.abs(out.astype(np.float64) - vals)
        half = _bucket_half_steps(vals, bits, bucket)
        assert np.all(err <= half * (1 + 1e-4) + 1e-6 * np.abs(vals).max())
        errs[bits] = err
    assert errs[4].max() > errs[8].max()
    assert errs[4].mean() > 4 * errs[8].mean()


@pytest.mark.parametrize(
    "shape, bits, bucket",
    [((4, 24), 8, 256), ((4, 24), 4, 40), ((3, 7), 3, 5), ((1000,), 1, 256), ((), 5, 1)],
)
def test_bytes_per_sample_formula(shape, bits, bucket):
    n = math.prod(shape)
    q = MessageBuffer(7, shape, storage_bits=bits, bucket_size=bucket)
    expected = math.ceil(n * bits / 8) + 8 * math.ceil(n / bucket)
    assert q.bytes_per_sample == expected
    assert q.nbytes == 7 * (expected + 1)
    # The stored arrays have exactly these widths.
    rows = [
        q._arrays[a].shape[1] * q._arrays[a].dtype.numpy_dtype.itemsize
        for a in ("codes", "scale", "offset")
    ]
    assert sum(rows) == expected
    full = MessageBuffer(7, shape)
    assert full.bytes_per_sample == 4 * n
    assert full.nbytes == 7 * (4 * n + 1)


def test_quantized_encode_of_jax_array_matches_numpy():
    rng = np.random.default_rng(6)
    vals = _values(rng, 6)
    a = MessageBuffer(N, SHAPE, storage_bits=4, bucket_size=16)
    b = MessageBuffer(N, SHAPE, storage_bits=4, bucket_size=16)
    a.write(np.arange(6), vals)
    b.write(np.arange(6), jnp.asarray(vals))
    np.testing.assert_array_equal(a.read(np.arange(6)), b.read(np.arange(6)))


# --------------------------------------------------------------------------- async


@pytest.mark.parametrize("bits", [None, 8])
def test_read_async_equals_read(bits):
    rng = np.random.default_rng(7)
    buf = MessageBuffer(N, SHAPE, storage_bits=bits)
    buf.write_async(np.arange(0, N, 2), _values(rng, N // 2)).result()
    ids = rng.permutation(N)[:20]
    h = buf.read_async(ids)
    np.testing.assert_array_equal(h.result(), buf.read(ids))
    np.testing.assert_array_equal(h.seen(), ids % 2 == 0)
    assert h.done()
    empty = buf.read_async(np.zeros((0,), np.int64))
    assert empty.result().shape == (0, *SHAPE) and empty.seen().shape == (0,)


def test_write_async_copies_values():
    buf = MessageBuffer(N, SHAPE)
    vals = np.ones((2, *SHAPE), np.float32)
    fut = buf.write_async([0, 1], vals)
    vals[:] = 5.0  # the caller may reuse its array at once
    fut.result()
    np.testing.assert_array_equal(buf.read([0, 1]), np.ones((2, *SHAPE)))


@jax.jit
def _work(a):
    for _ in range(4):
        a = jnp.tanh(a @ a)
    return a


def test_async_reads_progress_during_compute_and_during_a_wait():
    """Reads run on tensorstore's threads while the caller computes or waits: a
    ``read_async`` completes while the caller only runs jitted matmuls, or only sleeps (as
    a host waiting on accelerator compute does), and never calls ``result``. Nothing is
    timed: the deadlines only stop a read that makes no progress from hanging the test."""
    rng = np.random.default_rng(8)
    shape, n, k = (128, 256), 512, 384  # 128 KiB per sample, 48 MiB per read
    buf = MessageBuffer(n, shape)
    for s in range(0, n, 128):
        buf.write(np.arange(s, s + 128), rng.standard_normal((128, *shape), dtype=np.float32))
    batches = [rng.choice(n, k, replace=False) for _ in range(2)]
    a = jnp.full((256, 256), 0.01)
    _work(a).block_until_ready()

    h = buf.read_async(batches[0])
    deadline = time.perf_counter() + 60.0
    while not h.done() and time.perf_counter() < deadline:
        _work(a).block_until_ready()
    assert h.done(), "read_async made no progress while the caller computed"
    np.testing.assert_array_equal(h.result(), buf.read(batches[0]))

    h = buf.read_async(batches[1])
    deadline = time.perf_counter() + 60.0
    while not h.done() and time.perf_counter() < deadline:
        time.sleep(0.005)
    assert h.done(), "read_async made no progress while the caller waited"
    np.testing.assert_array_equal(h.result(), buf.read(batches[1]))


def test_read_async_returns_before_its_values_are_ready(monkeypatch):
    """The caller gets the handle while the values are still on their way (here their
    decode is held back), so it can overlap the read with its own work."""
    rng = np.random.default_rng(13)
    buf = MessageBuffer(N, SHAPE, storage_bits=8)
    buf.write(np.arange(4), _values(rng, 4))
    decode, release = buf._decode, threading.Event()

    def held(raw):
        release.wait(120)  # only so that a broken test cannot hang
        return decode(raw)

    monkeypatch.setattr(buf, "_decode", held)
    h = buf.read_async([1, 3])
    assert not h.done()
    release.set()
    np.testing.assert_array_equal(h.result(), buf.read([1, 3]))


# --------------------------------------------------------------------------- snapshots


@pytest.mark.parametrize("bits", [None, 4])
def test_save_restore_roundtrip(tmp_path, bits):
    rng = np.random.default_rng(9)
    buf = MessageBuffer(N, SHAPE, storage_bits=bits, bucket_size=16)
    ids = rng.choice(N, 15, replace=False)
    buf.write_async(ids, _values(rng, 15))  # pending: save must flush it first
    snap = buf.save(tmp_path / "snap")
    assert snap == (tmp_path / "snap").absolute()
    want, want_seen = buf.read(np.arange(N)), buf.seen(np.arange(N))
    assert want_seen.sum() == 15
    mem = MessageBuffer.restore(snap)
    assert mem.path is None and mem.storage_bits == bits and mem.bucket_size == 16
    np.testing.assert_array_equal(mem.read(np.arange(N)), want)
    np.testing.assert_array_equal(mem.seen(np.arange(N)), want_seen)
    disk = MessageBuffer.restore(snap, path=tmp_path / "copy")
    np.testing.assert_array_equal(disk.read(np.arange(N)), want)
    np.testing.assert_array_equal(disk.seen(np.arange(N)), want_seen)
    disk.close()
    reopened = MessageBuffer(N, SHAPE, path=tmp_path / "copy", storage_bits=bits, bucket_size=16)
    np.testing.assert_array_equal(reopened.read(np.arange(N)), want)


def test_snapshot_survives_later_writes_and_a_crash_mid_write(tmp_path, monkeypatch):
    rng = np.random.default_rng(10)
    live = MessageBuffer(N, SHAPE, path=tmp_path / "live")
    old_ids = np.arange(0, 20)
    old = _values(rng, 20)
    live.write(old_ids, old)
    snap = live.save(tmp_path / "snap")
    files = _tree_hash(snap)

    # Later writes overwrite saved samples and add new ones ...
    live.write(np.arange(10, 30), _values(rng, 20))

    # ... and a "crash" in the middle of a write: the data lands, then the writer dies
    # before the seen flags are committed.
    def crash(ids):
        raise RuntimeError("simulated crash mid-write")

    monkeypatch.setattr(live, "_write_seen", crash)
    fut = live.write_async(np.arange(0, 5), _values(rng, 5))
    with pytest.raises(RuntimeError, match="simulated crash"):
        fut.result()
    assert not np.array_equal(live.read(np.arange(5)), old[:5])  # the live store changed

    assert _tree_hash(snap) == files  # the snapshot's bytes did not
    back = MessageBuffer.restore(snap)
    np.testing.assert_array_equal(back.read(old_ids), old)
    np.testing.assert_array_equal(back.seen(np.arange(N)), np.arange(N) < 20)
    assert not back.read(np.arange(20, N)).any()


def test_save_is_atomic_on_failure(tmp_path, monkeypatch):
    rng = np.random.default_rng(11)
    buf = MessageBuffer(N, SHAPE)
    first = _values(rng, 4)
    buf.write(np.arange(4), first)
    snap = buf.save(tmp_path / "snap")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        buf.save(snap)

    buf.write(np.arange(4), _values(rng, 4))

    def boom(root, meta):
        raise OSError("disk full")

    monkeypatch.setattr(buffer_mod, "_write_meta", boom)
    with pytest.raises(OSError, match="disk full"):
        buf.save(snap, overwrite=True)
    with pytest.raises(OSError, match="disk full"):
        buf.save(tmp_path / "other")
    monkeypatch.undo()
    # The old snapshot is intact, no partial snapshot appeared, temp dirs were cleaned up.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    np.testing.assert_array_equal(MessageBuffer.restore(snap).read(np.arange(4)), first)

    newest = buf.read(np.arange(4))
    buf.save(snap, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap"]
    np.testing.assert_array_equal(MessageBuffer.restore(snap).read(np.arange(4)), newest)


_KILLED_SAVE = """
import os, signal, sys
import numpy as np
import jaxcomm._src.buffer as m
root = sys.argv[1]
buf = m.MessageBuffer(8, (3, 5), path=os.path.join(root, "live"))
buf.write(np.arange(8), np.full((8, 3, 5), 1.0, np.float32))
buf.save(os.path.join(root, "snap"))
buf.write(np.arange(8), np.full((8, 3, 5), 2.0, np.float32))
# Die hard (no exception handlers, no cleanup) once the data is written, before the rename.
m._write_meta = lambda root, meta: os.kill(os.getpid(), signal.SIGKILL)
buf.save(os.path.join(root, sys.argv[2]), overwrite=True)
"""


@pytest.mark.parametrize("target", ["fresh", "snap"])
def test_save_killed_midway_leaves_no_partial_snapshot(tmp_path, target):
    """A process killed inside ``save`` leaves the target absent or as it was, never partial."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path), target], env=env, timeout=120
    )
    assert proc.returncode == -9
    names = {p.name for p in tmp_path.iterdir()}
    assert "fresh" not in names
    assert any(n.startswith(f".{target}.tmp-") for n in names)  # the abandoned temp dir
    back = MessageBuffer.restore(tmp_path / "snap")  # the earlier snapshot is intact
    np.testing.assert_array_equal(back.read(np.arange(8)), np.ones((8, 3, 5)))
    assert back.seen(np.arange(8)).all()


def test_restore_into_mismatched_path_raises(tmp_path):
    buf = MessageBuffer(N, SHAPE)
    snap = buf.save(tmp_path / "snap")
    MessageBuffer(N, (2, 2), path=tmp_path / "live").close()
    with pytest.raises(ValueError, match="mismatch in shape"):
        MessageBuffer.restore(snap, path=tmp_path / "live")
    with pytest.raises(FileNotFoundError, match="no MessageBuffer snapshot"):
        MessageBuffer.restore(tmp_path / "absent")


# --------------------------------------------------------------------------- errors


def test_bad_ids_raise():
    buf = MessageBuffer(10, SHAPE)
    v = np.zeros((2, *SHAPE), np.float32)
    with pytest.raises(ValueError, match=r"\[0, 10\).*got id 10 at position 1"):
        buf.write([3, 10], v)
    with pytest.raises(ValueError, match=r"\[0, 10\).*got id -1 at position 0"):
        buf.read([-1, 2])
    with pytest.raises(ValueError, match=r"unique.*got id 3 more than once.*\[0, 10\)"):
        buf.write([3, 3], v)
    with pytest.raises(ValueError, match=r"unique.*got id 4"):
        buf.read_async([4, 1, 4])
    with pytest.raises(ValueError, match=r"1-D.*got shape \(1, 2\)"):
        buf.seen([[1, 2]])
    with pytest.raises(TypeError, match="integers, got dtype float64"):
        buf.read([1.0, 2.0])
    assert not buf.seen(np.arange(10)).any()  # nothing was written


def test_bad_values_raise_and_store_nothing():
    buf = MessageBuffer(10, SHAPE)
    with pytest.raises(
        ValueError, match=r"shape \[len\(ids\), \*shape\] = \[2, 4, 24\], got \[2, 4, 23\]"
    ):
        buf.write([0, 1], np.zeros((2, 4, 23)))
    with pytest.raises(ValueError, match=r"= \[2, 4, 24\], got \[3, 4, 24\]"):
        buf.write_async([0, 1], np.zeros((3, *SHAPE)))
    bad = np.zeros((2, *SHAPE), np.float32)
    bad[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match=r"non-finite.*first at sample id 7"):
        buf.write([4, 7], bad)
    bad[1, 2, 3] = -np.inf
    q = MessageBuffer(10, SHAPE, storage_bits=8)
    with pytest.raises(ValueError, match="non-finite"):
        q.write([4, 7], bad)
    with pytest.raises(ValueError, match="non-finite"):
        q.write([4, 7], jnp.asarray(bad))
    half = MessageBuffer(10, SHAPE, dtype="float16")
    with pytest.raises(ValueError, match="after casting to float16"):
        half.write([0], np.full((1, *SHAPE), 1e6, np.float32))  # overflows float16
    for b in (buf, q, half):
        assert not b.seen(np.arange(10)).any()


def test_bad_constructor_args_raise():
    with pytest.raises(ValueError, match="storage_bits"):
        MessageBuffer(10, SHAPE, storage_bits=9)
    with pytest.raises(ValueError, match="dtype must be one of"):
        MessageBuffer(10, SHAPE, dtype="int32")
    with pytest.raises(ValueError, match=r"shape\[1\]"):
        MessageBuffer(10, (4, 0))
    with pytest.raises(TypeError, match="shape must be a tuple"):
        MessageBuffer(10, 4)
    with pytest.raises(ValueError, match="num_samples"):
        MessageBuffer(0, SHAPE)


def test_repr_len_and_attributes(tmp_path):
    buf = MessageBuffer(N, SHAPE, storage_bits=8, bucket_size=32)
    assert len(buf) == N
    assert buf.shape == SHAPE and buf.dtype == np.float32 and buf.storage_bits == 8
    assert buf.path is None
    r = repr(buf)
    for part in ("num_samples=50", "shape=(4, 24)", "dtype=float32", "storage_bits=8", "memory"):
        assert part in r
    with MessageBuffer(N, SHAPE, path=tmp_path / "x") as disk:
        assert str(tmp_path / "x") in repr(disk)
    with pytest.raises(RuntimeError, match="closed"):
        disk.write([0], np.zeros((1, *SHAPE)))
