"""AQ-SGD boundary codecs: buffer agreement, delta error, Q_bw, payload = wire bytes, errors."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxcomm._src import aqsgd
from jaxcomm._src.codecs import (
    ChunkTopK,
    LowRank,
    Quantized,
    dequantize,
    lowrank_decode,
    lowrank_encode,
    payload_bytes,
)
from jaxcomm._src.collectives import send

B, T, H = 4, 3, 16


def _arrays(seed=0, shape=(B, T, H), drift=0.05):
    k1, k2 = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(k1, shape)
    prev = a + drift * jax.random.normal(k2, shape)
    return a, prev


def _step(x):
    """Grid step of the per-row, per-last-axis symmetric quantizer, broadcast to ``x``."""
    return np.abs(np.asarray(x)).max(axis=-1, keepdims=True) * 2.0


# --------------------------------------------------------------------------- AQ-SGD forward


def test_first_visit_sends_the_activation_exactly():
    a, prev = _arrays()
    prev = prev.at[1].set(jnp.nan)  # an uninitialised buffer row must not leak
    for seen in (False, np.zeros((B,), bool)):
        payload, new_prev = aqsgd.aqsgd_encode(a, prev, seen, jax.random.key(1), bits=2)
        np.testing.assert_array_equal(np.asarray(new_prev), np.asarray(a))
        np.testing.assert_array_equal(np.asarray(payload), np.asarray(a))
        np.testing.assert_array_equal(np.asarray(aqsgd.aqsgd_decode(payload, prev)), a)
        assert payload_bytes(payload) == 4 * a.size


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_seen_rows_add_the_dequantized_delta_and_both_sides_agree(bits):
    a, prev = _arrays(seed=bits)
    key = jax.random.key(3)
    payload, new_prev = aqsgd.aqsgd_encode(a, prev, np.ones((B,), bool), key, bits=bits)
    assert isinstance(payload, Quantized) and payload.codes.shape[0] == B
    # previous + dequantize(q), compiled (XLA folds the decode's constants, so an op-by-op
    # eager dequantize may differ in the last bit; the codec always runs it compiled).
    ref = jax.jit(lambda q, p: p + jax.vmap(dequantize)(q))(payload, prev)
    np.testing.assert_array_equal(np.asarray(new_prev), np.asarray(ref))
    eager = np.asarray(prev) + np.asarray(jax.vmap(dequantize)(payload))
    np.testing.assert_allclose(np.asarray(new_prev), eager, rtol=1e-6, atol=1e-7)
    # Receiver, eager and jitted; sender jitted: all bit-identical.
    np.testing.assert_array_equal(aqsgd.aqsgd_decode(payload, prev), new_prev)
    np.testing.assert_array_equal(jax.jit(aqsgd.aqsgd_decode)(payload, prev), new_prev)
    enc = jax.jit(functools.partial(aqsgd.aqsgd_encode, seen=True, bits=bits))
    p_jit, new_jit = enc(a, prev, key=key)
    jax.tree_util.tree_map(np.testing.assert_array_equal, p_jit, payload)
    np.testing.assert_array_equal(new_jit, new_prev)
    np.testing.assert_array_equal(jax.jit(aqsgd.aqsgd_decode)(p_jit, prev), new_jit)


def test_sender_and_receiver_agree_across_devices():
    """Encode on stage 0, send the payload, decode on stage 1: the same buffer rows."""
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    a, prev = _arrays(seed=5)

    def per_device(a, prev):
        payload, new_out = aqsgd.aqsgd_encode(a, prev, True, jax.random.key(9), bits=3)
        received = send(payload, "stage", [(0, 1)])
        new_in = aqsgd.aqsgd_decode(received, prev)
        return new_out[None], new_in[None]

    f = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P()), out_specs=P("stage"))
    new_out, new_in = jax.jit(f)(a, prev)
    np.testing.assert_array_equal(np.asarray(new_in)[1], np.asarray(new_out)[0])
    assert not np.array_equal(np.asarray(new_in)[1], np.asarray(a))


def test_8bit_error_is_bounded_by_the_delta():
    """|m - a| <= one grid step of the delta's bucket, 2 max|delta| / 255, per element."""
    a, prev = _arrays(seed=2, drift=0.01)
    _, new_prev = aqsgd.aqsgd_encode(a, prev, True, jax.random.key(0), bits=8)
    err = np.abs(np.asarray(new_prev) - np.asarray(a))
    bound = _step(np.asarray(a) - np.asarray(prev)) / 255
    assert np.all(err <= bound * (1 + 1e-5) + 1e-7)
    assert np.linalg.norm(err) < 1e-3 * np.linalg.norm(np.asarray(a))


