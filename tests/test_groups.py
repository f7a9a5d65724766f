"""jaxcomm.groups.GroupOuter: DiLoCo's outer step between separate programs, against the
one-program jaxcomm.diloco and against numpy."""

import concurrent.futures
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomm
from jaxcomm.codecs import ChunkTopKCodec, QuantizeCodec, StatQuantizeCodec

SHAPES = {"a": (6, 5), "b": (7,)}


def _flat(tree):
    return np.concatenate([np.asarray(tree[k], np.float32).reshape(-1) for k in sorted(tree)])


@pytest.mark.parametrize("outer", ["sgd", "nesterov"])
def test_equals_one_program_diloco(outer):
    """Two groups' host outer step gives the theta_sync that jaxcomm.diloco gives two
    workers of one program (a user's shard_map, per-worker gradients), over three periods."""
    n, inner_lr, period = 2, 0.1, 2
    rng = np.random.default_rng(0)
    p0 = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    # Per-worker, per-step gradients (the same for both paths).
    grads = {k: rng.normal(size=(3 * period, n, *s)).astype(np.float32) for k, s in SHAPES.items()}
    make_outer = {
        "sgd": lambda: optax.sgd(1.0),
        "nesterov": lambda: optax.sgd(0.7, momentum=0.9, nesterov=True),
    }[outer]

    tx = jaxcomm.diloco(optax.sgd(inner_lr), "data", period=period, outer=make_outer())
    mesh = jax.make_mesh((n,), ("data",))

    def per_worker(p, g):
        g = jax.tree_util.tree_map(lambda v: v[:, 0], g)
        state = tx.init(p)
        anchors = []
        for t in range(3 * period):
            u, state = tx.update(jax.tree_util.tree_map(lambda v, t=t: v[t], g), state, p)
            p = optax.apply_updates(p, u)
            anchors.append(state.anchor)
        return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *anchors)

    run = jax.shard_map(per_worker, mesh=mesh, in_specs=(P(), P(None, "data")), out_specs=P())
    sharded = jax.device_put(grads, jax.sharding.NamedSharding(mesh, P(None, "data")))
    want = jax.jit(run)(p0, sharded)

    go = jaxcomm.groups.GroupOuter(make_outer())
    state = go.init(_flat(p0))
    local = [dict(p0) for _ in range(n)]
    for t in range(3 * period):
        for w in range(n):
            local[w] = {k: local[w][k] - inner_lr * grads[k][t, w] for k in SHAPES}
        if (t + 1) % period == 0:
            payloads = []
            for w in range(n):
                payload, state_w, _ = go.send(state, _flat(local[w]))
                payloads.append(go.from_wire(go.to_wire(payload), payload.size))
            state = go.step(state, go.mean(payloads, [7, 7]))
            flat = state.anchor
            sizes = [int(np.prod(SHAPES[k])) for k in sorted(SHAPES)]
            parts = np.split(flat, np.cumsum(sizes)[:-1])
            merged = {k: v.reshape(SHAPES[k]) for k, v in zip(sorted(SHAPES), parts, strict=True)}
            local = [dict(merged) for _ in range(n)]
        np.testing.assert_allclose(
            state.anchor, _flat({k: want[k][t] for k in SHAPES}), rtol=0, atol=2e-6
        )


def test_token_weighted_mean_and_member_order():
    go = jaxcomm.groups.GroupOuter()
    d = [np.full(4, 1.0, np.float32), np.full(4, 5.0, np.float32)]
    np.testing.assert_allclose(go.mean(d, [1, 3]), np.full(4, 4.0), rtol=1e-6)
    np.testing.assert_array_equal(go.mean(d, [2, 2]), np.full(4, 3.0, np.float32))


@pytest.mark.parametrize(
    "codec",
    [QuantizeCodec(8, 512, stochastic=False), QuantizeCodec(4, 64), ChunkTopKCodec(64, 4, 2),
     StatQuantizeCodec(2, 6.0)],
    ids=["int8", "int4-stochastic", "chunk_topk", "statistical"],
)  # fmt: skip
def test_wire_round_trip_and_error_feedback(codec):
    """The packed bytes decode to the same payload; nothing is lost to the error feedback:
    what was sent plus the residual is the sum of the pseudo-gradients."""
    d = 1000
    go = jaxcomm.groups.GroupOuter(codec=codec, sizes=(600, 400))
    rng = np.random.default_rng(1)
    state = go.init(np.zeros(d, np.float32), slot=3)
    total_delta = np.zeros(d, np.float64)
    total_sent = np.zeros(d, np.float64)
    for _ in range(4):
        local = rng.normal(size=d).astype(np.float32)
        payload, state, _ = go.send(state, local)
        wire = go.to_wire(payload)
        assert wire.dtype == np.uint8 and wire.size == go.nbytes(d)
        back = go.from_wire(wire, d)
        np.testing.assert_array_equal(go.mean([back], [1]), go.mean([payload], [1]))
        total_delta += state.anchor - local
        total_sent += go.mean([back], [1])
    np.testing.assert_allclose(total_sent + state.residual, total_delta, atol=1e-4)
    assert go.nbytes(d) < 4 * d // 3  # far below float32


