"""Adaptive compression ratio: the Pareto knee, the controller's triggers, the trainer's
snapshot-and-restore trials, collective switches and bit-exact resume."""

import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcomm._src.adaptive import AdaptiveRatio, Trial, knee, non_dominated
from jaxcomm._src.network import Network
from train.config import Config, load_config
from train.trainer import Trainer


def test_non_dominated_and_knee_by_hand():
    pts = [(1.0, 9.0), (2.0, 2.0), (9.0, 1.0), (3.0, 3.0), (2.0, 2.0)]
    assert non_dominated(pts) == [0, 1, 2, 4]  # (3, 3) is dominated by (2, 2)
    assert knee(pts) == 1  # nearest the ideal after scaling
    assert knee([(5.0, 1.0)]) == 0
    with pytest.raises(ValueError, match="NaN"):
        non_dominated([(1.0, float("nan"))])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(*[st.floats(0, 100, allow_nan=False)] * 3), min_size=1, max_size=7))
def test_knee_is_on_the_front_and_the_front_is_exact(points):
    front = set(non_dominated(points))
    for i, p in enumerate(points):
        dominated = any(all(a <= b for a, b in zip(q, p, strict=True)) and q != p for q in points)
        assert (i not in front) == dominated
    assert knee(points) in front


# Integers, scaled and shifted by integers: exact in float64, so no rounding can merge two
# points (a shifted 2.2e-16 would round to the shift and change the front).
@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(*[st.integers(0, 100).map(float)] * 2), min_size=1, max_size=6),
    st.integers(1, 100).map(float),
    st.integers(0, 1000).map(float),
)
def test_knee_scalings(points, factor, shift):
    """Both scalings ignore units; only "range" ignores a constant added to an objective."""
    scaled = [(a * factor, b) for a, b in points]
    for normalize in ("max", "range"):
        assert knee(scaled, normalize=normalize) == knee(points, normalize=normalize)
    shifted = [(a + shift, b) for a, b in points]
    assert knee(shifted, normalize="range") == knee(points, normalize="range")


def test_knee_by_max_weighs_an_objective_by_how_much_it_moves():
    # Sync ms of an all-gather at 1 Gbps, and at 25 Gbps with 150 ms of latency; inverse
    # gains of a real search.
    inv_gain = [1.6, 3.8, 7.4, 11.9, 21.3]
    bw_term = [50.0, 17.0, 5.6, 2.0, 0.5]
    bandwidth_bound = list(zip(bw_term, inv_gain, strict=True))
    latency_bound = [(150.0 + t / 25, g) for t, g in bandwidth_bound]
    assert knee(latency_bound, normalize="max") == 0  # times differ by 1%: take the gain
    assert knee(bandwidth_bound, normalize="max") == 2
    assert knee(latency_bound, normalize="range") == knee(bandwidth_bound, normalize="range")
    with pytest.raises(ValueError, match="normalize must be one of"):
        knee(latency_bound, normalize="minmax")
    with pytest.raises(ValueError, match=">= 0"):
        knee([(-1.0, 2.0)])


def _search_of_a_1m_model(**kw):
    """Trials as a search of the 1.1M-parameter MLP measured them."""
    c = AdaptiveRatio(**kw)
    gains = (0.64, 0.27, 0.13, 0.084, 0.047)
    compress = (5.3e-4, 3.7e-4, 2.6e-4, 1.4e-4, 7.6e-5)
    c.record([Trial(r, g, t) for r, g, t in zip(c.candidates, gains, compress, strict=True)], 0)
    return c


