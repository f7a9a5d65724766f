"""The trainer's optimizer options: learning-rate schedules, weight decay, gradient clipping
by global norm, and DiLoCo's data-parallel warm start (``sync.warmup_steps``)."""

import json
import math

import jax
import numpy as np
import optax
import pytest

import jaxcomm
from jaxcomm._src.diloco import DiLoCoState
from train.config import Config, key_docs
from train.data import shard
from train.sync import make_optimizer, make_schedule
from train.trainer import Trainer

MLP = dict(task="mlp", model={"features": [32, 32]}, dataset="digits", global_batch=64)


def _cfg(tmp_path, **kw):
    base = dict(
        name="t",
        workers=8,
        steps=6,
        lr=3e-3,
        optimizer="adam",
        aggregator="ring",
        network="50ms,100Mbps",
        compute="v100",
        checkpoint_every=0,
        eval_every=0,
        progress=False,
        out_dir=str(tmp_path / "run"),
        **MLP,
    )
    base.update(kw)
    return Config(**base)


def _diloco(tmp_path, sync, **kw):
    return _cfg(tmp_path, aggregator="none", sync={"method": "diloco", **sync}, **kw)


def _rows(cfg):
    return [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def _host(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(tree))]


def _same_run(a, b, keys=("step", "loss", "sent_bytes", "sim_time_s"), clock=True):
    """Two finished trainers logged the same rows (every key, bit for bit) and hold the
    same state (and clock)."""
    ra, rb = _rows(a.cfg), _rows(b.cfg)
    assert len(ra) == len(rb) == a.cfg.steps
    for key in keys:
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    for x, y in zip(_host(a.params), _host(b.params), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(_host(a.opt_state), _host(b.opt_state), strict=True):
        np.testing.assert_array_equal(x, y)
    assert a.clock.now == b.clock.now or not clock


# --------------------------------------------------------------------------- schedules


def _expected_lr(peak, count, *, kind, warmup, start, floor, decay):
    """The schedule written out: linear warm-up from ``start * peak``, then a cosine or
    linear decay to ``floor * peak`` over ``decay`` steps, then the floor."""
    if count < warmup:
        return peak * (start + (1 - start) * count / warmup)
    if kind == "constant":
        return peak
    t = min(count - warmup, decay) / decay
    if kind == "cosine":
        return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))
    return peak * (1 + (floor - 1) * t)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_the_schedule_at_chosen_steps(kind):
    """Step 0 (the warm-up's start), mid warm-up, the peak at the warm-up's end, mid decay,
    the run's last step (the floor) and past it, against the formula."""
    cfg = Config(
        lr=0.01,
        steps=51,
        lr_schedule=kind,
        lr_warmup_steps=10,
        lr_warmup_from=0.1,
        lr_floor=0.2,
        progress=False,
    )
    schedule = make_schedule(cfg)
    decay = 51 - 1 - 10  # to the last step (count 50)
    for count in (0, 5, 10, 30, 50, 70):
        want = _expected_lr(0.01, count, kind=kind, warmup=10, start=0.1, floor=0.2, decay=decay)
        assert float(schedule(count)) == pytest.approx(want, rel=1e-6), count
    assert float(schedule(0)) == pytest.approx(0.001, rel=1e-6)
    assert float(schedule(10)) == pytest.approx(0.01, rel=1e-6)
    assert float(schedule(50)) == pytest.approx(0.002, rel=1e-6)  # the floor, at the last step
    mid = {"cosine": 0.01 * (0.2 + 0.8 * 0.5), "linear": 0.01 * 0.6}[kind]
    assert float(schedule(30)) == pytest.approx(mid, rel=1e-6)
    # A stated number of decay steps ends the decay there, whatever the run's length.
    short = make_schedule(Config(lr=0.01, steps=51, lr_schedule=kind, lr_decay_steps=20))
    assert float(short(10)) == pytest.approx(
        _expected_lr(0.01, 10, kind=kind, warmup=0, start=0, floor=0.1, decay=20), rel=1e-6
    )
    assert float(short(20)) == float(short(45)) == pytest.approx(0.001, rel=1e-6)


def test_constant_stays_a_number_and_a_warm_up_alone_rises_to_it():
    assert make_schedule(Config(lr=0.003)) == 0.003  # the optimizer of every shipped config
    rise = make_schedule(Config(lr=0.01, lr_warmup_steps=4))
    assert [float(rise(c)) for c in range(6)] == pytest.approx(
        [0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01], rel=1e-6
    )


