"""The trainer with ``sync: {method: diloco, ...}``: data parallel and pipeline layouts,
the link clock, evaluation on theta_sync, resume."""

import json

import jax
import numpy as np
import pytest

from jaxcomm._src.diloco import DiLoCoState
from train.config import Config
from train.trainer import Trainer

MLP = dict(task="mlp", model={"features": [32, 32]}, dataset="digits", global_batch=64)
SMALL = {"num_layers": 2, "width": 32, "num_heads": 2, "seq_len": 32}


def _cfg(tmp_path, sync, **kw):
    base = dict(
        name="t",
        workers=8,
        steps=6,
        optimizer={"name": "adam", "lr": 3e-3},
        aggregator="none",
        sync={"method": "diloco", **sync},
        network="50ms,100Mbps",
        compute="v100",
        checkpoint_every=3,
        eval_every=0,
        progress=False,
        out_dir=str(tmp_path / "run"),
        **MLP,
    )
    base.update(kw)
    return Config(**base)


def _rows(cfg):
    return [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def _host(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(tree))]


def _anchor(trainer):
    (state,) = [
        s
        for s in jax.tree_util.tree_leaves(
            trainer.opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState)
        )
        if isinstance(s, DiLoCoState)
    ]
    return state.anchor


def test_diloco_synchronises_each_period_and_evaluates_theta_sync(tmp_path):
    cfg = _cfg(tmp_path, {"period": 3}, steps=7, checkpoint_every=0)
    trainer = Trainer(cfg)
    summary = trainer.run()
    rows = _rows(cfg)
    sent = [r["sent_bytes"] for r in rows]
    assert [s > 0 for s in sent] == [False, False, True, False, False, True, False]
    # The summary's bytes are the log's: mean, peak and total over every step (the last
    # step sends nothing, so a summary of the last step's bytes would say 0).
    assert summary["sent_bytes_peak"] == max(sent) > 0
    assert summary["sent_bytes_total"] == sum(sent)
    assert summary["sent_bytes_mean"] == pytest.approx(sum(sent) / 7, rel=1e-12)
    dense = 2 * 7 * 4 * summary["params"] / 8
    assert summary["dense_ring_bytes_per_step"] == pytest.approx(dense, abs=1)
    assert summary["sent_vs_dense_ring"] == pytest.approx(sum(sent) / 7 / dense, rel=1e-6)
    assert [r["sync_fragment"] for r in rows] == [-1, -1, 0, -1, -1, 0, -1]
    # Right after a synchronisation every worker holds theta_sync (to a cast).
    assert rows[2]["divergence"] < 1e-10 < rows[3]["divergence"]
    # Evaluation runs on theta_sync, not on the workers' (diverged) parameters or their mean.
    anchor = _host(_anchor(trainer))
    evald = _host(trainer.eval_params())
    params = _host(trainer.params)
    for a, e, p in zip(anchor, evald, params, strict=True):
        assert a.shape == p.shape[1:]  # theta_sync is held once; the workers' rows differ
        np.testing.assert_array_equal(np.broadcast_to(a.astype(e.dtype), e.shape), e)
    assert (
        max(float(np.max(np.abs(p.mean(0) - a))) for p, a in zip(params, anchor, strict=True))
        > 1e-4
    )
    assert np.all(np.isfinite([r["loss"] for r in rows]))


def test_the_link_clock_blocks_without_overlap_and_hides_the_transfer_with_it(tmp_path):
    """tau = 0: a synchronising step costs its compute plus its transfer. tau = 2: the
    transfer starts when the step's compute ends and the merge two steps later waits only
    for what is left of it (checked against the rows' own compute and transfer times)."""
    block = Trainer(_cfg(tmp_path / "a", {"period": 4}, steps=8, checkpoint_every=0))
    block.run()
    for r in _rows(block.cfg):
        want = r["sim_compute_s"] + (r["comm_s"] if r["sent_bytes"] else 0.0)
        assert r["sim_step_s"] == pytest.approx(want, rel=1e-12)
    cfg = _cfg(tmp_path / "b", {"period": 4, "overlap": 2}, steps=8, checkpoint_every=0)
    hide = Trainer(cfg)
    hide.run()
    rows = _rows(cfg)
    t, arrive = 0.0, None
    for r in rows:  # syncs after steps 4 and 8 (0-based 3, 7); merges at 0-based 1, 5
        end = t + r["sim_compute_s"]
        if r["sent_bytes"]:
            arrive = end + r["comm_s"]
        if (r["step"] - 1) % 4 == 1 and r["step"] > 2:
            end = max(end, arrive)
        assert r["sim_step_s"] == pytest.approx(end - t, rel=1e-9), r["step"]
        t = end
    comm = rows[3]["comm_s"]
    assert comm > 2 * rows[4]["sim_compute_s"]  # this network: the transfer is not all hidden
    assert rows[5]["sim_step_s"] > rows[4]["sim_step_s"]  # the merge waited
    assert hide.clock.now < block.clock.now
    # Replayed from the rows on the run's own network: the logged clock (the experiments
    # replay other networks this way).
    replayed = hide.sync.replay(rows, hide.schedule.at(0))
    np.testing.assert_allclose(replayed, [r["sim_step_s"] for r in rows], rtol=1e-9)