def test_keyed_codec_draws_per_group_and_unsent_keeps_the_error_feedback():
    go = jaxcomm.groups.GroupOuter(codec=QuantizeCodec(2, 32))
    x = np.linspace(-1, 1, 64).astype(np.float32)
    a, b = go.init(np.zeros(64, np.float32), slot=0), go.init(np.zeros(64, np.float32), slot=1)
    pa, _, _ = go.send(a, x)
    pb, sent, unsent = go.send(b, x)
    assert not np.array_equal(go.to_wire(pa), go.to_wire(pb))
    # Nothing delivered: the error feedback as it was, the key moved on.
    np.testing.assert_array_equal(unsent.residual, b.residual)
    np.testing.assert_array_equal(unsent.key, sent.key)
    assert not np.array_equal(unsent.key, b.key)


@pytest.mark.parametrize(
    "codec", [QuantizeCodec(8, 512, stochastic=False), ChunkTopKCodec(64, 4, 2)],
    ids=["int8", "chunk_topk"],
)  # fmt: skip
def test_an_undelivered_exchange_is_sent_once_at_the_next(codec):
    """An exchange that fails moves neither theta_sync nor the local fragment, so the next
    pseudo-gradient holds its drift again: what the group sends over the failed exchange
    and the next, plus its error feedback, is the drift once, as if the first never ran."""
    d = 256
    go = jaxcomm.groups.GroupOuter(codec=codec)
    rng = np.random.default_rng(2)
    state = go.init(np.zeros(d, np.float32))
    local = rng.normal(size=d).astype(np.float32)
    _, _, unsent = go.send(state, local)  # the exchange failed: keep `unsent`
    payload, after, _ = go.send(unsent, local)  # no further drift
    once, alone, _ = go.send(state, local)  # the same exchange, never failed before
    np.testing.assert_allclose(go.decode(payload) + after.residual, -local, atol=1e-6)
    np.testing.assert_array_equal(go.to_wire(payload), go.to_wire(once))
    np.testing.assert_array_equal(after.residual, alone.residual)


def test_non_finite_reaches_the_mean():
    go = jaxcomm.groups.GroupOuter(codec=QuantizeCodec(8, 16, stochastic=False))
    state = go.init(np.zeros(32, np.float32))
    bad = np.ones(32, np.float32)
    bad[3] = np.nan
    p, _, _ = go.send(state, bad)
    assert not np.all(np.isfinite(go.mean([p], [1])))


def test_merge_is_streaming_diloco_mixing():
    local, anchor = np.full(3, 2.0, np.float32), np.full(3, 4.0, np.float32)
    np.testing.assert_array_equal(jaxcomm.groups.GroupOuter.merge(local, anchor, 0.25), 3.5)
    np.testing.assert_array_equal(jaxcomm.groups.GroupOuter.merge(local, anchor, 0.0), anchor)


def test_bad_input_names_the_argument():
    go = jaxcomm.groups.GroupOuter()
    with pytest.raises(ValueError, match="anchor must be a flat float32"):
        go.init(np.zeros((2, 2), np.float32))
    state = go.init(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="local must be a flat float32"):
        go.send(state, np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="tokens must be positive"):
        go.mean([np.zeros(4, np.float32)], [0])
    with pytest.raises(ValueError, match="one token count per payload"):
        go.mean([np.zeros(4, np.float32)], [1, 2])
    with pytest.raises(ValueError, match="decay"):
        jaxcomm.groups.GroupOuter(decay=1.5)
    with pytest.raises(ValueError, match="a payload of d=4 is 16 bytes"):
        go.from_wire(np.zeros(3, np.uint8), 4)
    with pytest.raises(TypeError, match="codec must be"):
        jaxcomm.groups.GroupOuter(codec="int8")