def test_the_optimizer_steps_at_the_schedules_rate_by_its_own_count():
    """``sgd`` with a schedule on a constant gradient of ones: the update of its ``t``-th
    call is ``-lr(t)``, counted by the optimizer's state (what a checkpoint keeps)."""
    cfg = Config(optimizer="sgd", lr=0.5, steps=9, lr_schedule="linear", lr_warmup_steps=3)
    tx = make_optimizer(cfg)
    params = {"w": np.zeros(3, np.float32)}
    state = tx.init(params)
    for count in range(12):
        updates, state = tx.update({"w": np.ones(3, np.float32)}, state, params)
        want = _expected_lr(0.5, count, kind="linear", warmup=3, start=0.0, floor=0.1, decay=5)
        np.testing.assert_allclose(np.asarray(updates["w"]), -want, rtol=1e-6, atol=1e-9)


def test_with_a_whole_optimizer_the_schedule_multiplies_its_update():
    """``optimizer: none`` with a schedule: the update an aggregator that is the whole
    optimizer returns, times the schedule's value at peak 1 (its ``lr`` is the peak)."""
    cfg = Config(
        optimizer={"name": "none", "schedule": {"name": "cosine", "warmup_steps": 2}},
        aggregator={"name": "demo", "lr": 1e-3},
        steps=8,
    )
    tx = make_optimizer(cfg)
    update = {"w": np.full(3, -2e-3, np.float32)}
    state = tx.init({"w": np.zeros(3, np.float32)})
    for count in range(10):
        out, state = tx.update(update, state)
        want = _expected_lr(1.0, count, kind="cosine", warmup=2, start=0.0, floor=0.1, decay=5)
        np.testing.assert_allclose(np.asarray(out["w"]), -2e-3 * want, rtol=1e-6, atol=1e-12)
    plain = make_optimizer(Config(optimizer="none", aggregator={"name": "demo", "lr": 1e-3}))
    assert plain.update(update, plain.init(update))[0] is update  # no schedule: the identity


def test_demo_under_a_schedule_is_still_at_its_warm_ups_start(tmp_path):
    """DeMo behind a warm-up from 0: the first step moves nothing; then the run moves."""
    kw = dict(
        optimizer={"name": "none", "schedule": {"warmup_steps": 2}},
        aggregator={"name": "demo", "lr": 1e-3, "chunk": 8, "k": 4, "weight_decay": 0.1},
        steps=3,
    )
    first = Trainer(_cfg(tmp_path / "a", **{**kw, "steps": 1}))
    start = _host(first.params)
    first.run()
    for x, y in zip(start, _host(first.params), strict=True):
        np.testing.assert_array_equal(x, y)
    whole = Trainer(_cfg(tmp_path / "b", **kw))
    whole.run()
    assert any(not np.array_equal(x, y) for x, y in zip(start, _host(whole.params), strict=True))


def test_clipping_before_a_whole_optimizer_scales_each_workers_gradient(tmp_path):
    """``optimizer: none`` with ``clip_norm``: DeMo without its sign (a step linear in the
    gradient) on one worker moves the parameters by ``clip / |g|`` times its unclipped
    step at the first step, ``g`` the worker's own gradient."""
    clip = 1e-3
    demo = {"name": "demo", "lr": 0.5, "chunk": 8, "k": 4, "sign": False}
    kw = dict(workers=1, steps=1, optimizer="none", aggregator=demo)
    plain = Trainer(_cfg(tmp_path / "a", **kw))
    p0, per = _worker_grads(plain)
    plain.run()
    clipped = Trainer(_cfg(tmp_path / "b", **{**kw, "optimizer": {"name": "none",
                                                               "clip_norm": clip}}))  # fmt: skip
    clipped.run()
    scale = clip / _norm(jax.tree_util.tree_map(lambda g: g[0], per))
    assert scale < 0.2  # the clipping acts
    moved = [jax.tree_util.tree_leaves(t) for t in (p0, plain.worker_params(0),
                                                    clipped.worker_params(0))]  # fmt: skip
    # float32 parameters round their moves by about 1e-8; the moves are about 1e-6.
    for a, b, c in zip(*moved, strict=True):
        got, want = np.asarray(c) - a, scale * (np.asarray(b) - a)
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=5e-8)
        assert np.linalg.norm(got - want) < 0.02 * np.linalg.norm(want)


# --------------------------------------------------------------------------- the gradient