def _visits(bits, drift, n_visits, seed=0):
    """A slowly changing activation ``base + drift * walk`` seen ``n_visits`` times.

    Returns the max error of AQ-SGD and of DirectQ at the same bits over visits 2..n.
    """
    shape = (8, T, 32)
    keys = jax.random.split(jax.random.key(seed), 2 * n_visits + 1)
    base = 3.0 * jax.random.normal(keys[0], shape)
    enc = jax.jit(functools.partial(aqsgd.aqsgd_encode, bits=bits), static_argnums=2)
    dq = jax.jit(lambda a, k: aqsgd.directq_decode(aqsgd.directq_encode(a, k, bits=bits)))
    a = base
    m = jnp.zeros(shape)
    err_aq, err_dq = [], []
    for v in range(n_visits):
        if v:
            a = a + drift * jax.random.normal(keys[2 * v + 1], shape)
        _, m = enc(a, m, v > 0, keys[2 * v + 2])
        if v:
            err_aq.append(float(jnp.max(jnp.abs(m - a))))
            err_dq.append(float(jnp.max(jnp.abs(dq(a, keys[2 * v + 2]) - a))))
    return np.array(err_aq), np.array(err_dq)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_delta_error_tracks_the_change_not_the_scale(bits):
    """The paper's core claim: AQ-SGD's error is proportional to the activation's change.

    With |base| ~ 3 and a per-visit drift of 1e-3, DirectQ's error is a grid step of the
    activation (~ 2 * 10 / (2^b - 1)); AQ-SGD's is a step of ``a - m`` (drift plus the last
    error), which stays bounded by a small multiple of the drift.
    """
    drift = 1e-3
    err_aq, err_dq = _visits(bits, drift, n_visits=12)
    assert err_aq.max() < 0.05 * err_dq.min()
    # Error recursion e' <= c (d + e), c = 2 / (2^b - 1) < 1: e <= c / (1 - c) d_max, d_max
    # the largest per-element drift (~ 5 sigma over these draws).
    c = 2 / (2**bits - 1)
    assert err_aq.max() <= c / (1 - c) * 6 * drift


def test_8bit_aqsgd_matches_fp32_over_many_visits():
    err_aq, err_dq = _visits(8, drift=1e-2, n_visits=40, seed=1)
    assert err_aq.max() < 5e-4  # fp32 sends a exactly; |a| ~ 10
    assert err_aq.max() < 0.02 * err_dq.min()


# --------------------------------------------------------------------------- baselines


def test_directq_and_fp32_baselines():
    a, _ = _arrays(seed=4)
    q = aqsgd.directq_encode(a, jax.random.key(0), bits=8)
    assert isinstance(q, Quantized) and q.codes.shape == (B, T * H)
    a_hat = aqsgd.directq_decode(q)
    assert a_hat.shape == a.shape
    assert np.all(np.abs(np.asarray(a_hat - a)) <= _step(a) / 255 * (1 + 1e-5) + 1e-7)
    np.testing.assert_array_equal(aqsgd.fp32_decode(aqsgd.fp32_encode(a)), a)


# --------------------------------------------------------------------------- backward