def test_left_out_rules_are_the_same_for_every_member():
    """Every member decides from the gathered headers alone: another run, a repeated slot,
    no tokens, a non-finite pseudo-gradient, another fragment or another theta_sync."""
    from train.replica import FIELDS, left_out, payload_width

    def row(slot, tokens=8, fp=7, finite=1, fragment=0, anchor=11, nbytes=4):
        v = {"slot": slot, "tokens": tokens, "nbytes": nbytes, "fingerprint": fp,
             "finite": finite,
             "step": 5, "healed": 0, "fragment": fragment, "anchor": anchor,
             "id": 100 + slot}  # fmt: skip
        return [v[f] for f in FIELDS]

    h = np.asarray([row(0), row(1, fp=9), row(0), row(2, tokens=0), row(3, finite=0),
                    row(4, fragment=1), row(5, anchor=12), row(6), row(7, nbytes=2**40)],
                   np.int64)  # fmt: skip
    out = left_out(h)
    assert out == {
        1: "another run's settings",
        2: "slot 0 twice",
        3: "no tokens",
        4: "non-finite pseudo-gradient",
        5: "fragment 1, not 0",
        6: "another theta_sync",
        8: f"a payload of {2**40} bytes, not 4",
    }
    # The payload all-gather's width is the kept members' size: a header's claim of a
    # terabyte sets nothing.
    assert payload_width(h, out) == 4
    assert payload_width(h[[3]], left_out(h[[3]])) == 0  # nobody to gather from
    # Member order does not change who is left out (without the repeated slot, whose
    # first row is the one kept).
    rows = np.delete(h, 2, axis=0)
    slots = rows[:, FIELDS.index("slot")]
    want = {int(slots[i]): why for i, why in left_out(rows).items()}
    perm = [6, 2, 0, 4, 1, 5, 3, 7]
    got = {int(slots[perm][i]): why for i, why in left_out(rows[perm]).items()}
    assert got == want and len(want) == 6
    # Two groups that disagree on theta_sync: the smallest slot's wins, the other heals.
    assert left_out(np.asarray([row(1, anchor=3), row(0, anchor=4)], np.int64)) == {
        0: "another theta_sync"
    }


def test_group_config_errors_name_the_setting():
    from train.config import load_config

    base = ["groups.lighthouse=http://127.0.0.1:1", "groups.count=2", "workers=1",
            "aggregator=ring"]  # fmt: skip
    cfg = "configs/diloco_default.yaml"
    with pytest.raises(ValueError, match="groups.slot must be in 0..count-1 = 0..1, got 2"):
        load_config(cfg, [*base, "groups.slot=2"])
    with pytest.raises(ValueError, match="groups needs sync.method=diloco"):
        load_config("configs/dp_default.yaml", [*base, "groups.slot=0"])
    with pytest.raises(ValueError, match="closest; choose overlap < 15"):
        load_config(cfg, [*base, "groups.slot=0", "sync.fragments=2", "sync.overlap=15"])
    with pytest.raises(ValueError, match="compress 'ar_topk'"):
        load_config(cfg, [*base, "groups.slot=0", "sync.compress=ar_topk"])
    with pytest.raises(ValueError, match="address http://host:port"):
        load_config(cfg, [*base, "groups.slot=0", "groups.lighthouse=localhost:29510"])
    with pytest.raises(ValueError, match="stages=2 and boundary aqsgd: its per-sample"):
        load_config(cfg, [*base, "groups.slot=0", "stages=2", "boundary=aqsgd"])
    assert load_config(cfg, [*base, "groups.slot=0", "stages=2"]).stages == 2
    ok = load_config(cfg, [*base, "groups.slot=1", "sync.compress=int8"])
    codec, decay = ok.sync.compress.error_fed_codec()
    assert codec.bits == 8 and not codec.stochastic and decay == 1.0


def _group_trainer(tmp_path, *extra):
    """A trainer of group 0 of 2 (a small GPT, one worker unless ``extra`` says otherwise),
    built in this process with no lighthouse: its part is driven by hand."""
    from train.config import load_config
    from train.trainer import Trainer

    sets = ["groups.lighthouse=http://127.0.0.1:1", "groups.slot=0", "groups.count=2",
            "workers=1", "aggregator=ring", "global_batch=8", "model.num_layers=1",
            "model.width=16", "compute=measured", f"out_dir={tmp_path}", *extra]  # fmt: skip
    return Trainer(load_config("configs/diloco_default.yaml", sets))