def _worker_grads(trainer):
    """Each worker's gradient of the first step (its shard of the first batch) at the
    initial parameters, float64 leaves ``[N, ...]``, and those parameters."""
    params = trainer.worker_params(0)
    batch = shard(trainer.train_data.get(trainer.loader.batch_ids(0)), trainer.n)
    grad = jax.jit(jax.grad(lambda p, b: trainer.task.loss(p, b)[0]))
    per = [grad(params, {k: v[w] for k, v in batch.items()}) for w in range(trainer.n)]
    stacked = jax.tree_util.tree_map(lambda *g: np.stack(g).astype(np.float64), *per)
    return params, stacked


def _norm(tree):
    return math.sqrt(sum(float(np.sum(np.square(x))) for x in jax.tree_util.tree_leaves(tree)))


def test_clipping_below_the_threshold_changes_nothing(tmp_path):
    plain = Trainer(_cfg(tmp_path / "a", steps=3))
    plain.run()
    clipped = Trainer(_cfg(tmp_path / "b", steps=3, clip_norm=1e9))
    clipped.run()
    # The same parameters and losses, bit for bit (the simulated clock charges the norm's
    # arithmetic, so it is not compared).
    _same_run(plain, clipped, keys=("step", "loss", "sent_bytes"), clock=False)


def test_clipping_scales_the_averaged_gradient(tmp_path):
    """One SGD step with ``clip_norm`` below the gradient's norm moves the parameters by
    ``lr * clip(mean_w g_w)`` (clipped after the ring all-reduce), not by the mean of the
    workers' clipped gradients."""
    lr, clip = 0.5, 0.05
    trainer = Trainer(_cfg(tmp_path, steps=1, optimizer="sgd", lr=lr, clip_norm=clip))
    p0, per = _worker_grads(trainer)
    trainer.run()
    p1 = trainer.worker_params(0)
    mean = jax.tree_util.tree_map(lambda g: g.mean(0), per)
    assert _norm(mean) > 5 * clip  # the clipping acts
    scale = clip / _norm(mean)
    for a, b, g in zip(*(jax.tree_util.tree_leaves(t) for t in (p0, p1, mean)), strict=True):
        np.testing.assert_allclose(b, a - lr * scale * g, rtol=1e-5, atol=1e-7)
    # Clipping each worker's gradient before averaging would have moved them elsewhere.
    each = [
        scale_w * jax.tree_util.tree_leaves(per)[0][w]
        for w, scale_w in enumerate(
            min(1.0, clip / _norm(jax.tree_util.tree_map(lambda g, w=w: g[w], per)))
            for w in range(trainer.n)
        )
    ]
    moved = jax.tree_util.tree_leaves(p0)[0] - jax.tree_util.tree_leaves(p1)[0]
    assert np.max(np.abs(moved - lr * np.mean(each, axis=0))) > 1e-4


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_weight_decay_on_one_step(tmp_path, optimizer):
    """``adamw``: one step of ``optax.adamw``'s decoupled decay on the averaged gradient
    (``p - lr (m_hat / (sqrt(v_hat) + eps) + wd p)``, ``m_hat = g``, ``v_hat = g^2`` at the
    first step); ``sgd``: ``p - lr (g + wd p)``."""
    lr, wd = 0.01, 0.1
    trainer = Trainer(_cfg(tmp_path, steps=1, optimizer=optimizer, lr=lr, weight_decay=wd))
    p0, per = _worker_grads(trainer)
    trainer.run()
    p1 = trainer.worker_params(0)
    mean = jax.tree_util.tree_map(lambda g: g.mean(0), per)
    ref = optax.adamw(lr, weight_decay=wd) if optimizer == "adamw" else None
    if ref is not None:
        updates, _ = ref.update(
            jax.tree_util.tree_map(lambda g: g.astype(np.float32), mean), ref.init(p0), p0
        )
        via_optax = optax.apply_updates(p0, updates)
    for path_a, b, g, o in zip(
        *(jax.tree_util.tree_leaves(t) for t in (p0, p1, mean, via_optax if ref else p0)),
        strict=True,
    ):
        a = np.asarray(path_a, np.float64)
        if optimizer == "adamw":
            want = a - lr * (g / (np.abs(g) + 1e-8) + wd * a)
            np.testing.assert_allclose(b, o, rtol=1e-5, atol=1e-6)
        else:
            want = a - lr * (g + wd * a)
        np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-6)
        # ... and the decay is in it: without it the step lands lr * wd * p away.
        if np.max(np.abs(a)) > 0.1:
            assert np.max(np.abs(b - (want + lr * wd * a))) > 1e-4


# --------------------------------------------------------------------------- resume


