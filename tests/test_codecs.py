"""Codecs: bit packing, the quantizer's unbiasedness and byte counts, signs, top-k."""

import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import jaxcomm
from jaxcomm._src import codecs


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=70))
def test_pack_unpack_bits_roundtrip(bits):
    b = np.array(bits)
    packed = jaxcomm.codecs.pack_bits(b)
    assert packed.dtype == jnp.uint8
    assert packed.shape == (math.ceil(len(bits) / 8),)
    np.testing.assert_array_equal(np.asarray(jaxcomm.codecs.unpack_bits(packed, len(bits))), b)


def test_pack_bits_lsb_first():
    bits = np.zeros(16, bool)
    bits[[0, 3, 9]] = True
    np.testing.assert_array_equal(np.asarray(jaxcomm.codecs.pack_bits(bits)), [0b1001, 0b10])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 50), st.integers(0, 2**31 - 1))
def test_pack_codes_roundtrip_and_size(bits, n, seed):
    codes = np.random.default_rng(seed).integers(0, 2**bits, size=(3, n), dtype=np.uint8)
    # Jitted: one compile a shape instead of one for each operation.
    packed = jax.jit(codecs.pack_codes, static_argnums=1)(codes, bits)
    assert packed.shape == (3, math.ceil(n * bits / 8))
    unpack = jax.jit(codecs.unpack_codes, static_argnums=(1, 2))
    np.testing.assert_array_equal(np.asarray(unpack(packed, bits, n)), codes)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_quantizer_unbiased(bits, symmetric):
    """Mean of 2000 stochastic decodes is within 5 standard errors of x, per element.

    Each decode of element j is a two-point variable on adjacent grid levels, so its variance
    is at most step^2 / 4; with K draws the mean's standard error is <= step / (2 sqrt K).
    """
    x = jax.random.normal(jax.random.key(1), (300,)) * 3.0
    keys = jax.random.split(jax.random.key(7), 2000)
    bucket = 64
    dec = jax.vmap(
        lambda k: jaxcomm.codecs.dequantize(
            jaxcomm.codecs.quantize(x, k, bits=bits, bucket_size=bucket, symmetric=symmetric)
        )
    )(keys)
    mean = np.asarray(dec.mean(0))
    xb = np.pad(np.asarray(x), (0, (-300) % bucket), mode="edge").reshape(-1, bucket)
    width = np.abs(xb).max(1) * 2 if symmetric else xb.max(1) - xb.min(1)
    step = np.repeat(width / (2**bits - 1), bucket)[:300]
    bound = 5 * step / (2 * np.sqrt(len(keys))) + 1e-6
    assert np.all(np.abs(mean - np.asarray(x)) <= bound)
    # And it is not trivially exact: single decodes do differ from x.
    assert np.abs(np.asarray(dec[0]) - np.asarray(x)).max() > 0


@settings(max_examples=30, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 40),
    st.integers(1, 3000),
    st.booleans(),
)
def test_quantized_payload_bytes_formula(bits, bucket, n, symmetric):
    x = jnp.linspace(-1.0, 2.0, n)
    q = jaxcomm.codecs.quantize(
        x, jax.random.key(0), bits=bits, bucket_size=bucket, symmetric=symmetric
    )
    expect = math.ceil(n * bits / 8) + 4 * math.ceil(n / bucket) * (1 if symmetric else 2)
    assert jaxcomm.codecs.payload_bytes(q) == expect
    assert codecs.quantized_nbytes(n, bits=bits, bucket_size=bucket, symmetric=symmetric) == expect
    assert q.codes.dtype == jnp.uint8


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_quantize_error_bound_deterministic(bits):
    x = jax.random.uniform(jax.random.key(3), (4, 128), minval=-2, maxval=5)
    q = jaxcomm.codecs.quantize(
        x, None, bits=bits, bucket_size=128, stochastic=False, symmetric=False
    )
    y = jaxcomm.codecs.dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    step = (x.max(1) - x.min(1)) / (2**bits - 1)
    assert np.all(np.abs(np.asarray(y - x)) <= np.asarray(step)[:, None] / 2 + 1e-5)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "x",
    [
        np.zeros(100, np.float32),
        np.full(100, 3.25, np.float32),
        np.full(100, 1e-38, np.float32),
        np.array([3.0e38, -3.0e38, 1.0, 0.0] * 25, np.float32),
        np.array([1e-45, -1e-45] * 50, np.float32),
    ],
    ids=["zeros", "constant", "tiny", "huge", "denormal"],
)
def test_quantize_edge_inputs_stay_finite(x, symmetric):
    for stochastic in (True, False):
        q = jaxcomm.codecs.quantize(
            x, jax.random.key(0), bits=2, bucket_size=32, symmetric=symmetric, stochastic=stochastic
        )
        y = np.asarray(jaxcomm.codecs.dequantize(q))
        assert np.all(np.isfinite(y))
        assert bool(jaxcomm.codecs.payload_is_finite(q))
        # Zero and constant buckets are reproduced exactly.
        if np.ptp(x.astype(np.float64)) == 0 and abs(x[0]) > 1e-30:
            np.testing.assert_array_equal(y, x)