def test_a_pipeline_groups_outer_step_reads_replica_0_and_writes_every_replica_and_stage(
    tmp_path,
):
    """On a group of 2 pipeline replicas of 2 stages, a fragment's vector is the model's own
    layout (replica 0, stages joined): setting it writes every replica and every stage's
    copy, reading it back gives it bit for bit, and the other fragments are untouched."""
    from train.pipeline import unstage_params

    trainer = _group_trainer(
        tmp_path, "workers=2", "stages=2", "model.num_layers=2", "sync.fragments=2"
    )
    part, params = trainer.sync, trainer.params
    before = [part._flat(params, p) for p in range(2)]
    assert sum(b.size for b in before) == trainer.ctx.layout.num_params(trainer.ctx)
    new = before[1] + np.arange(before[1].size, dtype=np.float32)
    out = part._with(params, 1, new)
    np.testing.assert_array_equal(part._flat(out, 1), new)
    np.testing.assert_array_equal(part._flat(out, 0), before[0])
    gpt = trainer.ctx.layout.gpt_cfg
    host = jax.tree_util.tree_map(np.asarray, out)
    for name in ("blocks", "embed", "head"):  # every stage's copy, the same on each replica
        for k, a in jax.tree_util.tree_leaves_with_path(host[name]):
            np.testing.assert_array_equal(a[0], a[1], err_msg=jax.tree_util.keystr(k))
    for name in ("embed", "head"):
        for k, a in jax.tree_util.tree_leaves_with_path(host[name]):
            np.testing.assert_array_equal(a[0, 0], a[0, 1], err_msg=jax.tree_util.keystr(k))
    one = unstage_params(jax.tree_util.tree_map(lambda a: a[1], host), gpt)
    flat = np.concatenate(
        [np.asarray(a, np.float32).reshape(-1) for a in jax.tree_util.tree_leaves(one)]
    )
    np.testing.assert_array_equal(np.sort(flat), np.sort(np.concatenate([before[0], new])))


class _FakeTransport:
    """Two members: this group and a peer whose pseudo-gradient holds a NaN."""

    committed, retries = 1, 3

    def __init__(self, peer_payload, finite, nbytes=None):
        self.peer_payload, self.finite = peer_payload, finite
        self.nbytes = peer_payload.size if nbytes is None else nbytes
        self.errors = []

    def exchange(self, header, payload, *, commit=None):
        from train.replica import FIELDS, Exchange, left_out

        mine = np.asarray(header(False), np.int64)
        peer = mine.copy()
        peer[FIELDS.index("slot")] = 1
        peer[FIELDS.index("finite")] = self.finite
        peer[FIELDS.index("id")] += 1
        peer[FIELDS.index("nbytes")] = self.nbytes
        headers = np.stack([mine, peer])
        data = [np.asarray(payload(False), np.uint8), self.peer_payload]
        committed = commit is None or commit(headers, False)
        return Exchange(headers, data, left_out(headers), healed=False, committed=committed,
                        sent_bytes=0, tries=1)  # fmt: skip


@pytest.mark.parametrize("finite", [0, 1])
def test_a_nan_from_a_peer_is_refused(tmp_path, finite):
    """A peer whose pseudo-gradient holds a NaN is left out, whether its header says so or
    claims it finite (every member checks the decoded values): theta_sync takes this
    group's step alone and stays finite, and the reason is logged."""

    trainer = _group_trainer(tmp_path, "sync.outer_lr=1.0", "sync.outer_momentum=0")
    part = trainer.sync
    go, before = part.outer[0], part.state[0]
    local = np.asarray(before.anchor) - 0.5
    bad = np.full(np.size(local), np.nan, np.float32)
    part.transport = _FakeTransport(go.to_wire(bad), finite)
    info = part._exchange(0, local, tokens=8, step=1)
    after = part.state[0].anchor
    assert {k: info[k] for k in ("members", "kept")} == {"members": 2, "kept": 1}
    assert "failed" not in info and info["encode_s"] >= 0 and info["outer_s"] >= 0
    np.testing.assert_array_equal(after, local)  # outer SGD 1.0 on its own delta
    line = json.loads((tmp_path / "exchanges.jsonl").read_text().splitlines()[-1])
    assert line["kept"] == [0]
    why = "non-finite values" if finite else "non-finite pseudo-gradient"
    assert line["left_out"] == {"1": why}


def test_a_peers_payload_of_another_size_is_left_out(tmp_path):
    """A peer whose header claims another payload size than the fragment's is left out by
    every member from the headers alone (its claim of a terabyte, not the 28 bytes it
    sent): theta_sync takes this group's step alone."""
    trainer = _group_trainer(tmp_path, "sync.outer_lr=1.0", "sync.outer_momentum=0")
    part = trainer.sync
    go, before = part.outer[0], part.state[0]
    local = np.asarray(before.anchor) - 0.5
    part.transport = _FakeTransport(go.to_wire(np.zeros(7, np.float32)), 1, nbytes=2**40)
    info = part._exchange(0, local, tokens=8, step=1)
    assert {k: info[k] for k in ("members", "kept")} == {"members": 2, "kept": 1}
    np.testing.assert_array_equal(part.state[0].anchor, local)
    line = json.loads((tmp_path / "exchanges.jsonl").read_text().splitlines()[-1])
    want = f"a payload of {2**40} bytes, not {go.nbytes(np.size(local))}"
    assert line["left_out"] == {"1": want}


