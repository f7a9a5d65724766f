"""Marsit: unbiased bit-wise merge, one-bit ring/torus all-reduce, the optax transform."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.marsit import bernoulli_words, sign_all_reduce
from jaxcomm._src.network import as_bytes

N = 8
KEYS = 2000


def test_bernoulli_words_frequency():
    for p in (0.5, 1 / 3, 1 / 7, 6 / 7, 0.0):
        w = jax.vmap(lambda k, p=p: bernoulli_words(k, p, (32,)))(
            jax.random.split(jax.random.key(0), KEYS)
        )
        freq = np.asarray(jaxcomm.codecs.unpack_bits(w, 256)).mean()
        sd = np.sqrt(max(p * (1 - p), 1e-12) / (KEYS * 256))
        assert abs(freq - p) <= 5 * sd + 1e-12, (p, freq)


@pytest.mark.parametrize("m", range(2, 9))
def test_sign_merge_is_unbiased(m):
    """Over 2000 keys the frequency of 1s is ((m-1) p + s) / m within 5 standard errors.

    ``received`` bits are drawn Bernoulli(p) per element (p on a grid in [0, 1]); the output
    bit is then Bernoulli(((m-1) p + s) / m) exactly, so its frequency over K keys has
    standard error sqrt(q (1 - q) / K).
    """
    n = 64
    p = np.linspace(0.0, 1.0, n)
    s = (np.arange(n) % 3 == 0).astype(np.float64)
    local = jaxcomm.codecs.pack_bits(s.astype(bool))

    def one(key):
        k1, k2 = jax.random.split(key)
        received = jaxcomm.codecs.pack_bits(jax.random.uniform(k1, (n,)) < p)
        return jaxcomm.codecs.unpack_bits(jaxcomm.collectives.sign_merge(received, local, k2, m), n)

    freq = np.asarray(jax.vmap(one)(jax.random.split(jax.random.key(m), KEYS))).mean(0)
    q = ((m - 1) * p + s) / m
    se = np.sqrt(q * (1 - q) / KEYS)
    assert np.all(np.abs(freq - q) <= 5 * se + 1e-9), np.max(np.abs(freq - q) / (se + 1e-9))


def test_sign_merge_agreeing_bits_pass_through():
    a = jnp.array([0b10110010, 0xFF, 0], jnp.uint8)
    out = jaxcomm.collectives.sign_merge(a, a, jax.random.key(0), 5)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(a))
    with pytest.raises(ValueError, match=r"m must be an integer in \[1, inf\], got 0"):
        jaxcomm.collectives.sign_merge(a, a, jax.random.key(0), 0)
    with pytest.raises(TypeError, match="packed uint8"):
        jaxcomm.collectives.sign_merge(a.astype(jnp.int32), a, jax.random.key(0), 2)


def _sign_reduce_runs(mesh, x, spec, axis, topology, runs):
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    lead = x.ndim - 1

    def f(v, key):
        flat = v.reshape(v.shape[lead:])
        bits = sign_all_reduce(flat, axis, key, topology=topology).bits
        return bits.reshape((1,) * lead + bits.shape)

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(spec, P()), out_specs=spec))
    return np.stack([np.asarray(g(xs, jax.random.key(i))).reshape(N, -1) for i in range(runs)])


@pytest.mark.parametrize("topology", ["ring", "torus"])
def test_sign_all_reduce_expectation_is_mean_of_signs(topology):
    """Per element, the merged bit's frequency over 400 runs is the workers' mean sign bit.

    Every worker ends with identical bits, and each element's frequency is within 5
    standard errors sqrt(t (1 - t) / runs) of t = fraction of workers with a positive value.
    """
    runs, d = 400, 203
    x = jax.random.normal(jax.random.key(1), (N, d))
    if topology == "ring":
        mesh = jax.make_mesh((N,), ("data",))
        out = _sign_reduce_runs(mesh, x, P("data"), "data", "ring", runs)
    else:
        mesh = jax.make_mesh((2, 4), ("row", "col"))
        out = _sign_reduce_runs(
            mesh, x.reshape(2, 4, d), P("row", "col"), ("row", "col"), "torus", runs
        )
    assert np.all(out == out[:, :1])
    t = (np.asarray(x) > 0).mean(0)
    freq = out[:, 0].mean(0)
    se = np.sqrt(t * (1 - t) / runs)
    assert np.all(np.abs(freq - t) <= 5 * se + 1e-9)


def test_marsit_rounds_follow_the_algorithm(mesh8, run_tx):
    """Round 0 is the full-precision average (c = 0); round 1 is one-bit with c = u - g."""
    d, lr_l, lr_g = 37, 0.5, 0.01
    grads = jax.random.normal(jax.random.key(2), (2, N, d))
    params = jnp.zeros((N, d))
    tx = jaxcomm.marsit("data", local_lr=lr_l, global_lr=lr_g, full_sync_every=4)
    upd, state = run_tx(mesh8, tx, grads, params)
    upd = np.asarray(upd)  # [N, T, d]
    g0 = lr_l * np.asarray(grads[0]).mean(0)
    for w in range(N):
        np.testing.assert_allclose(upd[w, 0], -g0, rtol=1e-5, atol=1e-6)
    # Round 1: u = lr_l * grad (c was reset), g = lr_g * (+-1), identical on all workers.
    g1 = -upd[:, 1]
    assert np.all(np.isclose(np.abs(g1), lr_g))
    assert np.all(g1 == g1[:1])
    u1 = lr_l * np.asarray(grads[1])
    np.testing.assert_allclose(np.asarray(state.compensation), u1 - g1, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(state.count) == 2)
    # One-bit round: one bit per element (and the flag byte) per hop on the wire.
    seg_bytes = math.ceil(math.ceil(d / N) / 8) + 1
    assert np.all(as_bytes(state.log.sent_bytes) == 2 * (N - 1) * seg_bytes)


def test_marsit_full_sync_every_step_is_psgd(mesh8, run_tx):
    d = 50
    grads = jax.random.normal(jax.random.key(3), (3, N, d))
    tx = jaxcomm.marsit("data", local_lr=0.1, global_lr=0.01, full_sync_every=1)
    upd, state = run_tx(mesh8, tx, grads, jnp.zeros((N, d)))
    expect = -0.1 * np.asarray(grads).mean(1)  # [T, d]
    np.testing.assert_allclose(np.asarray(upd)[3], expect, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(state.compensation) == 0)
    assert np.all(as_bytes(state.log.sent_bytes) == 2 * (N - 1) * (-(-d // N)) * 4)


def test_marsit_one_bit_bytes_are_one_32nd_of_fp32(mesh8, run_tx):
    """A one-bit hop moves 1/32 of the float32 segment, plus the one-byte non-finite flag."""
    d = N * 8 * 1000
    grads = jax.random.normal(jax.random.key(4), (2, N, d))
    tx = jaxcomm.marsit("data", local_lr=0.1, global_lr=0.01, full_sync_every=100)
    _, state = run_tx(mesh8, tx, grads, jnp.zeros((N, d)))
    dense = 2 * (N - 1) * (d // N) * 4
    flags = 2 * (N - 1)
    assert int(as_bytes(state.log.sent_bytes)[0]) == dense // 32 + flags


def test_marsit_bad_arguments():
    with pytest.raises(ValueError, match=r"full_sync_every must be an integer in \[1, inf\]"):
        jaxcomm.marsit("data", local_lr=0.1, global_lr=0.1, full_sync_every=0)
    with pytest.raises(ValueError, match=r"global_lr must be a finite number in \(0.0, inf\]"):
        jaxcomm.marsit("data", local_lr=0.1, global_lr=-1.0, full_sync_every=2)
    with pytest.raises(ValueError, match=r"local_lr must be"):
        jaxcomm.marsit("data", local_lr=0.0, global_lr=0.1, full_sync_every=2)
    with pytest.raises(ValueError, match=r"topology must be one of \('ring', 'torus'\)"):
        jaxcomm.marsit("data", local_lr=0.1, global_lr=0.1, full_sync_every=2, topology="mesh")
    with pytest.raises(ValueError, match=r"needs axis_name=\(row_axis, col_axis\)"):
        jaxcomm.marsit("data", local_lr=0.1, global_lr=0.1, full_sync_every=2, topology="torus")


def test_marsit_in_optax_chain(mesh8, run_tx):
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        jaxcomm.marsit("data", local_lr=0.1, global_lr=0.01, full_sync_every=2),
    )
    grads = jax.random.normal(jax.random.key(5), (2, N, 10))
    upd, _ = run_tx(mesh8, tx, grads, jnp.zeros((N, 10)))
    assert np.all(np.isfinite(np.asarray(upd)))


def test_marsit_torus_rounds():
    """On a 2x4 torus: round 0 equals the dense average, round 1 is identical +-global_lr."""
    mesh = jax.make_mesh((2, 4), ("row", "col"))
    d = 37
    grads = jax.random.normal(jax.random.key(6), (2, 2, 4, d))
    tx = jaxcomm.marsit(
        ("row", "col"), local_lr=0.5, global_lr=0.01, full_sync_every=4, topology="torus"
    )

    def per_worker(g):
        p = jnp.zeros(d)
        state, outs = tx.init(p), []
        for t in range(2):
            u, state = tx.update(g[t, 0, 0], state, p)
            outs.append(u)
        return jnp.stack(outs)[None, None], jax.tree_util.tree_map(lambda a: a[None, None], state)

    spec = P(None, "row", "col")
    f = jax.shard_map(per_worker, mesh=mesh, in_specs=spec, out_specs=P("row", "col"))
    upd, state = jax.jit(f)(jax.device_put(grads, NamedSharding(mesh, spec)))
    upd = np.asarray(upd).reshape(N, 2, d)
    np.testing.assert_allclose(
        upd[:, 0],
        np.broadcast_to(-0.5 * np.asarray(grads[0]).reshape(N, d).mean(0), (N, d)),
        atol=1e-6,
    )
    assert np.all(upd[:, 1] == upd[:1, 1]) and np.allclose(np.abs(upd[:, 1]), 0.01)
    # Row ring: 2 segments of 19 bits -> 3 bytes, 2 hops; column ring: 1-byte pieces, 6 hops;
    # every hop message also carries the one-byte non-finite flag.
    assert np.all(as_bytes(state.log.sent_bytes) == 2 * 1 * (3 + 1) + 2 * 3 * (1 + 1))
    # Costed as it runs: 2 (r - 1) + 2 (c - 1) rounds, not the 2 (N - 1) of an 8-ring.
    assert np.all(np.asarray(state.log.rounds).sum(-1) == 2 * 1 + 2 * 3)


def test_merge_keys_differ_on_every_torus_device():
    """Each device of a 2x4 torus merges with its own key: with one key per row (shared by
    the columns, as a key folded with the row index alone would be), columns holding the
    same signs would draw the same noise."""
    from jaxcomm._src.marsit import _device_key

    mesh = jax.make_mesh((2, 4), ("row", "col"))

    def f(key):
        return jax.random.key_data(_device_key(key, ("row", "col")))[None, None]

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P("row", "col")))
    keys = np.asarray(g(jax.random.key(0))).reshape(N, -1)
    assert len({tuple(k) for k in keys}) == N
