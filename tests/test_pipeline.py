"""GPipe pipeline over a stage axis: equal to the unpipelined model, bytes, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm._src.aqsgd import fp32_encode
from jaxcomm._src.collectives import psum_wire
from jaxcomm._src.pipeline import Boundary, BoundaryState, pipeline_ticks
from models import GPTConfig, build_task
from train.pipeline import gpt_pipeline_loss, stage_params

L, M, MB, T, W = 8, 3, 2, 16, 32
CFG = GPTConfig(num_layers=L, width=W, num_heads=2, seq_len=T)


def _setup():
    task = build_task("gpt", num_layers=L, width=W, num_heads=2, seq_len=T)
    tokens = jax.random.randint(jax.random.key(0), (M * MB, T + 1), 0, 256)
    params = task.init(jax.random.key(1, impl="rbg"), {"tokens": tokens})
    return task, tokens, params


_COMPILED: dict = {}


def _run(num_stages, params, tokens, boundary=None, state=None, seen=False, grad=None):
    """One pipelined loss and gradient. Checks the logged traffic of every device against the
    wire audit of the compiled program, and returns ``(loss, grads, state, log)``."""
    mesh = jax.make_mesh((num_stages,), ("stage",), devices=jax.devices()[:num_stages])
    loss_fn = gpt_pipeline_loss(CFG, boundary=boundary)
    if state is None:
        zeros = np.zeros((num_stages, M, MB, T, W), np.float32)
        memory = boundary is not None and boundary.bw_memory
        state = BoundaryState(zeros, zeros, *((zeros, zeros) if memory else ()))

    def per_device(p, inputs, st):
        p, st = jax.tree_util.tree_map(lambda a: a[0], (p, st))
        value_and_grad = grad or jaxcomm.pipeline.gpipe_value_and_grad
        (loss, (st, log)), grads = value_and_grad(loss_fn)(p, inputs, st, jax.random.key(2), seen)
        return loss, jax.tree_util.tree_map(lambda a: a[None], (grads, st, log))

    f = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(P("stage"), P(), P("stage")),
        out_specs=(P(), P("stage")),
        check_vma=False,
    )
    sharded = NamedSharding(mesh, P("stage"))
    sp = jax.device_put(stage_params(params, CFG, num_stages), sharded)
    st = jax.device_put(state, sharded)
    args = (sp, {"tokens": tokens.reshape(M, MB, T + 1)}, st)
    # A test runs the same program at several states: compiled once (the boundary and the
    # gradient rule are kept in the entry, so their ids stay theirs).
    shapes = jax.tree_util.tree_map(lambda a: (a.shape, a.dtype), args)
    key = (num_stages, id(boundary), id(grad), seen, str(shapes))
    if key not in _COMPILED:
        _COMPILED[key] = (jax.jit(f).lower(*args).compile(), boundary, grad)
    compiled = _COMPILED[key][0]
    loss, (grads, state, log) = compiled(*args)
    log = jax.device_get(log)
    audit = jaxcomm.wire_audit(compiled).traffic()
    np.testing.assert_array_equal(jaxcomm.network.as_bytes(log.sent_bytes).ravel(), audit.sent)
    np.testing.assert_array_equal(log.rounds.sum(-1), audit.rounds)
    np.testing.assert_array_equal(
        jaxcomm.network.as_bytes(log.path_bytes).sum(-1), audit.path_bytes
    )
    return float(loss), jax.device_get(grads), jax.device_get(state), log


def _p2p_sent(log, num_stages):
    """Point-to-point bytes each stage sent (all it sent, less the loss's 4-byte psum)."""
    loss_psum = psum_wire(jnp.zeros((), jnp.float32), num_stages).sent[0]
    return list(jaxcomm.network.as_bytes(log.sent_bytes).ravel() - loss_psum)


def _expect(num_stages, fw, bw):
    """Per-stage bytes: ``fw`` forward from all but the last, ``bw`` back from all but the
    first, over the ``M`` microbatches; nothing on bubble ticks."""
    return [M * (fw * (s < num_stages - 1) + bw * (s > 0)) for s in range(num_stages)]


FP32_MSG = MB * T * W * 4


@pytest.mark.parametrize("num_stages", [2, 4, 8])
def test_fp32_pipeline_equals_unpipelined_model(num_stages):
    task, tokens, params = _setup()
    ref_loss, ref_grads = jax.value_and_grad(lambda p: task.loss(p, {"tokens": tokens})[0])(params)
    loss, grads, state, log = _run(num_stages, params, tokens)
    assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    k = L // num_stages
    for s in range(num_stages):
        for j in range(k):
            got = jax.tree_util.tree_map(lambda a, s=s, j=j: a[s][j], grads["blocks"])
            for a, b in zip(
                jax.tree_util.tree_leaves(got),
                jax.tree_util.tree_leaves(ref_grads[f"block_{s * k + j}"]),
                strict=True,
            ):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for name, stage in (("embed", 0), ("head", num_stages - 1)):
        for a, b in zip(
            jax.tree_util.tree_leaves(grads[name]),
            jax.tree_util.tree_leaves(ref_grads[name]),
            strict=True,
        ):
            np.testing.assert_allclose(a[stage], b, rtol=1e-4, atol=1e-6)
    # Every microbatch's activation crosses each boundary once, in float32, and so does its
    # gradient back; the last stage sends nothing forward and the first nothing back.
    assert _p2p_sent(log, num_stages) == _expect(num_stages, FP32_MSG, FP32_MSG)
    # One round per tick that carries a message, each way: M + S - 2 ticks of M + S - 1.
    p2p = jaxcomm.network.KINDS.index("p2p")
    assert list(log.rounds[:, p2p]) == [2 * (M + num_stages - 2)] * num_stages
    # Both sides of each boundary hold the same messages.
    for s in range(num_stages - 1):
        np.testing.assert_array_equal(state.prev_out[s], state.prev_in[s + 1])


def test_quantized_backward_changes_gradients_but_not_loss():
    _, tokens, params = _setup()
    fp32 = jaxcomm.pipeline.fp32_boundary()
    q = Boundary(encode=fp32.encode, decode=fp32.decode, bw_bits=4)
    loss_a, grads_a, *_ = _run(4, params, tokens)
    loss_b, grads_b, _, log = _run(4, params, tokens, boundary=q)
    q_msg = MB * T * (W * 4 // 8 + 4)  # 4-bit codes + one scale per token
    assert _p2p_sent(log, 4) == _expect(4, FP32_MSG, q_msg)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(grads_a["blocks"])])
    b = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(grads_b["blocks"])])
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert 0 < rel < 0.5  # quantized, yet close: the 4-bit gradient is unbiased noise