def test_the_payload_gather_has_the_kept_members_width_whatever_a_header_claims():
    """Transport.exchange sizes the payload all-gather from the gathered headers' kept
    members: a peer's header claiming a terabyte makes no member allocate or send it, the
    peer is left out, and this group's payload comes back whole."""
    import threading

    from train.replica import FIELDS, Transport

    class Manager:  # torchft's Manager, as one quorum of two members that commits
        def start_quorum(self, allow_heal):
            pass

        def errored(self):
            return None

        def report_error(self, e):
            raise AssertionError(f"the try failed: {e!r}")

        def should_commit(self):
            return True

    t = object.__new__(Transport)
    t.manager, t._healed, t.retries, t.errors, t.sent_bytes = (
        Manager(),
        threading.Event(),
        0,
        [],
        0,
    )
    sent = []
    payload = np.arange(40, dtype=np.uint8)
    mine = np.zeros(len(FIELDS), np.int64)
    mine[[FIELDS.index("tokens"), FIELDS.index("nbytes"), FIELDS.index("finite")]] = (8, 40, 1)

    def gather(data):
        sent.append(data.size)
        other = data.copy()
        if len(sent) == 1:  # the headers
            other[FIELDS.index("slot")], other[FIELDS.index("id")] = 1, 1
            other[FIELDS.index("nbytes")] = 2**40
        return np.stack([data, other])

    t._gather = gather
    ex = t.exchange(lambda healed: mine, lambda healed: payload)
    assert sent == [len(FIELDS), 40]
    assert ex.out == {1: f"a payload of {2**40} bytes, not 40"} and ex.committed
    np.testing.assert_array_equal(ex.payloads[0], payload)


def test_a_heal_from_another_runs_peer_is_refused_naming_it(tmp_path):
    """The live state a peer offers carries its run's fingerprint: another run's is refused
    (inside torchft's quorum, so that try fails and nothing is installed)."""
    trainer = _group_trainer(tmp_path)
    part, ctx = trainer.sync, trainer.ctx
    part._snapshot(ctx)
    offered = {**part._state_dict(), "fingerprint": part.fp + 1}
    with pytest.raises(ValueError, match="group 0: the live state offered by a peer is another"):
        part._on_heal(offered)
    assert part._heal is None


def test_a_lighthouse_on_a_port_in_use_is_one_clear_error():
    import socket

    pytest.importorskip("torchft")

    from train.replica import lighthouse

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        bind = f"127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(OSError, match=f"the lighthouse cannot listen on {bind} .*in use"):
            lighthouse(bind, 1, grace_ms=100, heartbeat_ms=1000)


def test_a_group_whose_own_pseudo_gradient_is_not_finite_commits_nothing(tmp_path, capsys):
    """A group whose own pseudo-gradient is not finite is left out by every member, and it
    does not commit the exchange: it falls behind by one, so that torchft heals it from a
    peer at the next (committed, its non-finite state would leave it out of every later
    exchange, never healed). Its fragment's state stays as it was, and it says so."""
    trainer = _group_trainer(tmp_path)
    part = trainer.sync
    go, before = part.outer[0], part.state[0]
    local = np.asarray(before.anchor).copy()
    local[3] = np.nan
    part.transport = _FakeTransport(go.to_wire(np.zeros(np.size(local), np.float32)), 1)
    info = part._exchange(0, local, tokens=8, step=1)
    assert info["failed"] and part.stats["left_out"] == 1
    np.testing.assert_array_equal(part.state[0].anchor, before.anchor)
    np.testing.assert_array_equal(part.state[0].residual, before.residual)
    assert "left out of the exchange of fragment 0 at step 1 (non-finite" in capsys.readouterr().err


class _HealThenFail:
    """An exchange in which the group is healed by a peer (torchft's ``load_state_dict``)
    and then every later try fails: nothing is returned (``peer=None``: no heal)."""

    committed, retries = 7, 3

    def __init__(self, part, peer):
        self.part, self.peer = part, peer
        self.errors = []

    def exchange(self, header, payload, *, commit=None):
        if self.peer is not None:
            self.part._on_heal(self.peer)
        self.errors.append("RuntimeError: a member was lost")
        return None


