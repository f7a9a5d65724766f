"""The counter-based hash behind stochastic rounding: uniform, unbiased, no visible structure."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomm
from jaxcomm._src import rng

KEYS = 2000


def test_each_word_is_uniform_over_keys():
    """Every bit of every element is 1 in half of 2000 keys, within 5 standard errors."""
    words = jax.vmap(lambda k: rng.hash_bits(k, (64,)))(jax.random.split(jax.random.key(0), KEYS))
    w = np.asarray(words)
    bits = (w[..., None] >> np.arange(32, dtype=np.uint32)) & 1  # [K, 64, 32]
    freq = bits.mean(0)
    assert np.all(np.abs(freq - 0.5) <= 5 * 0.5 / np.sqrt(KEYS)), np.abs(freq - 0.5).max()


def test_one_key_stream_is_uniform_and_uncorrelated():
    n = 1 << 20
    u = np.asarray(rng.uniform(jax.random.key(3), (n,))).astype(np.float64)
    assert u.min() >= 0.0 and u.max() < 1.0
    # Chi-square over 256 equal bins: 255 degrees of freedom, mean 255, sd ~22.6.
    counts = np.bincount((u * 256).astype(np.int64), minlength=256)
    chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
    assert chi2 < 255 + 6 * np.sqrt(2 * 255), chi2
    # Neighbours at the lags the codecs care about (adjacent, a byte of codes, a bucket).
    z = u - 0.5
    for lag in (1, 2, 8, 512):
        r = (z[:-lag] * z[lag:]).mean() / z.var()
        assert abs(r) < 5 / np.sqrt(n), (lag, r)


def test_streams_of_related_keys_are_uncorrelated():
    n = 1 << 18
    base = jax.random.key(11)
    streams = [rng.uniform(k, (n,)) for k in (base, jax.random.fold_in(base, 1))]
    a, b = (np.asarray(s).astype(np.float64) - 0.5 for s in streams)
    assert abs((a * b).mean() / a.std() / b.std()) < 5 / np.sqrt(n)


def test_uniform_uses_24_bits():
    u = np.asarray(rng.uniform(jax.random.key(5), (4096,))).astype(np.float64)
    m = u * 2**24
    np.testing.assert_array_equal(m, np.round(m))
    assert (m.astype(np.int64) % 2 == 1).mean() > 0.4  # the lowest of the 24 bits is random


@pytest.mark.parametrize("y", [0.3, 2.75, 14.01, 200.5, 254.999])
def test_stochastic_round_is_unbiased(y):
    """Mean over 2000 keys x 64 elements is y within 5 standard errors; outputs are adjacent."""
    ys = jnp.full((64,), y, jnp.float32)
    out = np.asarray(
        jax.vmap(lambda k: rng.stochastic_round(ys, k))(
            jax.random.split(jax.random.key(int(y * 100)), KEYS)
        )
    )
    f = y - np.floor(y)
    assert set(np.unique(out)) <= {np.floor(y), np.floor(y) + 1}
    se = np.sqrt(f * (1 - f) / out.size)
    assert abs(out.mean() - np.float32(y)) <= 5 * se + 1e-6


def test_bernoulli_frequencies():
    p = jnp.linspace(0.0, 1.0, 33)
    draws = jax.vmap(lambda k: rng.bernoulli(k, p))(jax.random.split(jax.random.key(2), KEYS))
    freq = np.asarray(draws).mean(0)
    pn = np.asarray(p)
    assert freq[0] == 0.0 and freq[-1] == 1.0
    se = np.sqrt(pn * (1 - pn) / KEYS)
    assert np.all(np.abs(freq - pn) <= 5 * se + 1e-9)


def test_key_kinds_and_bad_input():
    shape = (3, 5)
    for key in (jax.random.key(0), jax.random.PRNGKey(0), jax.random.key(0, impl="rbg")):
        w = rng.hash_bits(key, shape)
        assert w.shape == shape and w.dtype == jnp.uint32
    a = rng.hash_bits(jax.random.key(0), (15,))
    np.testing.assert_array_equal(
        np.asarray(a), np.asarray(rng.hash_bits(jax.random.key(0), (15,)))
    )
    assert not np.array_equal(np.asarray(a), np.asarray(rng.hash_bits(jax.random.key(1), (15,))))
    with pytest.raises(ValueError, match="2\\*\\*32"):
        rng.hash_bits(jax.random.key(0), (1 << 16, 1 << 16))
    with pytest.raises(TypeError, match="key"):
        rng.hash_bits(np.zeros(3, np.float32), (4,))
    assert jaxcomm.rng.stochastic_round is rng.stochastic_round


def test_stochastic_round_is_the_exact_comparison_with_24_bits():
    """Element for element, ``floor(y) + (u < y - floor(y))`` with this key's 24-bit
    uniforms: a coarser draw or ``<=`` or ``floor(y + u)`` would differ somewhere here."""
    y = np.concatenate(
        [
            np.linspace(0.0, 255.0, 4001, dtype=np.float32),
            np.float32(np.arange(256)) + np.float32(2.0**-20),  # tiny fractions
            np.float32(np.arange(1, 256)) - np.float32(2.0**-16),
        ]
    ).astype(np.float32)
    key = jax.random.key(42)
    got = np.asarray(rng.stochastic_round(jnp.asarray(y), key))
    u = np.asarray(rng.uniform(key, y.shape)).astype(np.float64)
    lo = np.floor(y.astype(np.float64))
    want = lo + (u < y.astype(np.float64) - lo)
    np.testing.assert_array_equal(got, want)
    # A value on a level never moves, for any key.
    levels = jnp.arange(256, dtype=jnp.float32)
    for k in jax.random.split(jax.random.key(1), 50):
        np.testing.assert_array_equal(
            np.asarray(rng.stochastic_round(levels, k)), np.asarray(levels)
        )


def test_numpy_raw_keys_are_accepted():
    raw = np.asarray(jax.random.PRNGKey(3))
    np.testing.assert_array_equal(
        np.asarray(rng.hash_bits(raw, (5,))), np.asarray(rng.hash_bits(jnp.asarray(raw), (5,)))
    )