def test_stage_count_must_divide_layers():
    _, _, params = _setup()
    with pytest.raises(ValueError, match="num_stages must divide num_layers=8, got num_stages=3"):
        stage_params(params, CFG, 3)


@pytest.mark.parametrize("fw_bits", [2, 8])
def test_aqsgd_pipeline_first_visit_exact_then_deltas(fw_bits):
    """Step 1 (no sample seen) equals FP32; step 2 sends quantized deltas that both sides
    of every boundary reconstruct identically, at the byte count of the formula."""
    _, tokens, params = _setup()
    aq = jaxcomm.pipeline.aqsgd_boundary(fw_bits, 8)
    loss_fp, _, st_fp, _ = _run(4, params, tokens)
    loss_1, _, st_1, log_1 = _run(4, params, tokens, boundary=aq)
    assert loss_1 == pytest.approx(loss_fp, rel=1e-6)
    np.testing.assert_array_equal(st_1.prev_out, st_fp.prev_out)
    bw_msg = MB * T * (W + 4)  # 8-bit codes + one scale per token
    assert _p2p_sent(log_1, 4) == _expect(4, FP32_MSG, bw_msg)
    # Step 2 with slightly moved parameters: every sample is seen now.
    moved = jax.tree_util.tree_map(lambda a: a * 1.01, params)
    loss_ref, _, st_ref, _ = _run(4, moved, tokens)
    loss_2, _, st_2, log_2 = _run(4, moved, tokens, boundary=aq, state=st_1, seen=True)
    for s in range(3):
        np.testing.assert_array_equal(st_2.prev_out[s], st_2.prev_in[s + 1])
    row = -(-W * fw_bits // 8) + 4  # codes of one token row + its scale: nothing else
    assert _p2p_sent(log_2, 4) == _expect(4, MB * T * row, bw_msg)
    # First boundary (no upstream error): within one grid step of the change's range.
    err0 = np.abs(st_2.prev_out[0] - st_ref.prev_out[0]).max()
    delta0 = np.abs(st_ref.prev_out[0] - st_1.prev_out[0]).max()
    assert 0 < err0 <= 2 * delta0 / (2**fw_bits - 1) + 1e-6
    # Quantizing the change beats quantizing the activation (DirectQ) at the same bits.
    _, _, st_dq, _ = _run(4, moved, tokens, boundary=jaxcomm.pipeline.directq_boundary(fw_bits, 8))
    err_aq = np.abs(st_2.prev_out[:3] - st_ref.prev_out[:3]).mean()
    err_dq = np.abs(st_dq.prev_out[:3] - st_ref.prev_out[:3]).mean()
    assert err_aq < err_dq / 3
    tol = 0.05 if fw_bits == 2 else 0.005
    assert loss_2 == pytest.approx(loss_ref, rel=tol)


def test_directq_pipeline_bytes():
    _, tokens, params = _setup()
    loss, _, _, log = _run(2, params, tokens, boundary=jaxcomm.pipeline.directq_boundary(4, None))
    assert np.isfinite(loss)
    assert _p2p_sent(log, 2) == _expect(2, MB * T * (W * 4 // 8 + 4), FP32_MSG)


@pytest.mark.parametrize("microbatches,stages", [(1, 1), (1, 4), (3, 4), (4, 2), (8, 3)])
def test_tick_runs_cover_the_schedule(microbatches, stages):
    runs = pipeline_ticks(microbatches, stages)
    assert runs[0][0] == 0 and runs[-1][1] == microbatches + stages - 1
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:], strict=False))
    for start, stop, senders in runs:
        for t in range(start, stop):
            assert senders == tuple(s for s in range(stages - 1) if 0 <= t - s < microbatches)
    assert runs[-1][2] == ()  # the last tick sends nothing
    assert len(runs) <= 2 * stages - 1