def test_resume_in_the_middle_of_a_schedule_is_bit_exact(tmp_path):
    kw = dict(lr_schedule="cosine", lr_warmup_steps=2, lr_decay_steps=4, clip_norm=1.0)
    full = Trainer(_cfg(tmp_path / "a", steps=8, **kw))
    full.run()
    Trainer(_cfg(tmp_path / "b", steps=3, checkpoint_every=3, **kw)).run()  # mid-decay
    resumed = Trainer(_cfg(tmp_path / "b", steps=8, **kw))
    resumed.run(resume=True)
    _same_run(full, resumed)
    # The schedule moved the run: a constant lr logs other losses.
    const = Trainer(_cfg(tmp_path / "c", steps=8, clip_norm=1.0))
    const.run()
    assert [r["loss"] for r in _rows(const.cfg)][3:] != [r["loss"] for r in _rows(full.cfg)][3:]


def test_a_resume_that_would_change_the_schedule_is_refused(tmp_path):
    """Without ``lr_decay_steps`` the decay ends at the run's last step: resuming with more
    steps would stretch the schedule under way, so the checkpoint is refused, naming it."""
    Trainer(_cfg(tmp_path, steps=4, checkpoint_every=2, lr_schedule="linear")).run()
    longer = Trainer(_cfg(tmp_path, steps=8, lr_schedule="linear"))
    with pytest.raises(ValueError, match="lr_schedule"):
        longer.run(resume=True)


# --------------------------------------------------------------------------- warm start


def _state(trainer):
    (state,) = [
        s
        for s in jax.tree_util.tree_leaves(
            trainer.opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState)
        )
        if isinstance(s, DiLoCoState)
    ]
    return state