def test_resume_is_bit_exact_with_fragments_overlap_and_compression(tmp_path, monkeypatch):
    import train.layout

    sync = {"period": 3, "fragments": 3, "overlap": 1, "compress": "int4"}
    costed, real = [], train.layout.costed
    monkeypatch.setattr(train.layout, "costed", lambda p: costed.append(p) or real(p))
    full = Trainer(_cfg(tmp_path / "a", sync, steps=7))
    full.run()
    # The clock reads the step's HLO once for each of the period's 3 fragment branches, not
    # once a step (a step of a long run would spend most of its host time there), and
    # not once for all of them (each branch's compute is its own).
    assert len(costed) == 3
    Trainer(_cfg(tmp_path / "b", sync, steps=4)).run()  # stops inside a period
    resumed = Trainer(_cfg(tmp_path / "b", sync, steps=7))
    resumed.run(resume=True)
    for a, b in zip(_host(full.params), _host(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_host(full.opt_state), _host(resumed.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert full.clock.now == resumed.clock.now
    a, b = _rows(full.cfg), _rows(resumed.cfg)
    for key in ("step", "loss", "sent_bytes", "sim_time_s", "divergence", "sync_fragment"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    # Fragments: one layer group at a time on the wire.
    assert [r["sync_fragment"] for r in a] == [0, 1, 2, 0, 1, 2, 0]
    summary_a = json.loads((full.cfg.run_dir / "summary.json").read_text())
    summary_b = json.loads((resumed.cfg.run_dir / "summary.json").read_text())
    for key in ("sent_bytes_peak", "sent_bytes_total", "sent_bytes_mean", "valid_loss"):
        assert summary_a[key] == summary_b[key], key


@pytest.mark.parametrize("compress", ["sparseloco", "ar_topk"])
def test_sparse_pseudo_gradients_send_less_and_train(tmp_path, compress):
    dense = Trainer(_cfg(tmp_path / "d", {"period": 2}, steps=4, checkpoint_every=0))
    dense.run()
    sparse_cfg = _cfg(
        tmp_path / "s",
        {"period": 2, "compress": compress, "outer_lr": 1.0, "outer_momentum": 0.0},
        steps=4,
        checkpoint_every=0,
    )
    sparse = Trainer(sparse_cfg)
    sparse.run()
    d = [r["sent_bytes"] for r in _rows(dense.cfg)]
    s = [r["sent_bytes"] for r in _rows(sparse_cfg)]
    assert [x > 0 for x in s] == [x > 0 for x in d] == [False, True, False, True]
    assert 0 < max(s) < max(d) / 3
    rows = _rows(sparse_cfg)
    assert np.all(np.isfinite([r["loss"] for r in rows]))


def test_a_pipeline_runs_diloco_across_its_replicas(tmp_path):
    """DiLoCoX's shape: a 2-stage pipeline inside each of 4 replicas, DiLoCo across them,
    each parameter group a fragment on its own step; evaluation on theta_sync."""
    cfg = _cfg(
        tmp_path,
        {"period": 3, "fragments": 3},
        task="gpt",
        model=SMALL,
        dataset="shakespeare",
        workers=4,
        stages=2,
        microbatches=2,
        global_batch=8,
        steps=6,
        checkpoint_every=0,
        boundary="fp32",
    )
    trainer = Trainer(cfg)
    summary = trainer.run()
    rows = _rows(cfg)
    assert [r["sync_fragment"] for r in rows] == [0, 1, 2, 0, 1, 2]
    assert np.isfinite(summary["valid_loss"])
    # The boundary's p2p traffic every step, plus one group's pseudo-gradient.
    assert len({r["sent_bytes"] for r in rows}) > 1
    blocks = [
        s
        for s in jax.tree_util.tree_leaves(
            trainer.opt_state["blocks"], is_leaf=lambda x: isinstance(x, DiLoCoState)
        )
        if isinstance(s, DiLoCoState)
    ][0].anchor
    evald = trainer.eval_params()
    for a, e in zip(_host(blocks), _host(evald["blocks"]), strict=True):
        np.testing.assert_array_equal(a.astype(e.dtype), e)
    # The embedding and head: theta_sync on their owner stages (0 and the last).
    for name, stage in (("embed", 0), ("head", -1)):
        (state,) = [
            s
            for s in jax.tree_util.tree_leaves(
                trainer.opt_state[name], is_leaf=lambda x: isinstance(x, DiLoCoState)
            )
            if isinstance(s, DiLoCoState)
        ]
        for a, e in zip(_host(state.anchor), _host(evald[name]), strict=True):
            np.testing.assert_array_equal(a[:, 0].astype(e.dtype), e[:, stage])
    # Fragments in input-to-output order: embed, then the blocks, then the head.
    assert "h0: 0 | h1: 1 | h2: 2" in summary["schedule"]


def test_bad_diloco_settings_are_refused(tmp_path):
    for sync, match in [
        ({"period": 3, "overlap": 3}, r"sync.overlap must be an integer in \[0, period - 1\]"),
        (
            {"period": 3, "compress": "int2"},
            "compress must be none, a preset .*did you mean 'int8'",
        ),
        ({"period": 3, "outer_lr": 0}, "sync.outer_lr: input should be greater than 0"),
        ({"period": 3, "outer_momentum": 1.0}, "sync.outer_momentum: input should be less than 1"),
        ({"period": 3, "fused": True}, "sync: unknown key 'fused'"),
        ({"period": 3, "outerlr": 1}, "unknown key 'outerlr'; did you mean 'outer_lr'"),
        ({"period": 0}, "sync.period: input should be greater than or equal to 1"),
        ({"period": 3, "outer_lr": float("inf")}, "sync.outer_lr: must be a finite number"),
        ({"period": 3, "fill_bubbles": True}, "sync: unknown key 'fill_bubbles'"),
        ({"period": 3, "compress": {"name": "int8", "bits": 4}}, "compress int8 sets bits"),
        ({"period": 3, "compress": {"name": "none", "k": 4}}, "compress none takes no"),
        ({"period": 3, "compress": "int4", "reduce": "tree"}, "sync.reduce applies to"),
    ]:
        with pytest.raises(ValueError, match=match):
            _cfg(tmp_path, sync)
    with pytest.raises(ValueError, match="stragglers=.* with sync.method=diloco"):
        _cfg(tmp_path, {"period": 3}, stragglers={"seed": 1, "compute_sigma": 0.3})
    with pytest.raises(ValueError, match="sync.fragments=9 exceeds the model's"):
        Trainer(_cfg(tmp_path, {"period": 9, "fragments": 9}))
    with pytest.raises(ValueError, match="sync.compress.k: input should be greater than"):
        _cfg(tmp_path, {"period": 2, "compress": {"name": "sparseloco", "k": 0}})
    # A ratio that keeps nothing of a fragment is refused when the fragments are known,
    # naming the setting.
    tiny = {"period": 2, "fragments": 2, "compress": {"name": "ar_topk", "ratio": 1e-6}}
    with pytest.raises(ValueError, match=r"sync.compress 'ar_topk'.*ratio must be"):
        Trainer(_cfg(tmp_path, tiny, steps=1)).run()


def test_the_estimate_lays_a_period_on_the_link_clock_and_matches_a_run(tmp_path):
    """``train.estimate`` of a DiLoCo config (compiled from shapes, bytes from the audit)
    against a run of one period (bytes from the logs, time from the trainer's clock): the
    same bytes at the synchronising step, the same period time, the same utilisation."""
    from train.estimate import estimate

    cfg = _cfg(tmp_path, {"period": 4}, steps=4, checkpoint_every=0)
    d = estimate(cfg)["diloco"]
    assert d["period"] == 4 and d["sent_bytes_per_period"] == d["peak_sent_bytes_per_device"]
    Trainer(cfg).run()
    rows = _rows(cfg)
    assert [r["sent_bytes"] for r in rows] == [0, 0, 0, d["peak_sent_bytes_per_device"]]
    assert sum(r["sim_step_s"] for r in rows) == pytest.approx(d["round_s"], rel=1e-6)
    util = sum(r["sim_compute_s"] for r in rows) / sum(r["sim_step_s"] for r in rows)
    assert d["compute_utilisation"] == pytest.approx(util, rel=1e-6)
    assert rows[3]["comm_s"] == pytest.approx(d["sync_comm_s"], rel=1e-9)
