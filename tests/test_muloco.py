"""MuLoCo's pieces: the statistical quantizer, its error-fed all-gather aggregator and the
Muon inner optimizer, each against an independent numpy reference or property."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxcomm

N = 8


def _stat_reference(x, bits, sigmas, sizes):
    """MuLoCo's statistical quantizer written out per segment with numpy (float64 stats)."""
    levels = 2**bits
    out, at = np.empty(len(x), np.float64), 0
    for size in sizes:
        seg = np.asarray(x[at : at + size], np.float64)
        mean = seg.mean()
        std = seg.std(ddof=1) if size > 1 else 0.0
        width = sigmas * std / levels
        if width > 0:
            q = np.clip(np.round((seg - mean) / width + levels / 2), 0, levels - 1)
        else:
            q = np.full(size, levels // 2)
        for c in range(levels):
            hit = q == c
            if hit.any():
                out[at : at + size][hit] = seg[hit].mean()
        at += size
    return out


@settings(max_examples=8, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 200), min_size=1, max_size=4),
    bits=st.sampled_from([1, 2, 4, 8]),
    seed=st.integers(0, 2**16),
    heavy=st.booleans(),
)
def test_stat_quantize_matches_the_reference(sizes, bits, seed, heavy):
    rng = np.random.default_rng(seed)
    d = sum(sizes)
    x = (rng.standard_t(2, d) if heavy else rng.normal(size=d)).astype(np.float32) * 0.01
    p = jaxcomm.codecs.stat_quantize(jnp.asarray(x), bits=bits, sizes=tuple(sizes))
    got = np.asarray(jaxcomm.codecs.stat_dequantize(p))
    want = _stat_reference(x, bits, 6.0, sizes)
    # Bin means agree to float32 rounding; a value within rounding of a bin edge may fall
    # either side, so compare the codes' values where both sides agree on the bin.
    close = np.isclose(got, want, rtol=1e-4, atol=1e-7)
    assert close.mean() > 0.98, (got[~close][:5], want[~close][:5])
    # Wire: the packed codes and one float32 table entry per code value and segment.
    assert jaxcomm.codecs.payload_bytes(p) == -(-d * bits // 8) + 4 * (2**bits) * len(sizes)
    assert p.codes.dtype == jnp.uint8 and p.table.dtype == jnp.float32


def test_stat_quantize_two_bits_at_six_sigmas_and_a_nan():
    x = np.random.default_rng(1).normal(size=10_000).astype(np.float32)
    p = jaxcomm.codecs.stat_quantize(jnp.asarray(x), bits=2)
    table = np.asarray(p.table[0])
    # Bins 1.5 sigma wide, the mean's bin centred: edges at -2.25, -0.75 and 0.75 sigma.
    # Each code decodes to its bin's mean, for a normal E[x | a < x < b] =
    # (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)).
    pdf = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))  # noqa: E731
    edges = [-math.inf, -2.25, -0.75, 0.75, math.inf]
    want = [
        (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges[:-1], edges[1:], strict=True)
    ]  # about -2.60, -1.26, 0, 1.33
    np.testing.assert_allclose(table, want, atol=0.06)
    dec = np.asarray(jaxcomm.codecs.stat_dequantize(p))
    # Each bin's reconstruction is its values' mean: the error sums to zero over each bin.
    codes = np.searchsorted((table[1:] + table[:-1]) / 2, dec)
    for c in range(4):
        assert abs((x[codes == c] - dec[codes == c]).sum()) < 1e-2
    bad = x.copy()
    bad[1234] = np.nan
    two = jaxcomm.codecs.stat_quantize(jnp.asarray(bad), bits=2, sizes=(5000, 5000))
    out = np.asarray(jaxcomm.codecs.stat_dequantize(two))
    assert np.all(np.isnan(out[:5000])) and np.all(np.isfinite(out[5000:]))


def test_stat_quantize_refuses_bad_input():
    x = jnp.ones(10)
    with pytest.raises(ValueError, match="bits"):
        jaxcomm.codecs.stat_quantize(x, bits=9)
    with pytest.raises(ValueError, match="sigmas"):
        jaxcomm.codecs.stat_quantize(x, sigmas=0.0)
    with pytest.raises(ValueError, match="sizes must be positive element counts summing to 10"):
        jaxcomm.codecs.stat_quantize(x, sizes=(4, 5))
    with pytest.raises(ValueError, match="1-D floating"):
        jaxcomm.codecs.stat_quantize(jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="decay"):
        jaxcomm.statistical_quantized("data", decay=1.5)