def test_latency_and_bandwidth_move_the_ratio():
    """With the default objectives a latency-bound network keeps a high ratio (sync time
    barely depends on it) and a bandwidth-bound one takes a low ratio; the paper-style
    min-max knee chooses the same ratio on both."""
    nbytes = 4 * 1_126_000
    latency_bound, bandwidth_bound = Network(50e-3, 25e9), Network(1e-3, 1e9)
    c = _search_of_a_1m_model()
    assert c.choose(nbytes, 8, latency_bound)[0] == 0.1
    assert c.choose(nbytes, 8, bandwidth_bound)[0] == 0.011
    r = _search_of_a_1m_model(objectives="paper", normalize="range")
    assert r.choose(nbytes, 8, latency_bound)[0] == r.choose(nbytes, 8, bandwidth_bound)[0]
    with pytest.raises(ValueError, match="objectives must be one of"):
        AdaptiveRatio(objectives="three")
    with pytest.raises(ValueError, match="normalize must be one of"):
        AdaptiveRatio(normalize="z")


def _controller(**kw):
    c = AdaptiveRatio(candidates=(0.1, 0.01, 0.001), trial_steps=3, min_interval=0, **kw)
    c.record([Trial(0.1, 0.9, 1e-3), Trial(0.01, 0.5, 1e-3), Trial(0.001, 0.1, 1e-3)], 0)
    return c


def test_controller_triggers():
    net = Network(1e-3, 10e9)
    fresh = AdaptiveRatio()
    assert fresh.due(0, net) == "search"
    c = _controller()
    ratio, reduce = c.choose(4_000_000, 8, net)
    assert ratio in (0.1, 0.01, 0.001) and reduce in ("ring", "tree", "allgather")
    assert c.due(1, net) is None
    assert c.due(1, Network(1.05e-3, 10e9)) is None  # within 10%
    assert c.due(1, Network(1e-3, 5e9)) == "choose"
    gain = c.trials[ratio].gain
    for _ in range(3):  # warm-up after the switch: far from the trial gain, no trigger
        c.observe(gain * 0.5)
        assert c.due(4, net) is None
    settled = gain * 0.6
    for g in (settled, settled * 1.05, settled * 0.95):  # the reference window
        c.observe(g)
    assert c.reference == pytest.approx(settled)
    for g in (settled, settled * 1.05, settled * 0.98):
        c.observe(g)
    assert c.due(7, net) is None  # mean within 10% of the reference
    for _ in range(3):
        c.observe(settled * 0.5)
    assert c.due(10, net) == "search"
    slow = _controller(gain_threshold=0.1)
    slow.min_interval = 100
    slow.choose(4_000_000, 8, net)
    for _ in range(9):
        slow.observe(0.01 if _ < 6 else 0.001)
    assert slow.reference == pytest.approx(0.01)
    assert slow.due(9, net) is None  # too soon after the search


def test_choice_follows_the_network():
    """Low latency / high bandwidth favours a larger ratio; the collective is the model's
    cheapest for the chosen ratio."""
    c = _controller()
    fast = c.choose(400_000_000, 8, Network(1e-4, 100e9))
    slow = c.choose(400_000_000, 8, Network(50e-3, 1e9))
    assert fast[0] >= slow[0]
    from _alpha_beta import hand_choice

    want = hand_choice(400_000_000, 8, slow[0], 50e-3, 1e9)  # the paper's formulas by hand
    assert slow[1] == {"allgather": "allgather", "art_ring": "ring", "art_tree": "tree"}[want]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="distinct"):
        AdaptiveRatio(candidates=(0.1, 0.01, 0.1))
    with pytest.raises(ValueError, match=r"candidates\[1\]"):
        AdaptiveRatio(candidates=(0.1, 0.0))
    with pytest.raises(ValueError, match="trial_steps"):
        AdaptiveRatio(trial_steps=0)
    with pytest.raises(ValueError, match="needs aggregator ar_topk"):
        load_config(None, ["adaptive={trial_steps: 2}"])
    with pytest.raises(ValueError, match="adaptive .*unexpected keyword"):
        load_config(None, ["aggregator=ar_topk", "adaptive={bogus: 1}"])
    # The one combination the composed trainer still refuses names both settings.
    with pytest.raises(
        ValueError, match=r"adaptive=.* with sync 'local_sgd'.*local SGD runs no aggregator"
    ):
        load_config(
            None,
            ["aggregator=none", "adaptive={trial_steps: 2}", "sync={method: local_sgd, period: 2}"],
        )