def _regression(boundary, steps=300):
    """A two-stage regression fine-tuned full-batch through :func:`jaxcomm.pipeline.gpipe`, the same
    32 samples every step (so every step after the first revisits them all)."""
    kx, kw, k1, k2 = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (1, 32, 8))
    y = jnp.sin(x @ jax.random.normal(kw, (8, 2)))
    w0, w1 = 0.5 * jax.random.normal(k1, (8, 16)), 0.5 * jax.random.normal(k2, (16, 2))
    params = {"w0": jnp.stack([w0, w0]), "w1": jnp.stack([w1, w1])}
    loss_fn = jaxcomm.pipeline.gpipe(
        lambda p, mb: jnp.tanh(mb["x"] @ p["w0"]),
        lambda p, h: h,
        lambda p, h, mb: jnp.mean((h @ p["w1"] - mb["y"]) ** 2),
        boundary=boundary,
    )
    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])

    def per_device(params):
        p = jax.tree_util.tree_map(lambda a: a[0], params)
        zeros = jnp.zeros((1, 32, 16))

        def step(seen):
            def body(carry, key):
                p, st = carry
                grad = jax.grad(loss_fn, has_aux=True)
                g, (st, _) = grad(p, {"x": x, "y": y}, st, key, seen)
                return (jax.tree_util.tree_map(lambda a, b: a - 0.2 * b, p, g), st), None

            return body

        keys = jax.random.split(jax.random.key(1), steps)
        carry, _ = step(False)((p, BoundaryState(zeros, zeros)), keys[0])
        (p, _), _ = jax.lax.scan(step(True), carry, keys[1:])
        loss, _ = loss_fn(p, {"x": x, "y": y}, BoundaryState(zeros, zeros), keys[0])
        return loss

    f = jax.shard_map(per_device, mesh=mesh, in_specs=P("stage"), out_specs=P(), check_vma=False)
    params = jax.device_put(params, NamedSharding(mesh, P("stage")))
    return float(jax.jit(f)(params))