def test_the_aggregator_as_a_user_calls_it_averages_what_each_worker_sent():
    """Replicated parameters into shard_map, each worker's own gradient by
    ``jaxcomm.worker_grad``: the update is the mean of the workers' decoded payloads, each
    payload the reference quantization of ``decay * e + g``, and ``e`` keeps the rest."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:N]), ("data",))
    params = {"w": jnp.linspace(-1.0, 1.0, 21).reshape(3, 7), "b": jnp.zeros(5)}
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(N, 4, 7)).astype(np.float32))
    tx = jaxcomm.statistical_quantized("data", bits=2, decay=0.9)

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"].T).sum(-1) ** 2) + jnp.sum(p["b"] ** 2 * x[0, :5])

    def steps(params, xs):
        state = tx.init(params)
        outs = []
        for _ in range(2):
            g = jaxcomm.worker_grad(loss, "data")(params, xs[0])
            u, state = tx.update(g, state)
            outs.append((u, g, state.residual))
        return outs

    run = jax.jit(jax.shard_map(steps, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
    outs = run(params, xs)
    sizes = (5, 21)  # tree order: b, w
    e = np.zeros((N, 26))
    for u, g, residual in outs:
        flat_g = np.concatenate(
            [np.asarray(g["b"]).reshape(N, -1), np.asarray(g["w"]).reshape(N, -1)], 1
        )
        e = 0.9 * e + flat_g
        sent = np.stack([_stat_reference(e[w].astype(np.float32), 2, 6.0, sizes) for w in range(N)])
        want = sent.mean(0)
        got = np.concatenate(
            [np.asarray(u["b"]).reshape(N, -1), np.asarray(u["w"]).reshape(N, -1)], 1
        )
        for w in range(N):
            np.testing.assert_allclose(got[w], want, rtol=2e-4, atol=1e-6)
        e = e - sent
        np.testing.assert_allclose(np.asarray(residual).reshape(N, -1), e, rtol=2e-4, atol=1e-6)


def test_muon_steps_the_hidden_matrices_and_adamw_the_rest():
    """``optimizer: muon``: Muon's orthogonalised step on the blocks' kernels (its singular
    values all near ``muon_lr`` times the shape factor), AdamW on the embeddings, the head,
    biases and norms (an Adam step: ``lr`` times the sign of the gradient at step 1)."""
    from train.config import Config
    from train.sync import make_optimizer

    cfg = Config(optimizer="muon", lr=1e-3, muon_lr=0.02)
    rng = np.random.default_rng(0)
    params = {
        "embed": {"tok": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32)},
        "block_0": {
            "fc": {
                "kernel": jnp.asarray(rng.normal(size=(8, 32)), jnp.float32),
                "bias": jnp.zeros(32),
            }
        },  # fmt: skip
        "head": {"out": {"kernel": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)}},
    }
    grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
    tx = make_optimizer(cfg)
    updates, _ = tx.update(grads, tx.init(params), params)
    for path in (("embed", "tok"), ("head", "out", "kernel"), ("block_0", "fc", "bias")):
        u, g = updates, grads
        for key in path:
            u, g = u[key], g[key]
        # Adam's first step: m_hat / sqrt(v_hat) = g / |g|.
        np.testing.assert_allclose(np.asarray(u), -1e-3 * np.sign(np.asarray(g)), rtol=1e-3)
    step = np.asarray(updates["block_0"]["fc"]["kernel"])
    sv = np.linalg.svd(step, compute_uv=False)
    # Five Newton-Schulz steps leave singular values within ~0.3 of 1 (times the scale).
    assert sv.max() / sv.min() < 2.0 and 0.01 < sv.mean() < 0.1
    with pytest.raises(ValueError, match="muon_lr=0.05 with optimizer 'adam'"):
        Config(optimizer="adam", muon_lr=0.05)
    with pytest.raises(ValueError, match="optimizer muon with stages=2"):
        Config(optimizer="muon", stages=2, workers=4, global_batch=16)
