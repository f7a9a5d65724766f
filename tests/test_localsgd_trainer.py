"""The trainer with a sync wrapper (``sync:``): DreamDDP, PLSGD-ENP and FLSGD end to end."""

import json

import jax
import numpy as np
import pytest

import jaxcomm
from jaxcomm._src.localsgd import SYNC_SCOPE, layer_comm_s, sync_branch
from train.config import Config
from train.localsgd import LocalSGD
from train.trainer import Trainer

SMALL = {"num_layers": 2, "width": 32, "num_heads": 2, "seq_len": 32}
MLP = dict(task="mlp", model={"features": [32, 32]}, dataset="digits", global_batch=64)


def _cfg(tmp_path, **kw):
    base = dict(
        name="t",
        task="gpt",
        model=SMALL,
        workers=8,
        global_batch=16,
        steps=6,
        lr=3e-3,
        optimizer="adam",
        aggregator="none",
        sync={"method": "dreamddp", "period": 3},
        network="1ms,100Mbps",
        compute="v100",
        checkpoint_every=3,
        progress=False,
        out_dir=str(tmp_path / "run"),
    )
    base.update(kw)
    return Config(**base)


def _rows(cfg):
    return [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def _host(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(tree))]


def test_dreamddp_run_logs_the_scheduled_traffic_and_its_timeline(tmp_path):
    cfg = _cfg(tmp_path, steps=12, checkpoint_every=0, eval_every=6)
    trainer = Trainer(cfg)
    summary = trainer.run()
    sched = trainer.sync.sync_schedule
    assert sched.period == 3 and sched.num_layers == 4  # embed, block_0, block_1, head
    assert summary["schedule"] == str(sched) and summary["profile"] == "roofline:v100"
    rows = _rows(cfg)
    assert np.mean([r["loss"] for r in rows[-3:]]) < np.mean([r["loss"] for r in rows[:3]])
    net = jaxcomm.network.Network(1e-3, 100e6)
    comm = layer_comm_s(trainer.sync.layer_wires, net)
    prof = trainer.sync.profile
    for step in range(3):  # one period: each step's bytes are its group's, read from the program
        trainer.step = step
        group = sched.groups[step]
        audit = trainer.step_audit(branches={SYNC_SCOPE: sync_branch(sched, step)})
        assert rows[step]["sent_bytes"] == int(audit.sent.max())
        assert rows[step]["sync_layers"] == len(group)
        assert rows[step]["comm_s"] == pytest.approx(sum(comm[layer] for layer in group))
        # The logged rounds and path bytes cost the same seconds as the layers' wires.
        assert jaxcomm.network.log_time(_log_at(trainer, cfg, step), net) == pytest.approx(
            rows[step]["comm_s"], rel=1e-9
        )
        # The step's compute: its program with this step's averaging branch, not the
        # costliest one.
        compute = trainer.sync.branch_compute_s(trainer.ctx, sync_branch(sched, step))
        assert compute <= trainer.modelled_compute_s()
        forward = compute - sum(prof.backward_s)
        want = _hand_iteration(group, forward, prof.backward_s, comm)
        assert rows[step]["sim_step_s"] == pytest.approx(want, rel=1e-9)
    covered = {layer for g in sched.groups for layer in g}
    assert covered == {0, 1, 2, 3}
    # The workers drift apart between averagings, and evaluation uses their mean.
    assert all(r["divergence"] > 0 for r in rows)
    mean = jax.tree.map(lambda a: np.asarray(a).mean(0), trainer.params)
    for a, b in zip(jax.tree.leaves(trainer.model_params()), jax.tree.leaves(mean), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert "valid_loss" in rows[5]


def _hand_iteration(group, forward, backward, comm):
    """DreamDDP's iteration written out: the backward runs from the output layer down; a
    group layer's all-reduce starts once its own backward is done and the link is free; the
    iteration ends at the forward plus the later of the backward's end and the last
    all-reduce's end."""
    t, link, ends = 0.0, 0.0, {}
    for layer in reversed(range(len(backward))):
        t += backward[layer]
        ends[layer] = t
    for layer in sorted(group, reverse=True):
        link = max(link, ends[layer]) + comm[layer]
    return forward + max(t, link)


def _log_at(trainer, cfg, step):
    """The CommLog of one step, re-run from the metrics' wire record of that step."""
    rows = _rows(cfg)
    k = len(jaxcomm.network.KINDS)
    log = jaxcomm.network.empty_log()
    for kind, calls, mbytes, ratio, rounds, path in rows[step]["wire"]:
        log = jaxcomm.network.log_collective(
            log, kind, mbytes, 0, rounds=rounds, path_bytes=path, ratio=ratio, calls=calls
        )
    assert np.asarray(log.rounds).shape == (k,)
    return log


def test_flsgd_averages_everything_at_the_end_of_each_period(tmp_path):
    cfg = _cfg(tmp_path, sync={"method": "local_sgd", "period": 3}, checkpoint_every=0, **MLP)
    trainer = Trainer(cfg)
    trainer.run()
    rows = _rows(cfg)
    for r in rows:
        synced = r["step"] % 3 == 0
        assert (r["sync_layers"] == 3) == synced and (r["sent_bytes"] > 0) == synced
        # Right after a full averaging the workers hold one model (up to the rounding of
        # p + (mean - p)); in between they drift apart.
        assert (r["divergence"] < 1e-12) == synced, r
    assert trainer.sync.sync_schedule.groups == ((), (), (2, 1, 0))  # dense_0, dense_1, head


def test_enp_schedule_and_bad_sync_settings(tmp_path):
    trainer = Trainer(_cfg(tmp_path, sync={"method": "enp", "period": 3}, **MLP))
    assert trainer.sync.sync_schedule == jaxcomm.schedules.enp_schedule(3, 3)
    bad = [
        ({"aggregator": "none", "sync": {}}, "needs a sync"),
        ({"aggregator": "ring"}, "needs aggregator none"),
        ({"sync": {"method": "dreamddp"}}, "sync.period is required"),
        ({"sync": {"period": 2}}, "needs method"),
        ({"sync": {"method": "fast", "period": 2}}, "sync must be one of"),
        ({"sync": {"method": "enp", "period": 0}}, "sync.period: input should be greater"),
        ({"sync": {"method": "enp", "period": 2, "every": 1}}, "unknown key 'every'"),
        ({"sync": {"method": "enp", "period": 2, "profile": "roofline"}}, "unknown key"),
    ]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            _cfg(tmp_path, **kw)


def test_fused_flsgd_sends_one_message_after_the_whole_backward(tmp_path):
    cfg = _cfg(
        tmp_path, sync={"method": "local_sgd", "period": 2, "fused": True}, checkpoint_every=0
    )
    trainer = Trainer(cfg)
    trainer.run()
    rows = _rows(cfg)
    assert len(trainer.sync.layer_wires) == 1 and trainer.sync.sync_schedule.groups == ((), (0,))
    assert [r["sent_bytes"] > 0 for r in rows] == [False, True] * 3
    audit = trainer.step_audit(branches={SYNC_SCOPE: 1})
    assert rows[1]["sent_bytes"] == int(audit.sent.max())
    assert int(trainer.step_audit(branches={SYNC_SCOPE: 0}).sent.max()) == 0
    net = jaxcomm.network.Network(1e-3, 100e6)
    comm = layer_comm_s(trainer.sync.layer_wires, net)[0]
    compute = trainer.sync.branch_compute_s(trainer.ctx, 1)
    # The one message waits for the whole backward: forward + backward + message.
    assert rows[1]["sim_step_s"] == pytest.approx(compute + comm, rel=1e-12)
    with pytest.raises(ValueError, match="sync: unknown key 'fused'"):
        _cfg(tmp_path, sync={"method": "enp", "period": 2, "fused": True})
    with pytest.raises(ValueError, match="overlap=true with sync"):
        _cfg(tmp_path, overlap=True)
    # A pipeline's replicas under local SGD with stragglers: refused, naming both.
    from train.config import load_config

    sets = ["stages=2", "workers=2", "aggregator=none", "sync={method: local_sgd, period: 2}"]
    with pytest.raises(ValueError, match=r"stragglers=.* with sync 'local_sgd' and stages=2"):
        load_config(None, [*sets, "stragglers={seed: 1, compute_sigma: 0.1}"])
    assert load_config(None, [*sets, "overlap=true"]).overlap  # GPipe's clock overlaps


def test_resume_with_a_measured_profile_keeps_it(tmp_path, monkeypatch):
    """With ``compute: measured`` the layers are timed on this host, differently in each
    process; the resumed run keeps the saved profile and schedule."""
    import dataclasses

    measured = dict(compute="measured", sync={"method": "dreamddp", "period": 3}, **MLP)
    first = Trainer(_cfg(tmp_path, steps=3, **measured))
    first.run()
    assert first.sync.profile.method == "measured"

    own = LocalSGD._profile

    def slower(self, *args):  # this process measures its layers twice as slow
        prof = own(self, *args)
        return dataclasses.replace(prof, backward_s=tuple(2 * b for b in prof.backward_s))

    monkeypatch.setattr(LocalSGD, "_profile", slower)
    resumed = Trainer(_cfg(tmp_path, steps=5, **measured))
    assert resumed.sync.profile.backward_s != first.sync.profile.backward_s
    resumed.run(resume=True)
    assert resumed.sync.profile.backward_s == first.sync.profile.backward_s
    assert resumed.sync.profile.forward_s == first.sync.profile.forward_s
    assert resumed.sync.sync_schedule == first.sync.sync_schedule


def test_resume_is_bit_exact(tmp_path):
    full = Trainer(_cfg(tmp_path / "a", steps=7, **MLP))
    full.run()
    Trainer(_cfg(tmp_path / "b", steps=4, **MLP)).run()  # stops inside a period
    resumed = Trainer(_cfg(tmp_path / "b", steps=7, **MLP))
    resumed.run(resume=True)
    for a, b in zip(_host(full.params), _host(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_host(full.opt_state), _host(resumed.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert full.clock.now == resumed.clock.now
    a, b = _rows(full.cfg), _rows(resumed.cfg)
    for key in ("step", "loss", "sent_bytes", "sim_time_s", "divergence", "sync_layers"):
        assert [r[key] for r in a] == [r[key] for r in b], key


def test_resume_keeps_the_saved_schedule(tmp_path, monkeypatch):
    """A measured profile can give another schedule in a new process; the run resumes with
    the schedule it was trained with, and its steps send that schedule's groups."""
    first = Trainer(_cfg(tmp_path, steps=3, **MLP))
    first.run()

    # As if the profile had come out otherwise:
    monkeypatch.setattr(
        LocalSGD, "_schedule", lambda self, network: jaxcomm.schedules.full_sync_schedule(3, 3)
    )
    other = Trainer(_cfg(tmp_path, steps=6, **MLP))
    assert other.sync.sync_schedule != first.sync.sync_schedule
    other.run(resume=True)
    assert other.sync.sync_schedule == first.sync.sync_schedule
    for r in _rows(other.cfg)[3:]:
        group = first.sync.sync_schedule.groups[(r["step"] - 1) % 3]
        assert r["sent_bytes"] == sum(other.sync.layer_wires[layer].sent[0] for layer in group)


STRAGGLERS = {"seed": 3, "compute_sigma": 0.5, "latency_jitter": 0.5, "slow": {5: 2.0}}


def test_stragglers_with_local_sgd_wait_only_at_averaging(tmp_path):
    """With stragglers each worker runs its local steps at its own pace; only the averaging
    step waits for the slowest worker's total since the last averaging. Checked against
    per-worker clocks kept here by hand (fused FLSGD: one message after the backward)."""
    sync = {"method": "local_sgd", "period": 4, "fused": True}
    cfg = _cfg(tmp_path, sync=sync, stragglers=STRAGGLERS, steps=8, checkpoint_every=0, **MLP)
    trainer = Trainer(cfg)
    trainer.run()
    rows = _rows(cfg)
    net, model = jaxcomm.network.Network(1e-3, 100e6), cfg.straggler_model()
    wire = trainer.sync.layer_wires[0]
    local = np.zeros(8)  # each worker's own clock
    now = 0.0
    for r in rows:
        step = r["step"] - 1
        branch = sync_branch(trainer.sync.sync_schedule, step)
        compute = trainer.sync.branch_compute_s(trainer.ctx, branch)
        local = local + model.compute_factors(step, 8) * compute
        if step % 4 == 3:  # everyone waits for the slowest, then the message
            latency = model.round_latency(step, wire.rounds, 8, net, stream=1)
            local[:] = local.max() + latency + wire.path_bytes * net.beta
        assert r["sim_time_s"] == pytest.approx(local.max(), rel=1e-9)
        assert r["sim_step_s"] == pytest.approx(local.max() - now, rel=1e-9)
        now = local.max()
    # Local SGD absorbs stragglers: a period takes less than waiting for the slowest
    # worker at every step would.
    schedule = trainer.sync.sync_schedule
    waiting = sum(
        model.compute_factors(s, 8).max()
        * trainer.sync.branch_compute_s(trainer.ctx, sync_branch(schedule, s))
        for s in range(4)
    )
    assert rows[3]["sim_time_s"] < waiting + rows[3]["comm_s"]


@pytest.mark.parametrize("method", ["dreamddp", "local_sgd"])
def test_stragglers_with_local_sgd_resume_bit_exact(tmp_path, method):
    """The workers' lags behind the clock are part of the checkpoint: a run stopped inside
    a period (local SGD: at a step that averages nothing, so the lags are not zero)
    resumes to the same simulated times as one that never stopped."""
    kw = dict(stragglers=STRAGGLERS, sync={"method": method, "period": 3}, **MLP)
    full = Trainer(_cfg(tmp_path / "a", steps=7, checkpoint_every=0, **kw))
    full.run()
    stopped = Trainer(_cfg(tmp_path / "b", steps=4, checkpoint_every=0, **kw))
    stopped.run()
    if method == "local_sgd":  # step 4 averages nothing: the workers are apart
        assert np.ptp(stopped.sync._lag) > 0
    resumed = Trainer(_cfg(tmp_path / "b", steps=7, checkpoint_every=0, **kw))
    resumed.run(resume=True)
    a, b = _rows(full.cfg), _rows(resumed.cfg)
    for key in ("loss", "sent_bytes", "sim_step_s", "sim_time_s"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    # The stragglers change the clock: the same run without them is faster.
    calm = Trainer(_cfg(tmp_path / "c", steps=7, checkpoint_every=0, **{**kw, "stragglers": {}}))
    calm.run()
    assert _rows(calm.cfg)[-1]["sim_time_s"] < a[-1]["sim_time_s"]
    for x, y in zip(_host(full.params), _host(resumed.params), strict=True):
        np.testing.assert_array_equal(x, y)