def test_quantize_reports_nonfinite():
    x = np.array([1.0, np.nan, 2.0], np.float32)
    with pytest.raises(ValueError, match="non-finite"):
        jaxcomm.codecs.quantize(x, jax.random.key(0), bits=4)
    # Traced: cannot raise, so the bucket decodes non-finite and the payload says so.
    q = jax.jit(lambda v: jaxcomm.codecs.quantize(v, jax.random.key(0), bits=4))(x)
    assert not bool(jaxcomm.codecs.payload_is_finite(q))
    assert not np.all(np.isfinite(np.asarray(jaxcomm.codecs.dequantize(q))))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": 0}, r"bits must be an integer in \[1, 8\], got 0"),
        ({"bits": 9}, r"bits must be an integer in \[1, 8\], got 9"),
        ({"bits": 4, "bucket_size": 0}, r"bucket_size must be an integer in \[1, inf\], got 0"),
    ],
)
def test_quantize_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxcomm.codecs.quantize(jnp.ones(4), jax.random.key(0), **kwargs)


def test_quantize_needs_key_and_float():
    with pytest.raises(ValueError, match="key"):
        jaxcomm.codecs.quantize(jnp.ones(4), None, bits=4)
    with pytest.raises(TypeError, match="floating"):
        jaxcomm.codecs.quantize(jnp.ones(4, jnp.int32), jax.random.key(0), bits=4)


def test_quantize_under_vmap_and_jit():
    x = jax.random.normal(jax.random.key(0), (5, 33))
    keys = jax.random.split(jax.random.key(1), 5)
    f = jax.jit(
        jax.vmap(lambda v, k: jaxcomm.codecs.dequantize(jaxcomm.codecs.quantize(v, k, bits=8)))
    )
    y = f(x, keys)
    assert y.shape == x.shape
    assert float(jnp.abs(y - x).max()) < 0.05


def test_sign_roundtrip_and_bytes():
    x = jnp.array([[0.5, -1.0, 0.0, 2.0, -3.0, 1e-9, -1e-9, 4.0, 7.0]])
    code = jaxcomm.codecs.sign_encode(x)
    assert jaxcomm.codecs.payload_bytes(code) == 2
    np.testing.assert_array_equal(
        np.asarray(jaxcomm.codecs.sign_decode(code)), [[1, -1, -1, 1, -1, 1, -1, 1, 1]]
    )
    scaled = jaxcomm.codecs.sign_encode(x, scale=True)
    assert jaxcomm.codecs.payload_bytes(scaled) == 6
    np.testing.assert_allclose(
        np.abs(np.asarray(jaxcomm.codecs.sign_decode(scaled))),
        float(jnp.mean(jnp.abs(x))),
        rtol=1e-6,
    )