def test_quantize_grad_is_identity_forward():
    a, _ = _arrays()
    np.testing.assert_array_equal(aqsgd.quantize_grad(a, jax.random.key(0), bits=4), a)
    np.testing.assert_array_equal(
        jax.jit(functools.partial(aqsgd.quantize_grad, bits=4))(a, jax.random.key(0)), a
    )


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantize_grad_is_unbiased(bits):
    """Mean over K = 2000 keys of the quantized cotangent is within 5 standard errors.

    Each quantized element is a two-point variable on adjacent grid levels, variance at most
    step^2 / 4, so the mean of K independent draws has standard error <= step / (2 sqrt K).
    """
    x = jnp.zeros((2, 4, 16))
    g = jax.random.normal(jax.random.key(1), x.shape) * 2.0
    n_keys = 2000

    def one(k):
        _, vjp = jax.vjp(lambda y: aqsgd.quantize_grad(y, k, bits=bits), x)
        return vjp(g)[0]

    draws = np.asarray(jax.vmap(one)(jax.random.split(jax.random.key(2), n_keys)))
    step = _step(g) / (2**bits - 1)
    assert np.all(np.abs(draws - np.asarray(g)) <= step * (1 + 1e-5) + 1e-6)
    assert np.all(np.abs(draws.mean(0) - np.asarray(g)) <= 5 * step / (2 * math.sqrt(n_keys)))
    assert not np.allclose(draws[0], draws[1])  # it does round stochastically


# --------------------------------------------------------------------------- wire bytes


def test_all_seen_payload_is_codes_and_scales_only():
    """The [16, 64] microbatch at 2 bits: 16 rows of 16 code bytes + one 4-byte scale."""
    a = jax.random.normal(jax.random.key(0), (16, 64))
    payload, _ = aqsgd.aqsgd_encode(a, 0.9 * a, True, jax.random.key(1), bits=2)
    leaves = jax.tree_util.tree_leaves(payload)
    assert [(x.dtype, x.shape) for x in leaves] == [
        (jnp.dtype(jnp.uint8), (16, 16)),
        (jnp.dtype(jnp.float32), (16, 1)),
    ]
    assert payload_bytes(payload) == 16 * (math.ceil(64 * 2 / 8) + 4) == 320 < 4 * a.size


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("bucket", [None, 4, 7, 1000])
def test_wire_bytes_formula(bits, bucket):
    shape = (5, 5, 7)
    n = 5 * 7
    bs = 7 if bucket is None else bucket
    a, prev = _arrays(shape=shape)
    per_row = math.ceil(n * bits / 8) + 4 * math.ceil(n / bs)
    seen, _ = aqsgd.aqsgd_encode(a, prev, True, jax.random.key(0), bits=bits, bucket_size=bucket)
    assert payload_bytes(seen) == 5 * per_row
    unseen, _ = aqsgd.aqsgd_encode(a, prev, False, jax.random.key(0), bits=bits)
    assert payload_bytes(unseen) == 4 * a.size
    assert aqsgd.grad_wire_bytes(shape, bits, bucket) == 5 * per_row
    q = aqsgd.directq_encode(a, jax.random.key(0), bits=bits, bucket_size=bucket)
    assert payload_bytes(q) == 5 * per_row


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bits", [0, 9, -1])
def test_bad_bits_raise_with_the_value(bits):
    a, prev = _arrays()
    with pytest.raises(ValueError, match=f"bits.*got {bits}"):
        aqsgd.aqsgd_encode(a, prev, True, jax.random.key(0), bits=bits)
    with pytest.raises(ValueError, match=f"got {bits}"):
        aqsgd.directq_encode(a, jax.random.key(0), bits=bits)
    with pytest.raises(ValueError, match=f"got {bits}"):
        aqsgd.quantize_grad(a, jax.random.key(0), bits=bits)
    with pytest.raises(ValueError, match=f"got {bits}"):
        aqsgd.grad_wire_bytes(a.shape, bits)
    with pytest.raises(TypeError, match="2.5"):
        aqsgd.aqsgd_encode(a, prev, True, jax.random.key(0), bits=2.5)