def test_a_heal_whose_exchange_then_fails_is_still_taken(tmp_path, capsys):
    """torchft moves a healed group's count to the peer's even when every later try of the
    exchange fails: the group then takes the peer's state (theta_sync, outer state, and at
    the merge its parameters, step and data position) with no outer step and no merge, so
    it holds what its count says; it is not left with its own state under the peer's
    count."""
    trainer = _group_trainer(tmp_path, "steps=60", "sync.overlap=2")
    part, ctx = trainer.sync, trainer.ctx
    part._ctx, part._row = ctx, {}
    ctx.step = 5
    part._snapshot(ctx)
    peer = part._state_dict()
    peer["anchors"] = [np.asarray(a) + 2.0 for a in peer["anchors"]]
    peer["params"] = jax.tree_util.tree_map(lambda a: np.asarray(a) + 1.0, peer["params"])
    peer.update(step=40, position=321, last_sync={0: 40})
    part.transport = _HealThenFail(part, peer)
    local = np.asarray(part.state[0].anchor) - 0.5
    info = part._exchange(0, local, tokens=8, step=5)
    assert info["failed"] and info["healed"] and part.stats["failed"] == 1
    for st, a in zip(part.state, peer["anchors"], strict=True):
        np.testing.assert_array_equal(st.anchor, a)
        np.testing.assert_array_equal(st.residual, np.zeros_like(a))
    assert "failed in every try (4; last: RuntimeError: a member was lost)" in (
        capsys.readouterr().err
    )
    done = concurrent.futures.Future()
    done.set_result(info)
    part._pending = [(0, 7, done)]
    part._settle()  # as an evaluation or a checkpoint waits: the heal's merge stays due
    assert part._pending == [(0, 7, None)]
    ctx.step = 7
    part._merge_due(ctx)
    assert ctx.step == 40 and ctx.loader.position == 321 and part._pending == []
    got = jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.asarray, ctx.params))
    for a, b in zip(got, jax.tree_util.tree_leaves(peer["params"]), strict=True):
        np.testing.assert_array_equal(a, b)
    # A heal left over from an earlier exchange is never taken by a later one that fails.
    part._heal = peer
    part.transport = _HealThenFail(part, None)
    before = [np.asarray(st.anchor) for st in part.state]
    info = part._exchange(0, np.asarray(before[0]) - 0.5, tokens=8, step=41)
    assert info["failed"] and "healed" not in info and part._healed_state is None
    for st, a in zip(part.state, before, strict=True):
        np.testing.assert_array_equal(st.anchor, a)


def test_an_unreachable_lighthouse_is_one_clear_error(tmp_path):
    pytest.importorskip("torchft")
    from train.config import load_config
    from train.launch import free_port
    from train.trainer import Trainer

    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sets = [f"groups.lighthouse={address}", "groups.slot=0", "groups.count=2",
            "groups.connect_timeout_s=1", "workers=1", "aggregator=ring", "global_batch=8",
            "model.num_layers=1", "model.width=16", f"out_dir={tmp_path}"]  # fmt: skip
    trainer = Trainer(load_config("configs/diloco_default.yaml", sets))
    with pytest.raises(ConnectionError, match=r"group 0: no lighthouse at groups.lighthouse="):
        trainer.sync._connect()


def test_the_time_lost_per_failure_runs_from_the_kill_to_the_groups_next_exchange(tmp_path):
    from train.groups import lost_per_failure

    folder = tmp_path / "group_1"
    folder.mkdir()
    times = [10.0, 20.0, 47.5, 60.0]  # exchanges before the kill, then its heal at 47.5 s
    (folder / "exchanges.jsonl").write_text(
        "".join(json.dumps({"exchange": i, "time": t}) + "\n" for i, t in enumerate(times))
    )
    kills = [{"group": 1, "time": 25.0}, {"group": 1, "time": 70.0}, {"group": 0, "time": 5.0}]
    # The last two groups never came back (or logged nothing): no time for them.
    assert lost_per_failure(tmp_path, kills) == [22.5]


def test_the_chaos_schedule_reads_a_groups_step_from_its_last_whole_row(tmp_path):
    """``--chaos-every-steps`` counts the run's steps from each group's metrics: the last
    complete row's step, a row still being written skipped, 0 before any row."""
    from train.groups import _step

    assert _step(tmp_path) == 0
    rows = "".join(json.dumps({"step": s, "loss": 1.0, "pad": "x" * 300}) + "\n"
                   for s in range(1, 60))  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 60, "lo')
    assert _step(tmp_path) == 59  # the tail read is 8 kB of a 20 kB file; its cut row skipped
    (tmp_path / "metrics.jsonl").write_text(rows + json.dumps({"step": 60}) + "\n")
    assert _step(tmp_path) == 60