def test_topk_roundtrip_and_bytes():
    x = jnp.array([[0.1, -5.0, 0.3], [4.0, -0.2, 0.0]])
    p = jaxcomm.codecs.topk_encode(x, k=2)
    assert p.indices.dtype == jnp.int32
    assert jaxcomm.codecs.payload_bytes(p) == 2 * (4 + 4)
    np.testing.assert_array_equal(
        np.asarray(jaxcomm.codecs.topk_decode(p)), [[0, -5, 0], [4, 0, 0]]
    )
    assert jaxcomm.codecs.topk_encode(jnp.ones(1000), ratio=0.01).values.shape == (10,)
    g = codecs.topk_gather(x, p.indices)
    np.testing.assert_array_equal(np.asarray(g.values), np.asarray(p.values))
    with pytest.raises(ValueError, match=r"ratio must be in \(0, 1\], got 1.5"):
        jaxcomm.codecs.topk_encode(x, ratio=1.5)
    with pytest.raises(ValueError, match="exactly one of k and ratio"):
        jaxcomm.codecs.topk_encode(x)


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_pack_codes_matches_the_bit_stream_layout(bits):
    """Code j occupies stream bits j*b .. j*b+b-1, least-significant first."""
    codes = np.random.default_rng(bits).integers(0, 2**bits, size=1001, dtype=np.uint8)
    stream = ((codes[:, None] >> np.arange(bits)) & 1).astype(bool).reshape(-1)
    np.testing.assert_array_equal(
        np.asarray(codecs.pack_codes(codes, bits)), np.asarray(jaxcomm.codecs.pack_bits(stream))
    )


@pytest.mark.parametrize("method", ["auto", "exact", "threshold", "sample"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_topk_payload_of_a_nonfinite_input_is_nonfinite_under_jit(method, bad):
    """Under jit nothing can raise: a NaN or Inf anywhere must reach the payload."""
    x = np.linspace(-1.0, 1.0, 1000).astype(np.float32)
    x[777] = bad
    enc = jax.jit(lambda v: jaxcomm.codecs.topk_encode(v, ratio=0.1, method=method))
    p = enc(jnp.asarray(x))
    assert not bool(jaxcomm.codecs.payload_is_finite(p))
    assert 777 in np.asarray(p.indices)
    # and with finite input the threshold search is unchanged: the same set as lax.top_k
    y = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    got = set(
        np.asarray(
            jax.jit(lambda v: jaxcomm.codecs.topk_encode(v, ratio=0.1, method=method))(y).indices
        )
    )
    assert got == set(np.argsort(-np.abs(y))[:100])


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_element_anywhere_poisons_its_bucket_under_vmap(symmetric, bad):
    """XLA's CPU max reduction over a 512-element bucket can keep the finite operand; the
    quantizer must still give the bucket a non-finite scale at every position."""
    n = 625
    x = np.ones((n, n), np.float32)
    x[np.arange(n), np.arange(n)] = bad  # row i: the bad value at position i
    q = jax.jit(
        jax.vmap(
            lambda v: jaxcomm.codecs.quantize(v, None, bits=3, bucket_size=512, stochastic=False,
                                       symmetric=symmetric)
        )
    )(jnp.asarray(x))  # fmt: skip
    out = np.asarray(jax.vmap(jaxcomm.codecs.dequantize)(q))
    assert not np.isfinite(out).all(axis=1).any()


@pytest.mark.parametrize("method", ["auto", "threshold", "sample"])
def test_threshold_topk_keeps_a_nan_anywhere_in_the_payload(method):
    """A NaN at any position reaches the payload (a max over the magnitudes, which XLA's CPU
    reduction computes without NaN, cannot be what decides it)."""
    d, k = 1000, 100
    x = np.random.default_rng(0).normal(size=(d // 37 + 1, d)).astype(np.float32)
    rows = np.arange(x.shape[0])
    x[rows, rows * 37] = np.nan
    idx = jax.jit(jax.vmap(lambda v: jaxcomm.codecs.topk_indices(v, k, method=method)))(
        jnp.asarray(x)
    )
    for r, i in zip(rows, np.asarray(idx), strict=True):
        assert r * 37 in set(i.tolist())