def _cfg(tmp_path, **kw):
    base = dict(
        name="adaptive",
        task="mlp",
        model={"features": [32]},
        dataset="digits",
        workers=8,
        global_batch=64,
        steps=8,
        lr=0.05,
        optimizer="sgd",
        aggregator="ar_topk",
        aggregator_args={"ratio": 0.1, "select": "star"},
        adaptive={"trial_steps": 2, "min_interval": 2},
        network="0:1ms,10Gbps;4:0us,1Gbps",
        compute="v100",
        checkpoint_every=4,
        progress=False,
        out_dir=str(tmp_path / "run"),
    )
    base.update(kw)
    return Config(**base)


def _host(tree):
    return [np.array(a) for a in jax.tree.leaves(jax.device_get(tree))]


def test_a_search_leaves_every_piece_of_state_bit_identical(tmp_path):
    trainer = Trainer(_cfg(tmp_path, steps=3))
    trainer.run()
    before = (_host(trainer.params), _host(trainer.opt_state), trainer.loader.position)
    clock = trainer.clock.now
    trials = trainer.control.search(trainer.ctx, Network(1e-3, 1e9))
    after = (_host(trainer.params), _host(trainer.opt_state), trainer.loader.position)
    for a, b in zip(before[0] + before[1], after[0] + after[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert before[2] == after[2]
    assert [t.ratio for t in trials] == list(trainer.control.controller.candidates)
    gains = [t.gain for t in trials]
    assert gains == sorted(gains, reverse=True) and gains[0] > gains[-1]  # less kept, less gain
    assert trainer.clock.now > clock  # the trials' time is charged
    assert trainer.control.controller.ratio in trainer.control.controller.candidates


def test_trial_steps_draw_their_own_stragglers(tmp_path):
    """With stragglers, each candidate's trial steps are charged with their own draws
    (stream 2 + candidate), not with those of the training steps that follow."""
    trainer = Trainer(_cfg(tmp_path, steps=1, stragglers={"seed": 4, "compute_sigma": 0.5}))
    trainer.run()
    streams = []
    simulate = trainer.ctx.simulate_logged

    def record(*args, stream=0, **kw):
        streams.append((args[2], stream))
        return simulate(*args, stream=stream, **kw)

    trainer.ctx.simulate_logged = record
    trainer.control.search(trainer.ctx, Network(1e-3, 1e9))
    n = len(trainer.control.controller.candidates)
    steps = trainer.control.controller.trial_steps
    want = [(trainer.step + i, 2 + c) for c in range(n) for i in range(steps)]
    assert streams == want
    s = trainer.stragglers
    assert not np.array_equal(s.compute_factors(1, 8), s.compute_factors(1, 8, stream=2))


def test_ratio_and_collective_are_logged_and_switch_with_the_network(tmp_path):
    cfg = _cfg(tmp_path)
    Trainer(cfg).run()
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["search"] == "search" and rows[0]["search_s"] > 0
    assert all({"ratio", "collective", "gain", "search"} <= set(r) for r in rows)
    # 1 ms / 10 Gbps: latency-bound, all-gather; 0 latency / 1 Gbps: the ring's bandwidth.
    assert rows[0]["collective"] == "allgather"
    assert rows[4]["search"] in ("choose", "search") and rows[4]["collective"] == "ring"
    assert rows[-1]["wire"][0][0] == "art_ring"


def test_resume_is_bit_exact(tmp_path):
    full = Trainer(_cfg(tmp_path / "a"))
    full.run()
    Trainer(_cfg(tmp_path / "b", steps=4)).run()
    resumed = Trainer(_cfg(tmp_path / "b"))
    resumed.run(resume=True)
    for a, b in zip(_host(full.params), _host(resumed.params), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_host(full.opt_state), _host(resumed.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)
    assert full.control.controller.state_dict() == resumed.control.controller.state_dict()
    rows = lambda d: [  # noqa: E731
        json.loads(x) for x in (d / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["ratio"] for r in rows(tmp_path / "a")] == [r["ratio"] for r in rows(tmp_path / "b")]
    assert full.clock.now == resumed.clock.now


def test_the_shipped_configs_run_from_the_command_line(tmp_path):
    """``configs/artopk_*.yaml`` load and run a few steps through ``python -m train``
    (the adaptive one through the adaptive trainer)."""
    from train.cli import main

    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    for name in ("artopk_default", "artopk_adaptive"):
        out = tmp_path / name
        code = main(
            [
                "--config",
                str(root / "configs" / f"{name}.yaml"),
                "--set",
                "steps=3",
                "--set",
                "model.features=[32]",
                "--set",
                "adaptive.trial_steps=1" if name == "artopk_adaptive" else "eval_batches=1",
                "--set",
                f"out_dir={out}",
                "--no-progress",
            ]
        )
        assert code == 0
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and all("gain" in r for r in rows)
        assert ("collective" in rows[0]) == (name == "artopk_adaptive")


def test_a_model_too_small_for_some_candidates_skips_them(tmp_path, capsys):
    """An MLP of 64-2-10 (160 parameters): 0.004 and 0.001 give k = 0 and are left out with
    a line; the search runs over the rest."""
    trainer = Trainer(_cfg(tmp_path, model={"features": [2]}, steps=3))
    assert trainer.num_params() == 160
    assert trainer.control.controller.candidates == (0.1, 0.033, 0.011)
    assert "left out" in capsys.readouterr().out
    trainer.run()
    trials = trainer.control.search(trainer.ctx, Network(1e-3, 1e9))
    assert [t.ratio for t in trials] == list(trainer.control.controller.candidates)


PIPE = dict(
    task="gpt",
    model={"num_layers": 2, "width": 32, "num_heads": 2, "seq_len": 16},
    dataset="shakespeare",
    workers=2,
    stages=2,
    microbatches=2,
    global_batch=8,
    train_samples=16,
    boundary="aqsgd",
    fw_bits=3,
    optimizer="adam",
    lr=3e-3,
    aggregator_args={"select": "star"},
    adaptive={"candidates": [0.1, 0.01], "trial_steps": 1, "min_interval": 2},
)


def test_adaptive_ratio_on_a_pipelines_data_axis(tmp_path):
    """The adaptive AR-Topk ratio drives a pipeline's data-parallel averaging (AQ-SGD
    boundaries): a search leaves parameters, optimizer state, data position and message
    buffers bit-identical; each step runs and logs the chosen ratio, and its logged traffic
    equals the compiled programs' of that ratio and boundary mode. (Its bit-exact resume,
    across two processes, is test_distributed's ``pipeline_adaptive`` combination.)"""
    cfg = _cfg(tmp_path / "a", steps=5, checkpoint_every=0, **PIPE)
    trainer = Trainer(cfg)
    traffic = []
    trainer.run(metrics_cb=lambda row: traffic.append((row, trainer.last_traffic)))
    rows = [r for r, _ in traffic]
    assert rows[0]["search"] == "search" and rows[0]["search_s"] > 0
    assert {r["ratio"] for r in rows} <= {0.1, 0.01}
    for r, t in traffic:
        seen = r["step"] > 2  # 16 samples, 8 per step: steps 3+ send deltas
        audit = trainer.step_audit((seen, (r["ratio"], r["collective"])))
        np.testing.assert_array_equal(t.sent, audit.sent)
        np.testing.assert_array_equal(t.path_bytes.sum(-1), audit.path_bytes)
    buffers = [b.read(np.arange(16)).copy() for b in trainer.layout.feed.buffers]
    before = (_host(trainer.params), _host(trainer.opt_state), trainer.loader.position)
    trainer.control.search(trainer.ctx, Network(1e-3, 1e9))
    after = (_host(trainer.params), _host(trainer.opt_state), trainer.loader.position)
    for a, b in zip(before[0] + before[1], after[0] + after[1], strict=True):
        np.testing.assert_array_equal(a, b)
    assert before[2] == after[2]
    for buf, old in zip(trainer.layout.feed.buffers, buffers, strict=True):
        np.testing.assert_array_equal(buf.read(np.arange(16)), old)
