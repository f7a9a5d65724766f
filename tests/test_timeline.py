"""GPipe's timeline: hand-computed schedules, closed forms, and the pipeline trainer's step."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxcomm
from jaxcomm._src.network import Network
from train.config import Config
from train.trainer import Trainer


def test_two_stages_two_microbatches_by_hand():
    # Stage 0: f=1, b=2; stage 1: f=2, b=4; forward message 3 s, backward 1 s.
    # With overlap (sends beside compute):
    #   forward  s0: m0 0-1, m1 1-2; link: m0 1-4, m1 4-7
    #            s1: m0 4-6, m1 7-9
    #   backward s1: m1 9-13, m0 13-17; link: m1 13-14, m0 17-18
    #            s0: m1 14-16, m0 18-20                                  -> 20 s
    line = jaxcomm.pipeline.gpipe_timeline(2, 2, [1, 2], [2, 4], 3, 1, overlap=True)
    assert line.seconds == 20
    np.testing.assert_array_equal(line.forward[0], [[0, 1], [1, 2]])
    np.testing.assert_array_equal(line.forward[1], [[4, 6], [7, 9]])
    np.testing.assert_array_equal(line.backward[1], [[13, 17], [9, 13]])
    np.testing.assert_array_equal(line.backward[0], [[18, 20], [14, 16]])
    # Without overlap a send blocks its stage until delivered:
    #   forward  s0: m0 0-1 (send 1-4), m1 4-5 (send 5-8); s1: m0 4-6, m1 8-10
    #   backward s1: m1 10-14 (send 14-15), m0 15-19 (send 19-20)
    #            s0: m1 15-17, m0 20-22                                  -> 22 s
    line = jaxcomm.pipeline.gpipe_timeline(2, 2, [1, 2], [2, 4], 3, 1)
    assert line.seconds == 22
    np.testing.assert_array_equal(line.forward[0], [[0, 1], [4, 5]])
    np.testing.assert_array_equal(line.backward[0], [[20, 22], [15, 17]])


@settings(max_examples=60, deadline=None)
@given(
    stages=st.integers(1, 6),
    micro=st.integers(1, 9),
    f=st.floats(0.0, 2.0),
    b=st.floats(0.0, 4.0),
    tf=st.floats(0.0, 3.0),
    tb=st.floats(0.0, 3.0),
)
def test_equal_stages_follow_the_closed_forms(stages, micro, f, b, tf, tb):
    if stages == 1:
        tf = tb = 0.0
    lockstep = (micro + stages - 1) * (f + b) + (micro + stages - 2) * (tf + tb)
    got = jaxcomm.pipeline.gpipe_timeline(stages, micro, f, b, tf, tb).seconds
    assert got == pytest.approx(lockstep, rel=1e-9, abs=1e-9)
    # With overlap the slower of compute and link sets the pace after the first message.
    fill = (stages - 1) * (f + tf + b + tb) + f + b
    steady = (micro - 1) * (max(f, tf) + max(b, tb))
    got = jaxcomm.pipeline.gpipe_timeline(stages, micro, f, b, tf, tb, overlap=True).seconds
    assert got == pytest.approx(fill + steady, rel=1e-9, abs=1e-9)


def test_the_slowest_stage_sets_the_pace():
    fast = jaxcomm.pipeline.gpipe_timeline(4, 16, [1, 1, 1, 1], [2, 2, 2, 2]).seconds
    slow = jaxcomm.pipeline.gpipe_timeline(4, 16, [1, 1, 3, 1], [2, 2, 2, 2]).seconds
    assert slow >= fast + 15 * 2  # 16 microbatches through a stage 2 s slower each


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="forward_s must be one number or 3"):
        jaxcomm.pipeline.gpipe_timeline(3, 2, [1, 2], 1)
    with pytest.raises(ValueError, match="backward_transfer_s"):
        jaxcomm.pipeline.gpipe_timeline(3, 2, 1, 1, 0, -1)
    with pytest.raises(ValueError, match="microbatches"):
        jaxcomm.pipeline.gpipe_timeline(3, 0, 1, 1)


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    cfg = Config(
        name="tl",
        task="gpt",
        model={"num_layers": 4, "width": 64, "num_heads": 2, "seq_len": 32},
        workers=2,
        stages=4,
        microbatches=4,
        global_batch=16,
        boundary="directq",
        fw_bits=2,
        bw_bits=4,
        compute="v100",
        progress=False,
        checkpoint_every=0,
        out_dir=str(tmp_path_factory.mktemp("tl")),
    )
    return Trainer(cfg, abstract=True)


def test_trainer_step_follows_the_gpipe_timeline_per_stage(trainer):
    cfg = trainer.cfg
    s, m = cfg.stages, cfg.microbatches
    ticks = m + s - 1
    f, b, rest = trainer.layout.clock.tick_seconds(trainer.ctx, False)
    # The program counts each stage conditional at its costliest branch on every device
    # (an upper bound); the ticks take the input function out where it does not run (every
    # stage but 0) and the loss (every stage but the last, and its bubble ticks there).
    whole = trainer.ctx.modelled_per_device(False)
    assert (ticks * (f + b) + rest <= whole * (1 + 1e-9)).all()
    assert (ticks * (f + b) + rest >= 0.5 * whole).all()
    np.testing.assert_allclose(f[:s], f[s:])  # the two replicas alike
    np.testing.assert_allclose([f[1], b[1]], [f[2], b[2]])  # middle stages: blocks alone
    assert f[3] > f[1] and b[3] > b[1] and f[0] > f[1] and b[0] > b[1]
    # One loss per microbatch on the last stage, one embedding per tick on stage 0: the
    # difference to a middle stage over the ticks is the roofline of those ops as the
    # program counts them (on every tick, at the costliest branch; compute-bound here).
    from jaxcomm._src.pipeline import FIRST_SCOPE, LAST_SCOPE

    cost = jaxcomm.audit.program_cost(trainer.step_programs(False)[0][0])

    def scoped(scope, backward):
        def select(op):
            part = "transpose(" in op if backward else ("jvp(" in op and "transpose(" not in op)
            return scope in op and part

        return trainer.compute_model.seconds(cost.per_device(select=select))

    head_f, head_b = scoped(LAST_SCOPE, False)[3], scoped(LAST_SCOPE, True)[3]
    assert ticks * (f[3] - f[1]) == pytest.approx(head_f, rel=1e-6)
    assert ticks * (b[3] - b[1]) == pytest.approx(head_b, rel=1e-6)
    assert ticks * (f[0] - f[1]) == pytest.approx(scoped(FIRST_SCOPE, False)[0], rel=1e-6)
    # The program's own compute runs the loss on the M ticks that carry a microbatch only.
    busy = trainer.layout.clock.tick_busy(trainer.ctx, False)
    np.testing.assert_allclose(busy[:3], ticks * (f + b)[:3], rtol=1e-9)
    extra = (ticks - m) * (head_f + head_b) / ticks
    assert busy[3] == pytest.approx(ticks * (f[3] + b[3]) - extra, rel=1e-6)
    assert (f > 0).all() and (b > 0).all()
    assert 1.5 < b[1] / f[1] < 3.5  # a backward costs about two forwards
    # Every matmul of the step is in the forward or the backward (the optimizer has none).
    cost = jaxcomm.audit.program_cost(trainer.step_programs(False)[0][0])
    in_ticks = cost.per_device(select=lambda op: "jvp(" in op or op == "").matmul_flops
    np.testing.assert_allclose(in_ticks, cost.per_device().matmul_flops, rtol=1e-3)
    network = Network(latency_s=2e-3, bandwidth_bps=1e8)
    traffic = trainer.step_audit(False)
    fw_msg, bw_msg = jaxcomm.pipeline.boundary_message_bytes(
        jaxcomm.pipeline.directq_boundary(2, 4),
        __import__("jax").ShapeDtypeStruct((2, 32, 64), np.float32),
        False,
    )
    tf = 2e-3 + fw_msg * 8 / 1e8
    tb = 2e-3 + bw_msg * 8 / 1e8
    # The data-parallel part: what the busiest device sends beyond the pipeline messages.
    rounds = traffic.rounds - 2 * (ticks - 1)
    path = traffic.path_bytes - (ticks - 1) * (fw_msg + bw_msg)
    dp = np.max(rounds * 2e-3 + path * 8 / 1e8)

    # By hand, from the parameter counts: each stage's blocks are averaged over the two
    # replicas by a ring (2 rounds, 2 (N - 1) ceil(d / N) floats), stage 0's embedding and
    # the last stage's head likewise, and the loss is shared by a 4-byte psum over the
    # stages (2 (S - 1) rounds of one float).
    def count(tree, lead=2):
        return sum(int(np.prod(a.shape[lead:])) for a in jax.tree_util.tree_leaves(tree))

    def ring(d):
        return 2, 2 * (cfg.workers - 1) * -(-d // cfg.workers) * 4

    by_stage = []
    for stage in range(s):
        r, p = ring(count(trainer.params["blocks"]))
        r, p = r + 2 * (s - 1), p + 2 * (s - 1) * 4
        for name, owner in (("embed", 0), ("head", s - 1)):
            if stage == owner:
                dr, dpath = ring(count(trainer.params[name]))
                r, p = r + dr, p + dpath
        by_stage.append(r * 2e-3 + p * 8 / 1e8)
    assert dp == pytest.approx(max(by_stage), rel=1e-9)
    r0 = rest.max()
    # The stages differ (the first and last carry the input function and the loss), so the
    # step is the event timeline (checked against hand-computed schedules above) of the
    # per-stage tick seconds, plus the rest and the data-parallel part.
    for overlap in (False, True):
        line = jaxcomm.pipeline.gpipe_timeline(s, m, f[:s], b[:s], tf, tb, overlap=overlap).seconds
        step, compute, comm = trainer.simulate_step(False, traffic, network, 0, overlap=overlap)
        assert step == pytest.approx(line + r0 + dp, rel=1e-9)
    # Each stage runs M forwards and M backwards; the slowest one bounds the step.
    step, compute, comm = trainer.simulate_step(False, traffic, network, 0, overlap=False)
    assert step >= m * (f.max() + b.max()) + r0 + dp
    # A slow link makes overlap matter: the transfers hide the compute, not the reverse.
    slow = Network(latency_s=2e-3, bandwidth_bps=1e6)
    with_overlap, _, _ = trainer.simulate_step(False, traffic, slow, 0, overlap=True)
    without, compute, comm = trainer.simulate_step(False, traffic, slow, 0, overlap=False)
    assert max(compute, comm) <= with_overlap < without


def test_a_slow_stage_slows_the_pipeline_as_the_timeline_says(trainer):
    cfg = trainer.cfg
    s, m = cfg.stages, cfg.microbatches
    network = Network(latency_s=1e-3, bandwidth_bps=1e9)
    traffic = trainer.step_audit(False)
    base, _, _ = trainer.simulate_step(False, traffic, network, 0)
    f, b, rest = trainer.layout.clock.tick_seconds(trainer.ctx, False)
    # Device 2 (replica 0, stage 2) runs at half speed.
    trainer.stragglers = jaxcomm.network.Stragglers(seed=3, slow={2: 2.0})
    try:
        slow, compute, _ = trainer.simulate_step(False, traffic, network, 0)
    finally:
        trainer.stragglers = None
    assert compute == pytest.approx(2 * (m + s - 1) * (f[2] + b[2]) + 2 * rest[2])
    fw_msg, bw_msg = trainer.layout.clock.message_bytes(False)
    factor = np.ones(s)
    factor[2] = 2.0
    line = jaxcomm.pipeline.gpipe_timeline(
        s,
        m,
        f[:s] * factor,
        b[:s] * factor,
        1e-3 + fw_msg * 8e-9,
        1e-3 + bw_msg * 8e-9,
    ).seconds
    rounds = traffic.rounds - 2 * (m + s - 2)
    path = traffic.path_bytes - (m + s - 2) * (fw_msg + bw_msg)
    dp = np.max(rounds * 1e-3 + path * 8e-9)
    assert slow == pytest.approx(line + max(rest[0], 2 * rest[2], rest[1], rest[3]) + dp)
    assert slow > base


def test_per_message_backward_times_by_hand():
    """S = 3, M = 2, f = b = 1, forward messages free; backward messages differ per link
    and microbatch: link 2 -> 1 takes 3 s for microbatch 1 and 0 for 0, link 1 -> 0 takes
    0 s for microbatch 1 and 4 s for microbatch 0. Forwards: stage 0 [0,1] [1,2], stage 1
    [1,2] [2,3], stage 2 [2,3] [3,4]. Backwards (microbatch 1 first): stage 2 [4,5] sends
    mb 1 to stage 1, arriving 8 (and blocking stage 2 until then), then mb 0 [8,9] arriving
    9; stage 1 (free at 4): mb 1 [8,9] arriving at stage 0 at 9, mb 0 [9,10] arriving 14;
    stage 0 (free at 2): mb 1 [9,10], mb 0 [14,15]. All messages free: (M + S - 1)(f + b) = 8."""
    tb = [[0.0, 0.0], [0.0, 0.0]]  # [link s+1 -> s for s = 0, 1][microbatch]
    tb[1][1] = 3.0  # link 2 -> 1, microbatch 1
    tb[0][0] = 4.0  # link 1 -> 0, microbatch 0
    line = jaxcomm.pipeline.gpipe_timeline(3, 2, 1.0, 1.0, 0.0, tb)
    assert line.seconds == 15.0
    assert jaxcomm.pipeline.gpipe_timeline(3, 2, 1.0, 1.0, 0.0, 0.0).seconds == 8.0


def test_per_message_transfer_times_by_hand():
    """One slow message on the critical path: S = 2, M = 2, f = b = 1, every message free
    except microbatch 1's forward message (5 s). Stage 0: forwards [0, 1], [1, 2], its
    send of microbatch 1 delivered at 7 (blocking it); stage 1: forwards [1, 2], [7, 8],
    backwards [8, 9], [9, 10]; stage 0: backwards [9, 10], [10, 11]. Uniform: 6 s."""
    fast = jaxcomm.pipeline.gpipe_timeline(2, 2, 1.0, 1.0, 0.0, 0.0)
    slow = jaxcomm.pipeline.gpipe_timeline(2, 2, 1.0, 1.0, [[0.0, 5.0]], 0.0)
    assert fast.seconds == 6.0 and slow.seconds == 11.0
    same = jaxcomm.pipeline.gpipe_timeline(2, 2, 1.0, 1.0, [[0.5, 0.5]], 0.25)
    assert same.seconds == jaxcomm.pipeline.gpipe_timeline(2, 2, 1.0, 1.0, 0.5, 0.25).seconds
    with pytest.raises(ValueError, match=r"\[1, 2\]"):
        jaxcomm.pipeline.gpipe_timeline(2, 2, 1.0, 1.0, [[0.0, 1.0, 2.0]], 0.0)


def test_message_latencies_are_seeded_per_message():
    from jaxcomm._src.network import Network, Stragglers

    net = Network(1e-3, 1e9)
    s = Stragglers(seed=3, latency_jitter=0.5)
    a = s.message_latencies(7, (2, 3, 4), net)
    assert a.shape == (2, 3, 4) and np.all(a >= 1e-3) and len(np.unique(a)) == a.size
    np.testing.assert_array_equal(
        a, Stragglers(seed=3, latency_jitter=0.5).message_latencies(7, (2, 3, 4), net)
    )
    assert not np.array_equal(a, s.message_latencies(8, (2, 3, 4), net))
    # Exp(1) draws: the mean extra latency over many messages is jitter * alpha.
    many = s.message_latencies(0, (200_000,), net)
    assert abs(many.mean() / 1e-3 - 1.5) < 0.01
    np.testing.assert_array_equal(Stragglers().message_latencies(0, (3,), net), [1e-3] * 3)


def test_the_pipeline_step_draws_each_message_latency(trainer):
    """With latency jitter the trainer's step is the timeline of each replica with each
    boundary message's own drawn latency."""
    cfg = trainer.cfg
    s, m, w = cfg.stages, cfg.microbatches, cfg.workers
    network = Network(latency_s=2e-3, bandwidth_bps=1e8)
    traffic = trainer.step_audit(False)
    f, b, rest = trainer.layout.clock.tick_seconds(trainer.ctx, False)
    fw_msg, bw_msg = trainer.layout.clock.message_bytes(False)
    trainer.stragglers = jaxcomm.network.Stragglers(seed=5, latency_jitter=1.0)
    try:
        step, _, _ = trainer.simulate_step(False, traffic, network, 3, overlap=False)
        lat = trainer.stragglers.message_latencies(3, (w, 2, s - 1, m), network)
        lines = []
        for r in range(w):
            idx = r * s + np.arange(s)
            line = jaxcomm.pipeline.gpipe_timeline(
                s, m, f[idx], b[idx], lat[r, 0] + fw_msg * network.beta, lat[r, 1] + bw_msg * 8e-8
            )
            lines.append(line.seconds + rest[idx].max())
        rounds = traffic.rounds - 2 * (m + s - 2)
        path = traffic.path_bytes - (m + s - 2) * (fw_msg + bw_msg)
        busy = int(np.argmax(rounds * 2e-3 + path * 8e-8))
        other = trainer.stragglers.round_latency(3, int(rounds[busy]), w, network, stream=1)
        assert step == pytest.approx(max(lines) + other + path[busy] * 8e-8, rel=1e-9)
        uniform = jaxcomm.pipeline.gpipe_timeline(s, m, f[:s], b[:s], 2e-3 + fw_msg * 8e-8, 2e-3)
        assert max(lines) > uniform.seconds  # the jitter only delays
    finally:
        trainer.stragglers = None