def test_the_warm_start_is_data_parallel_then_diloco_starts_from_it(tmp_path):
    """Four warm-start steps: a dense ring all-reduce each (the bytes and the blocking link
    time of data parallelism, the same losses as a data-parallel run), theta_sync equal to
    the model reached and a fresh outer momentum at the switch; then DiLoCo's periods of 3
    from step 5, with their own bytes and pattern."""
    sync = {"period": 3, "warmup_steps": 4}
    dp = Trainer(_cfg(tmp_path / "dp", steps=5))
    dp.run()
    first = Trainer(_diloco(tmp_path / "w", sync, steps=4, checkpoint_every=4))
    first.run()
    state = _state(first)
    for a, p in zip(_host(state.anchor), _host(first.params), strict=True):
        assert np.all(p == p[0:1])  # every worker holds the same model
        np.testing.assert_array_equal(a, p[0].astype(np.float32))  # theta_sync: held once
    assert all(np.all(x == 0) for x in _host(state.outer))  # the outer momentum never ran
    trainer = Trainer(_diloco(tmp_path / "w", sync, steps=10))
    trainer.run(resume=True)
    rows, ref = _rows(trainer.cfg), _rows(dp.cfg)
    # The warm start is data parallelism: its losses (and the first DiLoCo step's, from the
    # model it reached), bytes and link time.
    assert [r["loss"] for r in rows[:5]] == [r["loss"] for r in ref]
    assert [r["sent_bytes"] for r in rows[:4]] == [r["sent_bytes"] for r in ref[:4]]
    d = sum(x.size for x in _host(trainer.params)) // 8
    assert rows[0]["sent_bytes"] == 2 * 7 * (-(-d // 8)) * 4  # a float32 ring of the gradient
    for r, q in zip(rows[:4], ref[:4], strict=True):
        assert r["comm_s"] == q["comm_s"] > 0
        assert r["sim_step_s"] == pytest.approx(r["sim_compute_s"] + r["comm_s"], rel=1e-12)
        assert r["divergence"] < 1e-10  # identical workers (to the mean's rounding)
    # Then DiLoCo: a synchronisation every third step, counted from the switch.
    assert [r["sync_fragment"] for r in rows] == [-2] * 4 + [-1, -1, 0, -1, -1, 0]
    assert [r["sent_bytes"] > 0 for r in rows[4:]] == [False, False, True] * 2
    assert rows[5]["divergence"] > 0
    # The logged bytes are the compiled program's, each step's branches resolved.
    for step in (0, 3, 4, 6):
        branches = jaxcomm.schedules.diloco_branches(3, step, warmup=4)
        audit = trainer.step_audit(None, branches)
        assert int(audit.sent.max()) == rows[step]["sent_bytes"], step
    # The replayed link clock is the logged one.
    replayed = trainer.sync.replay(rows, trainer.schedule.at(0))
    np.testing.assert_allclose(replayed, [r["sim_step_s"] for r in rows], rtol=1e-9)


@pytest.mark.parametrize("stop", [2, 5])
def test_resume_in_and_after_the_warm_start_is_bit_exact(tmp_path, stop):
    sync = {"period": 3, "warmup_steps": 4}
    kw = dict(lr_schedule="cosine", lr_warmup_steps=2)
    full = Trainer(_diloco(tmp_path / "a", sync, steps=9, **kw))
    full.run()
    part = _diloco(tmp_path / "b", sync, steps=9, checkpoint_every=stop, **kw)
    with pytest.raises(_Stop):  # the same run, stopped once step ``stop`` is saved
        Trainer(part).run(metrics_cb=_stop_after(stop + 1))
    resumed = Trainer(_diloco(tmp_path / "b", sync, steps=9, **kw))
    resumed.run(resume=True)
    _same_run(full, resumed, keys=("step", "loss", "sent_bytes", "sim_time_s", "divergence"))


class _Stop(Exception):
    pass


def _stop_after(step):
    """A metrics callback that ends the run when step ``step`` is logged (before it is
    saved: the newest checkpoint is the one before)."""

    def cb(row):
        if row["step"] == step:
            raise _Stop

    return cb


# --------------------------------------------------------------------------- settings


MARSIT = {"name": "marsit", "local_lr": 0.1, "global_lr": 0.01, "full_sync_every": 5}


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(optimizer={"name": "none", "schedule": "cosine"}, aggregator=MARSIT),
            "only demo take a schedule",
        ),
        (
            dict(
                optimizer={"name": "none", "schedule": {"warmup_steps": 5}},
                aggregator={"name": "ef_signsgd", "lr": 0.1},
            ),
            "error feedback of the step",
        ),  # fmt: skip
        (dict(optimizer={"name": "none", "weight_decay": 0.1}, aggregator=MARSIT), "weight_decay"),
        (dict(optimizer={"name": "adam", "weight_decay": 0.1}), "use optimizer adamw"),
        (
            dict(optimizer={"clip_norm": 1.0}, stages=2, workers=2, global_batch=16),
            "each pipeline stage",
        ),  # fmt: skip
        (
            dict(steps=5, optimizer={"schedule": {"name": "cosine", "warmup_steps": 4}}),
            "decay_steps",
        ),  # fmt: skip
        (dict(optimizer={"schedule": "cosin"}), "did you mean 'cosine'"),
        (dict(optimizer={"schedule": {"floor": 1.5}}), "optimizer.schedule.floor"),
        (dict(optimizer={"schedule": {"warmup_steps": -1}}), "optimizer.schedule.warmup_steps"),
        (dict(optimizer={"clip_norm": -1.0}), "optimizer.clip_norm"),
        (
            dict(aggregator="none", sync={"method": "local_sgd", "period": 2, "warmup_steps": 2}),
            "unknown key 'warmup_steps'",
        ),
        (
            dict(aggregator="none", sync={"method": "diloco", "period": 2, "warmup_steps": -1}),
            "sync.warmup_steps",
        ),
    ],
)
def test_bad_settings_are_refused_naming_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        Config(**{**dict(workers=8, global_batch=32), **kw})


def test_the_keys_are_documented():
    docs = {key: text for key, _, text in key_docs()}
    for key in ("name", "warmup_steps", "warmup_from", "floor", "decay_steps"):
        assert len(docs[f"optimizer.schedule.{key}"]) > 20, key
    for key in ("weight_decay", "clip_norm", "muon_lr"):
        assert len(docs[f"optimizer.{key}"]) > 20, key
    assert "DiLoCo starts from a trained model" in docs["sync.warmup_steps (diloco)"]


def test_sparseloco_averaged_over_senders_sends_the_same_bytes(tmp_path):
    """``sync.compress: {method: sparseloco, average: senders}`` runs, with the same bytes
    on the wire as the paper's mean over all workers, and trains to another model."""
    runs = {}
    for average in ("workers", "senders"):
        sync = {
            "period": 2,
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
            "compress": {"method": "sparseloco", "chunk": 64, "k": 4, "average": average},
        }
        runs[average] = Trainer(_diloco(tmp_path / average, sync, steps=4))
        runs[average].run()
    a, b = (_rows(runs[k].cfg) for k in ("workers", "senders"))
    assert [r["sent_bytes"] for r in a] == [r["sent_bytes"] for r in b]
    assert a[1]["sent_bytes"] > 0
    assert a[2]["loss"] != b[2]["loss"]