def test_training_aqsgd_tracks_fp32_where_directq_drifts():
    pipe = jaxcomm.pipeline
    fp32 = _regression(pipe.fp32_boundary())
    aq8 = _regression(pipe.aqsgd_boundary(8, 8))
    aq2 = _regression(pipe.aqsgd_boundary(2, 8))
    dq2 = _regression(pipe.directq_boundary(2, 8))
    assert aq8 == pytest.approx(fp32, rel=1e-2)
    assert aq2 == pytest.approx(fp32, rel=5e-2)
    assert dq2 > 5 * fp32


def test_seen_must_be_static_and_state_must_fit():
    _, tokens, params = _setup()
    aq = jaxcomm.pipeline.aqsgd_boundary(2, 8)
    # A NumPy bool is as static as a Python one: the same program, the same bytes.
    first = _run(2, params, tokens, boundary=aq, seen=np.False_)
    assert _p2p_sent(first[3], 2) == _p2p_sent(_run(2, params, tokens, boundary=aq)[3], 2)
    with pytest.raises(TypeError, match="seen must be a static bool.*got int"):
        _run(2, params, tokens, boundary=aq, seen=1)
    wrong = np.zeros((2, M, MB, T, W + 1), np.float32)
    with pytest.raises(ValueError, match=r"state.prev_in must have shape .*\(3, 2, 16, 32\)"):
        _run(2, params, tokens, boundary=aq, state=BoundaryState(wrong, wrong))


def test_forward_rounding_noise_differs_at_every_stage_and_microbatch():
    """Each transfer draws its own key: a boundary that stores its key's uniforms as the new
    message shows no two (stage, microbatch) pairs sharing noise (a per-row or per-column
    key reused across the schedule would)."""
    _, tokens, params = _setup()

    def encode(a, prev, key, seen):
        return fp32_encode(a), jax.random.uniform(key, a.shape)

    noisy = Boundary(encode, jaxcomm.pipeline.fp32_boundary().decode)
    _, _, st, _ = _run(4, params, tokens, boundary=noisy)
    draws = st.prev_out[:3].reshape(3 * M, -1)  # stages that send, every microbatch
    assert np.unique(draws[:, :8], axis=0).shape[0] == 3 * M
    corr = np.corrcoef(draws)
    assert np.abs(corr[~np.eye(3 * M, dtype=bool)]).max() < 0.2  # 1,024 draws: sd 0.03