@pytest.mark.parametrize(
    "args, match",
    [
        (["--groups", "0"], "--groups must be at least 1"),
        (["--groups", "2", "--min-groups", "3"], "--min-groups must be in 1..2"),
        (["--groups", "2", "--cpus-per-group", "4096"], "--cpus-per-group 4096 x --groups 2"),
        (["--groups", "2", "--cpus-per-group", "-1"], "--cpus-per-group -1"),
        (["--groups", "2", "--spare", "--network", "100"], "--spare with --network"),
        (["--groups", "2", "--processes-per-group", "0"], "--processes-per-group must be"),
        (["--groups", "2", "--spare", "--processes-per-group", "2"], "a spare is one process"),
        (["--groups", "2", "--chaos-every-steps", "-5"], "--chaos-every-steps must be"),
        (
            ["--groups", "2", "--chaos-every-steps", "60", "--chaos-every", "30"],
            "not with --chaos-every",
        ),  # fmt: skip
    ],
)
def test_the_launchers_bad_arguments_are_refused_naming_them(args, match, capsys):
    from train.groups import main

    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    assert match in capsys.readouterr().err


def test_a_pinned_group_runs_on_its_own_cores():
    """``pinned(cmd, cpus)`` (what ``start_group(cpus=...)`` runs): the interpreter it
    starts may run on those cores only, with the command's own arguments and the same
    environment (``flax`` imports: a virtual environment's interpreter stays itself)."""
    import os
    import subprocess
    import sys

    from train.groups import pinned

    core = sorted(os.sched_getaffinity(0))[-1]
    probe = "import os, sys, flax; print(sorted(os.sched_getaffinity(0)), sys.argv[1:])"
    cmd = pinned(["nice", "-n", "0", sys.executable, "-c", probe, "a", "-m"], {core})
    assert cmd[:3] == ["nice", "-n", "0"]  # a prefix (a namespace's) stays in front
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == f"{[core]} ['a', '-m']"


def test_the_link_clock_hides_an_exchange_shorter_than_its_overlap():
    """``link_utilisation``: with 2 fragments of a 30-step period, an exchange of 0.3 s
    behind 5 steps of 0.1 s costs nothing; with no overlap each one adds its 0.3 s."""
    import jaxcomm
    from train.replica_groups import link_utilisation

    schedule = jaxcomm.schedules.streaming_schedule(4, 30, 2)
    util, round_s = link_utilisation(0.1, [0.3, 0.3], 30, schedule, 5)
    assert util == pytest.approx(1.0) and round_s == pytest.approx(3.0)
    util, round_s = link_utilisation(0.1, [0.3, 0.3], 30, schedule, 0)
    assert round_s == pytest.approx(3.6) and util == pytest.approx(3.0 / 3.6)
    # An exchange longer than its overlap: the merge waits for the rest of it.
    util, round_s = link_utilisation(0.1, [0.8, 0.8], 30, schedule, 5)
    assert round_s == pytest.approx(3.0 + 2 * (0.8 - 0.5))


def test_the_estimate_of_replica_groups_lays_their_exchanges_on_the_link():
    """``train.estimate`` of a group: each fragment's exchange between 3 groups on 50 ms /
    100 Mbit/s is a quorum round trip and two ring all-gathers of 2 blocks (headers of 80
    bytes, then the payload), and the bytes a group sends are 2 blocks of each."""
    from train.config import load_config
    from train.estimate import estimate

    sets = ["workers=1", "global_batch=8", "aggregator=ring", "sync.period=30",
            "sync.fragments=2", "sync.overlap=5", "sync.compress=int8", "compute=v100",
            "network=50ms,100Mbps", "model.num_layers=2", "model.width=32",
            "groups.lighthouse=http://127.0.0.1:1", "groups.slot=0",
            "groups.count=3"]  # fmt: skip
    est = estimate(load_config("configs/diloco_default.yaml", sets))
    g = est["groups"]
    assert g["count"] == 3 and len(g["payload_bytes"]) == 2
    for payload, seconds in zip(g["payload_bytes"], g["exchange_s"], strict=True):
        assert seconds == pytest.approx(6 * 0.05 + 2 * (payload + 80) * 8 / 1e8)
    # (The bytes against what the transport sends: tests/test_groups_torchft.py.)
    # The exchanges (0.3 s and more) outlast 5 steps of a V100 (well under a ms each).
    assert g["compute_utilisation"] < 0.1
    assert est["step_s"] == pytest.approx(g["round_s"] / 30)
    assert est["samples_per_s"] == pytest.approx(3 * 8 * 30 / g["round_s"])