def test_mismatched_shapes_raise_naming_both():
    a, _ = _arrays()
    prev = jnp.zeros((B, T, H + 1))
    with pytest.raises(ValueError, match=r"\(4, 3, 16\).*\(4, 3, 17\)"):
        aqsgd.aqsgd_encode(a, prev, True, jax.random.key(0), bits=4)
    with pytest.raises(ValueError, match=r"shape \(4,\).*got shape \(3,\)"):
        aqsgd.aqsgd_encode(a, a, np.ones((3,), bool), jax.random.key(0), bits=4)
    payload, _ = aqsgd.aqsgd_encode(a, a, True, jax.random.key(0), bits=4)
    with pytest.raises(ValueError, match=r"4 rows of shape \(3, 16\).*\(4, 3, 17\)"):
        aqsgd.aqsgd_decode(payload, prev)
    with pytest.raises(ValueError, match=r"\(4, 3, 16\).*\(4, 3, 17\)"):
        aqsgd.aqsgd_decode(a, prev)


def test_seen_must_be_static_and_uniform():
    a, prev = _arrays()
    mixed = np.array([True, False, True, True])
    with pytest.raises(ValueError, match=r"seen rows \[0, 2, 3\] and unseen rows \[1\]"):
        aqsgd.aqsgd_encode(a, prev, mixed, jax.random.key(0), bits=4)
    with pytest.raises(TypeError, match="traced"):
        jax.jit(functools.partial(aqsgd.aqsgd_encode, bits=4))(a, prev, mixed, jax.random.key(0))
    with pytest.raises(TypeError, match="bool"):
        aqsgd.aqsgd_encode(a, prev, np.ones((B,)), jax.random.key(0), bits=4)
    assert aqsgd.uniform_seen(np.ones((B,), bool), B) is True
    assert aqsgd.uniform_seen(jnp.zeros((B,), bool), B) is False


def test_other_bad_inputs():
    a, prev = _arrays()
    with pytest.raises(ValueError, match="non-finite"):
        aqsgd.aqsgd_encode(a.at[0, 0, 0].set(jnp.inf), prev, True, jax.random.key(0), bits=4)
    with pytest.raises(ValueError, match="previous holds 1 non-finite"):
        aqsgd.aqsgd_encode(a, prev.at[0, 0, 0].set(jnp.nan), True, jax.random.key(0), bits=4)
    with pytest.raises(ValueError, match="at least 2 axes"):
        aqsgd.directq_encode(jnp.ones((4,)), jax.random.key(0), bits=4)
    with pytest.raises(TypeError, match="Quantized"):
        aqsgd.directq_decode(a)


# --------------------------------------------------------------------------- any row codec

TOPK = aqsgd.topk_rows(8, 2, bits=4)


def _chunk_topk_reference(row, chunk, k):
    """Dense numpy reference: in each chunk of a flat row keep the k largest |x| (ties to
    the lower position), the rest zero."""
    flat = np.asarray(row, np.float64).ravel()
    out = np.zeros_like(flat)
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        order = np.argsort(-np.abs(part), kind="stable")[:k]
        out[start + order] = part[order]
    return out.reshape(np.shape(row))