def test_sparse_delta_boundary_sends_its_payloads_both_ways():
    """Top-k deltas forward (first visits at 4 bits), top-k gradients back: the compiled
    program sends exactly what is logged (``_run`` checks the audit), at the documented byte
    counts, both sides of every boundary agree, and a seen step's loss stays near FP32's."""
    _, tokens, params = _setup()
    fw, bw = jaxcomm.pipeline.topk_rows(64, 4, bits=4), jaxcomm.pipeline.topk_rows(32, 2, bits=4)
    sparse = jaxcomm.pipeline.delta_boundary(fw, bw, first=jaxcomm.pipeline.quantized_rows(4))
    n = T * W  # elements of one sample
    q4_row = n * 4 // 8 + 4 * T  # 4-bit codes + one scale per token
    fw_row = -(-(n // 64) * 4 * 6 // 8) + (n // 64) * 4 * 4 // 8 + 4 * (n // 64)
    bw_row = -(-(n // 32) * 2 * 5 // 8) + (n // 32) * 2 * 4 // 8 + 4 * (n // 32)
    _, _, st_1, log_1 = _run(4, params, tokens, boundary=sparse)
    assert _p2p_sent(log_1, 4) == _expect(4, MB * q4_row, MB * bw_row)
    moved = jax.tree_util.tree_map(lambda a: a * 1.01, params)
    loss_ref, _, st_ref, _ = _run(4, moved, tokens)
    loss_2, grads_2, st_2, log_2 = _run(4, moved, tokens, boundary=sparse, state=st_1, seen=True)
    assert _p2p_sent(log_2, 4) == _expect(4, MB * fw_row, MB * bw_row)
    assert FP32_MSG / (MB * fw_row) > 15 and FP32_MSG / (MB * bw_row) > 12
    for s in range(3):
        np.testing.assert_array_equal(st_2.prev_out[s], st_2.prev_in[s + 1])
    # The buffer moved towards the new activations (by what was sent, no further).
    before = np.abs(st_1.prev_out[0] - st_ref.prev_out[0]).mean()
    after = np.abs(st_2.prev_out[0] - st_ref.prev_out[0]).mean()
    assert after < before
    assert loss_2 == pytest.approx(loss_ref, rel=0.05)
    assert all(np.isfinite(a).all() for a in jax.tree_util.tree_leaves(grads_2))


def test_training_with_sparse_deltas_tracks_fp32():
    """The two-stage regression with a quarter of each delta sent (the buffer keeps the rest)
    ends near FP32's loss; sending a quarter of the activation itself (no buffer) does not."""
    pipe = jaxcomm.pipeline
    fp32 = _regression(pipe.fp32_boundary())
    sparse = _regression(pipe.delta_boundary(jaxcomm.pipeline.topk_rows(8, 2, bits=8)))
    direct = pipe.Boundary(
        encode=lambda a, prev, key, seen: (
            payload := jaxcomm.pipeline.topk_rows(8, 2, bits=8).encode(a, key),
            jaxcomm.pipeline.topk_rows(8, 2, bits=8).decode(payload),
        ),
        decode=lambda payload, prev: jaxcomm.pipeline.topk_rows(8, 2, bits=8).decode(payload),
    )
    assert sparse == pytest.approx(fp32, rel=0.1)
    assert _regression(direct) > 10 * fp32


def test_lowrank_delta_boundary_sends_its_factors_both_ways():
    """Rank-2 deltas forward, rank-1 gradients back, 8-bit factors: audited = logged (in
    ``_run``), the documented bytes, both sides agree."""
    _, tokens, params = _setup()
    low = jaxcomm.pipeline.delta_boundary(
        jaxcomm.pipeline.lowrank_rows(2), jaxcomm.pipeline.lowrank_rows(1)
    )

    def row(r):  # 8-bit factors [T, r] and [r, W], a float32 scale per factor column/row
        return r * T + r * W + 8 * r

    _, _, st_1, log_1 = _run(4, params, tokens, boundary=low)
    assert _p2p_sent(log_1, 4) == _expect(4, FP32_MSG, MB * row(1))
    moved = jax.tree_util.tree_map(lambda a: a * 1.01, params)
    loss_ref, _, _, _ = _run(4, moved, tokens)
    loss_2, _, st_2, log_2 = _run(4, moved, tokens, boundary=low, state=st_1, seen=True)
    assert _p2p_sent(log_2, 4) == _expect(4, MB * row(2), MB * row(1))
    for s in range(3):
        np.testing.assert_array_equal(st_2.prev_out[s], st_2.prev_in[s + 1])
    assert loss_2 == pytest.approx(loss_ref, rel=0.05)


def _relative_error(grads, ref, stage):
    a, b = jax.tree_util.tree_leaves(grads["blocks"]), jax.tree_util.tree_leaves(ref["blocks"])
    num = sum(float(((x[stage] - y[stage]) ** 2).sum()) for x, y in zip(a, b, strict=True))
    return np.sqrt(num / sum(float((y[stage] ** 2).sum()) for y in b))


def test_backward_memory_sends_what_the_gradient_codec_dropped_at_later_visits():
    """Top-k gradients with a per-sample gradient memory, at fixed parameters: the first
    visit is the plain top-k backward (same gradients, bit for bit); each later visit sends
    the top-k of what the memory lacks, so the gradients close in on FP32's (below 0.6x the
    first visit's error after three more), where without the memory they stay as far as at
    the first visit. Both sides' memories are equal, the wire carries only the top-k
    payloads (``_run`` audits), and a NaN reaches the update."""
    _, tokens, params = _setup()
    fw, bw = jaxcomm.pipeline.quantized_rows(8), jaxcomm.pipeline.topk_rows(32, 4, bits=8)
    plain = jaxcomm.pipeline.delta_boundary(fw, bw)
    memory = jaxcomm.pipeline.delta_boundary(fw, bw, backward_memory=True)
    _, ref, _, _ = _run(4, params, tokens)
    _, g_plain, st_plain, _ = _run(4, params, tokens, boundary=plain)
    _, g, st, log = _run(4, params, tokens, boundary=memory)
    jax.tree_util.tree_map(np.testing.assert_array_equal, g, g_plain)
    n = T * W
    bw_row = -(-(n // 32) * 4 * 5 // 8) + (n // 32) * 4 + 4 * (n // 32)
    assert _p2p_sent(log, 4) == _expect(4, FP32_MSG, MB * bw_row)
    first = [_relative_error(g, ref, s) for s in range(3)]
    for _ in range(3):
        _, g, st, log = _run(4, params, tokens, boundary=memory, state=st, seen=True)
        for s in range(3):
            np.testing.assert_array_equal(st.grad_out[s], st.grad_in[s + 1])
        assert not st.grad_in[0].any() and not st.grad_out[3].any()
    assert _p2p_sent(log, 4) == _expect(4, MB * (n + 4 * T), MB * bw_row)  # 8-bit deltas
    later = [_relative_error(g, ref, s) for s in range(3)]
    _, g_plain, _, _ = _run(4, params, tokens, boundary=plain, state=st_plain, seen=True)
    stays = [_relative_error(g_plain, ref, s) for s in range(3)]
    assert all(b < 0.6 * a for a, b in zip(first, later, strict=True)), (first, later)
    assert all(c > 0.9 * a for a, c in zip(first, stays, strict=True)), (first, stays)
    poisoned = np.array(st.grad_out)
    poisoned[1, 0, 0, 0, 0] = np.nan  # a NaN in stage 1's memory of boundary 1
    bad = st._replace(grad_out=poisoned)
    _, g_bad, _, _ = _run(4, params, tokens, boundary=memory, state=bad, seen=True)
    assert np.isnan(jax.tree_util.tree_leaves(g_bad["blocks"])[0][1]).any()


def test_backward_memory_needs_a_codec_and_a_state():
    with pytest.raises(ValueError, match="needs a backward codec"):
        jaxcomm.pipeline.delta_boundary(jaxcomm.pipeline.quantized_rows(2), backward_memory=True)
    memory = jaxcomm.pipeline.delta_boundary(
        jaxcomm.pipeline.quantized_rows(2), jaxcomm.pipeline.quantized_rows(4), backward_memory=True
    )
    with pytest.raises(ValueError, match="bw_memory=True needs a compressed backward"):
        Boundary(encode=None, decode=None, bw_memory=True)
    _, tokens, params = _setup()
    zeros = np.zeros((2, M, MB, T, W), np.float32)
    with pytest.raises(ValueError, match="state.grad_in is None"):
        _run(2, params, tokens, boundary=memory, state=BoundaryState(zeros, zeros))
    # jax.value_and_grad would leave the memory as it was: refused, naming the way.
    plain = lambda f: jax.value_and_grad(f, has_aux=True)  # noqa: E731
    with pytest.raises(ValueError, match=r"with jaxcomm.pipeline.gpipe_value_and_grad\(loss_fn\)"):
        _run(2, params, tokens, boundary=memory, grad=plain)
    # A memory given to a boundary without one passes through untouched.
    ones = np.ones((2, M, MB, T, W), np.float32)
    _, _, st, _ = _run(2, params, tokens, state=BoundaryState(zeros, zeros, ones, ones))
    assert (st.grad_in == 1).all() and (st.grad_out == 1).all()
