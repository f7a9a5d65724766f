"""Cheap per-element randomness for stochastic rounding: a counter-based hash.

``jax.random.uniform`` runs threefry-2x32 (20 rounds) for every element; on a CPU that costs
about nine device copies of a float32 array, more than the quantizer it feeds. The codecs
only need, per element, random bits that are *marginally* uniform for every element under a
random key, and free of visible structure across elements. This module draws them from a
counter-based integer hash of (key, flat element index):

    s0, s1 = jax.random.bits(key, (2,), uint32)          # two words from the key, once
    h_i    = mix(mix(i * 0x9E3779B9 + s0) ^ s1)           # per element, ~14 integer ops

``mix`` is a 32-bit bijection (xor-shift / multiply, "lowbias32" constants, an avalanche
function). Given a uniform 32-bit word ``s0`` (it comes from threefry, so as uniform as JAX's
own uniforms), ``i * 0x9E3779B9 + s0`` is uniform for every fixed ``i`` and so is any
bijection of it: each ``h_i`` is exactly uniform over ``2**32`` values over keys.
Independence across elements is not exact (it is a hash, not a cipher); tests check the
empirical correlation of neighbours and the uniformity of one key's stream.
Uniform floats keep the top 24 bits (``u = (h >> 8) * 2**-24``), one more than the 23
that ``jax.random.uniform`` gives.

Stochastic rounding compares ``u`` with the fractional part instead of forming ``y + u``:
``q = floor(y) + (u < y - floor(y))``. For ``y >= 0`` (every codec's grid position) the
comparison is exact (both sides are float32 and ``y - floor(y)`` is exact), so
``P(round up) = ceil(f * 2**24) / 2**24`` for fraction ``f``: the bias is below ``2**-24``
of one grid step at every level (for ``-1 < y < 0`` the fraction rounds, with a bias still
below ``2**-24``). ``floor(y + u)`` would lose the
low bits of ``u`` for large ``y`` (at level 255, float32 keeps 16 bits of the fraction).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["hash_bits", "uniform", "bernoulli", "stochastic_round"]

_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: spreads consecutive indices over the words
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_MAX_ELEMENTS = 1 << 32


def _mix(h: jax.Array) -> jax.Array:
    """A 32-bit avalanche bijection (xor-shift-multiply)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(_M1)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(_M2)
    return h ^ (h >> 16)


def _seeds(key: Any) -> tuple[jax.Array, jax.Array]:
    try:
        words = jax.random.bits(key, (2,), jnp.uint32)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"key must be a PRNG key (jax.random.key or raw uint32 key data), got "
            f"{type(key).__name__} {getattr(key, 'dtype', '')}: {e}"
        ) from e
    return words[0], words[1]


def hash_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``uint32[shape]`` random words: a hash of ``key`` and each element's flat index.

    Each word is exactly uniform over ``2**32`` values over keys (see the module docstring).

    Args:
      key: PRNG key (typed ``jax.random.key`` or raw ``jax.random.PRNGKey`` data), any impl.
      shape: output shape; at most ``2**32 - 1`` elements.
    """
    shape = tuple(int(d) for d in shape)
    size = math.prod(shape)
    if size >= _MAX_ELEMENTS:
        raise ValueError(f"shape must have fewer than 2**32 elements, got {shape} ({size})")
    s0, s1 = _seeds(key)
    i = lax.iota(jnp.uint32, size).reshape(shape)
    return _mix(_mix(i * jnp.uint32(_GOLDEN) + s0) ^ s1)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``float32[shape]`` uniform on ``[0, 1)`` in steps of ``2**-24``, from :func:`hash_bits`."""
    return (hash_bits(key, shape) >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def bernoulli(key: jax.Array, p: jax.Array) -> jax.Array:
    """``bool[p.shape]``: True with probability ``p`` (to within ``2**-24``) per element."""
    p = jnp.asarray(p, jnp.float32)
    return uniform(key, p.shape) < p


def stochastic_round(y: jax.Array, key: jax.Array) -> jax.Array:
    """Round ``float32`` ``y`` down or up, up with probability ``y - floor(y)``: ``E = y``.

    The bias is below ``2**-24`` per element (see the module docstring).
    """
    y = jnp.asarray(y, jnp.float32)
    lo = jnp.floor(y)
    return lo + (uniform(key, y.shape) < y - lo).astype(jnp.float32)