@pytest.mark.parametrize("shape,chunk,k", [((B, T, H), 8, 2), ((2, 5, 7), 16, 3), ((3, 40), 64, 1)])
def test_topk_rows_keep_each_chunks_largest_and_cost_the_documented_bytes(shape, chunk, k):
    x = jax.random.normal(jax.random.key(3), shape)
    codec = aqsgd.topk_rows(chunk, k)  # float32 values: decode is exactly the kept entries
    payload = codec.encode(x, jax.random.key(0))
    got = np.asarray(codec.decode(payload))
    for r in range(shape[0]):
        np.testing.assert_array_equal(got[r], _chunk_topk_reference(x[r], chunk, k))
    n = math.prod(shape[1:])
    chunks = -(-n // chunk)
    index_bytes = -(-chunks * k * math.ceil(math.log2(chunk)) // 8)
    assert payload_bytes(payload) == shape[0] * (index_bytes + 4 * chunks * k)
    assert codec.nbytes(shape) == payload_bytes(payload)
    q = aqsgd.topk_rows(chunk, k, bits=2)
    assert q.nbytes(shape) == shape[0] * (index_bytes + -(-chunks * k * 2 // 8) + 4 * chunks)


@pytest.mark.parametrize("codec", [TOPK, aqsgd.lowrank_rows(1)], ids=["topk", "rank1"])
def test_sparse_deltas_keep_what_was_not_sent_in_the_buffer(codec):
    """Top-k or rank-1 deltas against a buffer: both sides agree bit for bit at every
    visit, and the buffer closes in on a fixed activation (what a visit leaves out, the next
    one sends)."""
    a = jax.random.normal(jax.random.key(5), (B, T, H))
    send_prev = recv_prev = jnp.zeros_like(a)
    payload, send_prev = aqsgd.delta_encode(a, send_prev, False, jax.random.key(0), codec)
    recv_prev = aqsgd.delta_decode(payload, recv_prev)
    np.testing.assert_array_equal(np.asarray(recv_prev), np.asarray(a))  # float32 first visit
    target = a * 1.5 + 0.3  # the activation has moved since
    errors = []
    for visit in range(12):
        payload, send_prev = aqsgd.delta_encode(
            target, send_prev, True, jax.random.key(visit), codec
        )
        recv_prev = aqsgd.delta_decode(payload, recv_prev)
        np.testing.assert_array_equal(np.asarray(send_prev), np.asarray(recv_prev))
        errors.append(float(jnp.linalg.norm(target - send_prev) / jnp.linalg.norm(target)))
    assert isinstance(payload, ChunkTopK if codec is TOPK else LowRank)
    assert errors[0] > 0.2  # one visit sends a quarter of each chunk, or one direction
    assert errors[-1] < 0.05 * errors[0]


def test_quantized_deltas_in_large_buckets_are_unbiased():
    """A seen microbatch's new messages average to the activation over rounding keys, for
    one-bit codes in buckets spanning several tokens (AQ-SGD's unbiased ``Q``)."""
    a, prev = _arrays(seed=7)
    codec = aqsgd.quantized_rows(1, bucket_size=T * H)
    keys = jax.random.split(jax.random.key(11), 4000)
    news = jax.jit(jax.vmap(lambda k: aqsgd.delta_encode(a, prev, True, k, codec)[1]))(keys)
    mean, sd = np.asarray(news.mean(0)), np.asarray(news.std(0))
    assert np.median(sd) > 0.05  # one bit a value: most entries are rounded at random
    # Each bucket's largest change is sent exactly (sd ~ 0): a floor of float32 rounding.
    z = (mean - np.asarray(a)) / np.maximum(sd / np.sqrt(len(keys)), 1e-5)
    assert np.abs(z).max() < 5.0  # 192 entries: |z| > 5 has probability ~1e-4 in total
    assert payload_bytes(codec.encode(a, keys[0])) == B * (-(-T * H // 8) + 4)


def test_compressed_first_visit_starts_both_buffers_at_the_decoded_activation():
    a, prev = _arrays(seed=2)
    first = aqsgd.quantized_rows(4)
    payload, new_prev = aqsgd.delta_encode(a, prev, False, jax.random.key(1), TOPK, first=first)
    assert isinstance(payload, aqsgd.FirstVisit)
    assert payload_bytes(payload) == B * T * (H * 4 // 8 + 4)
    received = aqsgd.delta_decode(payload, prev)
    np.testing.assert_array_equal(np.asarray(received), np.asarray(new_prev))
    assert 0 < np.abs(np.asarray(new_prev) - np.asarray(a)).max() <= _step(a).max() / 15 * 1.001
    with pytest.raises(TypeError, match="FirstVisit; AQ-SGD sends first visits in float32"):
        aqsgd.aqsgd_decode(payload, prev)


@pytest.mark.parametrize(
    "codec", [TOPK, aqsgd.quantized_rows(2, bucket_size=32), aqsgd.lowrank_rows(2)]
)
def test_a_nan_anywhere_in_a_delta_reaches_the_receiver(codec):
    """A NaN in an entry top-k would not select (or in any bucket) poisons what the receiver
    rebuilds, under jit, instead of vanishing from the payload."""
    a, prev = _arrays(seed=4)
    small = jnp.abs(a - prev).argmin()  # the smallest change: never among the top-k
    bad = a.reshape(-1).at[small].set(jnp.nan).reshape(a.shape)

    @jax.jit
    def roundtrip(x):
        payload, _ = aqsgd.delta_encode(x, prev, True, jax.random.key(0), codec)
        return aqsgd.delta_decode(payload, prev)

    assert np.all(np.isfinite(np.asarray(roundtrip(a))))
    assert not np.all(np.isfinite(np.asarray(roundtrip(bad))))
    g = codec.decode(jax.jit(codec.encode)(bad, jax.random.key(1)))  # a backward message
    assert not np.all(np.isfinite(np.asarray(g)))


def test_row_codec_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"chunk must be an integer in \[2, inf\], got 1"):
        aqsgd.topk_rows(1, 1)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 8\], got 9"):
        aqsgd.topk_rows(8, 9)
    with pytest.raises(ValueError, match=r"bits must be an integer in \[1, 8\], got 0"):
        aqsgd.quantized_rows(0)
    a, prev = _arrays()
    with pytest.raises(TypeError, match="codec must be a RowCodec, got int"):
        aqsgd.delta_encode(a, prev, True, jax.random.key(0), 4)
    with pytest.raises(TypeError, match="payload must be ChunkTopK, got Quantized"):
        TOPK.decode(aqsgd.quantized_rows(2).encode(a, jax.random.key(0)))


@pytest.mark.parametrize("shape,rank", [((16, 32), 3), ((2, 8, 24), 1), ((40, 12), 5)])
def test_lowrank_code_recovers_a_low_rank_matrix_at_the_documented_bytes(shape, rank):
    """A matrix of rank ``r`` comes back within the factors' 8-bit rounding; one of higher
    rank loses at most what the truncated SVD loses, plus that rounding."""
    n = shape[-1]
    m = math.prod(shape) // n
    k1, k2, k3 = jax.random.split(jax.random.key(len(shape) + rank), 3)
    low = (jax.random.normal(k1, (m, rank)) @ jax.random.normal(k2, (rank, n))).reshape(shape)
    p = lowrank_encode(low, jax.random.key(0), rank=rank)
    assert payload_bytes(p) == -(-rank * m * 8 // 8) + -(-rank * n * 8 // 8) + 8 * rank
    rel = float(jnp.linalg.norm(lowrank_decode(p) - low) / jnp.linalg.norm(low))
    assert rel < 0.02
    full = low + jax.random.normal(k3, shape)
    p = lowrank_encode(full, jax.random.key(0), rank=rank)
    s = np.linalg.svd(np.asarray(full).reshape(m, n), compute_uv=False)
    best = np.sqrt((s[rank:] ** 2).sum() / (s**2).sum())
    got = float(jnp.linalg.norm(lowrank_decode(p) - full) / jnp.linalg.norm(full))
    assert best <= got < best + 0.05
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, "):
        lowrank_encode(full, jax.random.key(0), rank=min(m, n) + 1)
    with pytest.raises(ValueError, match="at least 2 axes"):
        lowrank_encode(jnp.ones(5), jax.random.key(0), rank=1)