def test_the_estimate_of_a_group_of_two_workers_counts_its_own_all_reduce(tmp_path):
    """A group of 2 workers all-reduces its gradients every step on its own link: the
    estimate's step is at least that step's compute and collectives, whatever the
    exchanges add."""
    from train.config import load_config
    from train.estimate import estimate

    sets = ["workers=2", "global_batch=8", "aggregator=ring", "sync.period=30",
            "sync.fragments=2", "sync.overlap=5", "compute=v100", "network=50ms,100Mbps",
            "model.num_layers=2", "model.width=32", "groups.lighthouse=http://127.0.0.1:1",
            "groups.slot=0", "groups.count=2"]  # fmt: skip
    est = estimate(load_config("configs/diloco_default.yaml", sets))
    inner = est["compute_s"] + 0.9 * (est["comm_s"] - sum(est["groups"]["exchange_s"]) / 30)
    assert est["step_s"] >= inner > est["compute_s"]
    assert est["groups"]["compute_utilisation"] < est["compute_s"] / inner


def test_a_heal_that_lands_while_a_checkpoint_waits_is_taken_before_it_is_written(tmp_path):
    """A checkpoint waits for the exchange in flight; if that exchange healed the group,
    the peer's state it brought (step, data position, parameters, optimizer state) is
    taken before the checkpoint reads the trainer's state, and the merge it brought is
    due from the peer's step: the checkpoint holds the peer's state beside the peer's
    theta_sync, not this group's old state."""
    import concurrent.futures

    from train.checkpoint import Checkpoints

    trainer = _group_trainer(tmp_path, "steps=60", "sync.overlap=2")
    part, ctx = trainer.sync, trainer.ctx
    part._ctx = ctx
    ctx.step = 5
    host = lambda tree: jax.tree_util.tree_map(np.asarray, tree)  # noqa: E731
    peer_params = jax.tree_util.tree_map(lambda a: a + 1.0, host(ctx.params))
    done = concurrent.futures.Future()
    done.set_result({"members": 2, "kept": 1, "healed": True})
    part._pending = [(0, 7, done)]
    part._healed_state = {"params": peer_params, "opt_state": host(ctx.opt_state),
                          "step": 40, "position": 321, "last_sync": {0: 40}}  # fmt: skip
    part._healed_fragment = 1
    store = Checkpoints(tmp_path / "ck", keep=2)
    trainer.save(store)
    store.close()
    assert ctx.step == 40 and ctx.loader.position == 321 and part._healed_state is None
    assert part._pending == [(1, 42, None)]
    assert store.saved_step == 40
    for a, b in zip(jax.tree_util.tree_leaves(host(ctx.params)),
                    jax.tree_util.tree_leaves(peer_params), strict=True):  # fmt: skip
        np.testing.assert_array_equal(a, b)


def test_a_heals_arrays_cross_torch_as_their_own_bytes_and_dtypes():
    """The live state a heal sends goes through torch's streaming save as raw bytes: every
    array comes back bit for bit with its dtype (bfloat16 too) and shape, and the stream is
    barely larger than the arrays (a pickled NumPy array's bytes would grow by half)."""
    import io

    import ml_dtypes
    from torch.distributed._serialization import _streaming_load, _streaming_save

    from train.replica import _from_torch, _to_torch

    rng = np.random.default_rng(0)
    state = {
        "params": {"w": rng.normal(size=(64, 64)).astype(np.float32),
                   "b": rng.normal(size=(7,)).astype(ml_dtypes.bfloat16)},
        "opt": (jnp.asarray(rng.normal(size=(3, 5)), jnp.float32), np.zeros((0, 4), np.int8)),
        "step": 40, "last_sync": {0: 40}, "scalar": np.asarray(2.5),
    }  # fmt: skip
    buf = io.BytesIO()
    _streaming_save(_to_torch(state), buf)
    buf.seek(0)
    back = _from_torch(_streaming_load(buf, weights_only=False))
    assert back["step"] == 40 and back["last_sync"] == {0: 40}
    arrays = [a for a in jax.tree_util.tree_leaves(state) if np.ndim(a) or hasattr(a, "dtype")]
    got = [b for b in jax.tree_util.tree_leaves(back) if np.ndim(b) or hasattr(b, "dtype")]
    assert len(got) == len(arrays) == 5
    for a, b in zip(arrays, got, strict=True):
        a = np.asarray(a)
        assert b.dtype == a.dtype and b.shape == a.shape and b.flags.writeable
        np.testing.assert_array_equal(b.reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8))
    assert buf.tell() < sum(np.asarray(a).nbytes for a in arrays) + 8_000
