"""The quality study's protocol, fast: one tiny size, a few steps, two methods on small
grids. The tuning keeps every grid point's result and picks the one with the lowest
validation loss; the report gives the chosen setting's loss on the separate test split,
over fresh seeds."""

import importlib.util
import json

import numpy as np
import pytest

from tests.test_trainer import ROOT
from train.data import CompleteWorks


@pytest.fixture(scope="module")
def quality():
    spec = importlib.util.spec_from_file_location("quality", ROOT / "benchmarks" / "quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_test_split_is_apart_from_the_validation_split():
    valid, test = (CompleteWorks(seq_len=32, split=s) for s in ("valid", "test"))
    train = CompleteWorks(seq_len=32, split="train")
    assert valid.blocks and test.blocks and not set(valid.blocks) & set(test.blocks)
    assert not set(train.blocks) & set(valid.blocks + test.blocks)
    assert len(train.blocks) + len(valid.blocks) + len(test.blocks) == 78  # 5.05 MB / 64 KiB
    assert not np.array_equal(valid.get(np.arange(4))["tokens"], test.get(np.arange(4))["tokens"])


def _rec(size, method, setting, valid, test, seed=0, steps=300):
    return dict(size=size, method=method, setting=setting, seed=seed, steps=steps, world=8,
                valid_loss=valid, test_loss=test, finite=True)  # fmt: skip


def test_the_choice_follows_the_validation_split_and_grows_past_an_edge(quality):
    """Validation and test disagree: the choice follows validation. A choice at the end of
    the lr axis adds the next point past it; the next size waits for this one, then runs
    the neighbours of its choice."""
    recs = [_rec("xxs", "dp", {"lr": lr}, valid, test) for lr, valid, test in
            ((1e-3, 3.0, 2.0), (2e-3, 2.9, 2.5), (3e-3, 2.8, 2.6), (6e-3, 2.7, 2.7))]  # fmt: skip
    assert quality.select(recs, "xxs", "dp", 300)["setting"] == {"lr": 6e-3}
    sizes = {"xxs": 300, "xs": 600}
    assert quality.pending("xxs", "dp", 300, recs, sizes) == [{"lr": 1.2e-2}]
    assert quality.pending("xs", "dp", 600, recs, sizes) == [None]  # xxs first
    recs.append(_rec("xxs", "dp", {"lr": 1.2e-2}, 2.75, 1.0))
    assert quality.pending("xxs", "dp", 300, recs, sizes) == []  # inside the axis now
    assert [p["lr"] for p in quality.pending("xs", "dp", 600, recs, sizes)] == [3e-3, 6e-3, 1.2e-2]
    # The next size chooses the low end of the neighbours it ran: the axis's next value
    # below comes next, then half the axis's end.
    recs += [_rec("xs", "dp", {"lr": lr}, v, v, steps=600) for lr, v in ((3e-3, 2.0), (6e-3, 2.1),
                                                             (1.2e-2, 2.2))]  # fmt: skip
    assert quality.pending("xs", "dp", 600, recs, sizes) == [{"lr": 2e-3}]
    recs += [_rec("xs", "dp", {"lr": lr}, v, v, steps=600) for lr, v in ((2e-3, 1.9), (1e-3, 1.8))]
    assert quality.pending("xs", "dp", 600, recs, sizes) == [{"lr": 5e-4}]
    # Narrowing: the neighbours on every axis of a DiLoCo choice, and the choice with the
    # paper's outer step (0.7, 0.9).
    near = {"lr": 3e-3, "outer": (0.3, 0.9)}
    points = quality.grid("diloco_h30", near)
    assert {p["lr"] for p in points} == {2e-3, 3e-3, 6e-3}
    assert {p["outer"] for p in points} == {(0.1, 0.9), (0.3, 0.9), (0.5, 0.9), (0.7, 0.9)}
    assert points[-1] == {"lr": 3e-3, "outer": (0.7, 0.9)}
    assert len(points) == 10 and len(quality.grid("diloco_h30")) == 4 * 5
    # Already a neighbour: not run twice.
    assert len(quality.grid("diloco_h30", {"lr": 3e-3, "outer": (0.5, 0.9)})) == 9
    # An extension at a larger size does not reopen a smaller size's complete grid.
    assert quality.pending("xxs", "dp", 300, [*recs, _rec("xs", "dp", {"lr": 5e-4}, 1.7, 1.7,
                                                          steps=600)], sizes) == []  # fmt: skip


def test_a_setting_reaches_the_config(quality, tmp_path):
    warm = quality.config("xs", "sparseloco_h30_warm", {"lr": 2e-3, "outer": (0.5, 0.9)}, 3,
                          600, tmp_path)  # fmt: skip
    assert (warm.lr, warm.seed, warm.steps) == (2e-3, 3, 600)
    assert warm.sync.outer_lr == 0.5 and warm.sync.outer_momentum == 0.9
    assert warm.sync.warmup_steps == 150 and warm.sync.compress.key == "chunk_topk"
    assert (warm.sync.compress.chunk, warm.sync.compress.k) == (4096, 64)  # the preset
    assert (600 - warm.sync.warmup_steps) % warm.sync.period == 0  # whole periods
    mu = quality.config("xs", "muloco_h30", {"muon_lr": 0.01, "lr": 6e-3, "outer": (1.0, 0.0)},
                        0, 600, tmp_path)  # fmt: skip
    opt = mu.optimizer
    assert (opt.name, opt.muon_lr, opt.lr, mu.sync.outer_momentum) == ("muon", 0.01, 6e-3, 0)
    one = quality.config("xs", "single", {"lr": 1e-3}, 0, 600, tmp_path)
    # The same 1,024 evaluation windows as every method, whatever the batch.
    assert one.workers == 1 and one.global_batch * one.eval_batches == 1024
    assert warm.global_batch * warm.eval_batches == 1024


def test_tuning_picks_the_best_and_reports_fresh_seeds_on_test(quality, tmp_path, monkeypatch):
    methods = {
        "dp": {"fixed": {"aggregator": "ring"}, "grid": {"lr": (1e-4, 6e-3)}},
        "diloco_h2": {
            "fixed": quality._diloco(2),
            "grid": {"lr": (1e-4, 6e-3), "outer": ((1.0, 0.0),)},
        },
    }
    monkeypatch.setattr(quality, "METHODS", methods)
    monkeypatch.setattr(quality, "STEP_AXES", ())  # no extension past the ends here
    monkeypatch.setattr(quality, "FRESH_SEEDS", (1, 2))
    out = tmp_path / "study"
    args = ["--size", "tiny", "--steps", "4", "--out", str(out), "--methods", *methods]
    # A run cut short before its first checkpoint leaves a folder with nothing to resume.
    first = quality.run_path(out, "tiny", "dp", {"lr": 1e-4}, 0, 4)
    stale = out / "scratch" / first.relative_to(out / "runs").with_suffix("")
    (stale / "checkpoints").mkdir(parents=True)
    assert quality.main(["tune", *args]) == 0
    recs = quality.records(out)
    assert len(recs) == 2 + 2  # every grid point kept, each with its rows
    assert all(
        p.with_suffix(".metrics.jsonl.gz").exists() for p in (out / "runs").rglob("*_s0.json")
    )
    for method in methods:
        assert quality.select(recs, "tiny", method, 4)["setting"]["lr"] == 6e-3
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    assert quality.main(["tune", *args]) == 0  # a rerun trains nothing
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")} == before
    assert quality.main(["seeds", *args]) == 0
    monkeypatch.setattr(quality, "LOW_BYTE", ("diloco_h2",))
    assert quality.main(["extend", *args]) == 0
    long = [r for r in quality.records(out) if r["steps"] == 4 * quality.CAP]
    assert [(r["method"], r["seed"]) for r in long] == [("diloco_h2", 1)]
    assert quality.main(["report", "--out", str(out)]) == 0
    summary = json.loads((out / "quality.json").read_text())["tiny"]
    reach = summary["_time_to_dp"]
    dp_valid = [r["valid_loss"] for r in quality.records(out) if r["method"] == "dp"
                and r["seed"] > 0]  # fmt: skip
    assert reach["target_valid_loss"] == pytest.approx(np.mean(dp_valid))
    hit = next((c for c in long[0]["valid_curve"] if c[2] <= reach["target_valid_loss"]), None)
    assert reach["methods"]["diloco_h2"]["tokens"] == (hit[0] if hit else None)
    for method in methods:
        fresh = [r for r in quality.records(out) if r["method"] == method and r["seed"] > 0
                 and r["steps"] == 4]  # fmt: skip
        assert sorted(r["seed"] for r in fresh) == [1, 2]
        assert fresh[0]["valid_loss"] != fresh[1]["valid_loss"]  # the seed reaches the run
        # Reported: the fresh seeds' test loss, not the choosing run, not validation.
        assert summary[method]["test_loss"] == pytest.approx(
            np.mean([r["test_loss"] for r in fresh])
        )
    gaps = [summary["diloco_h2"]["test_by_seed"][s] / summary["dp"]["test_by_seed"][s] - 1
            for s in ("1", "2")]  # fmt: skip
    assert summary["diloco_h2"]["gap_vs_dp"] == pytest.approx(np.mean(gaps))
    assert "| dp |" in (out / "quality.md").read_text()
    assert (out / "curves_tiny.png").stat().st_size > 10_000


def test_the_summary_test_loss_is_the_test_split(tmp_path):
    """The trainer's ``test_loss`` is its model's loss on the test split's windows, not the
    validation split's."""
    from train.config import Config
    from train.trainer import Trainer

    model = {"num_layers": 1, "width": 32, "num_heads": 2, "seq_len": 32}
    cfg = Config(name="t", model=model, dataset="shakespeare_complete", steps=2, global_batch=16,
                 checkpoint_every=0, progress=False, out_dir=str(tmp_path))  # fmt: skip
    t = Trainer(cfg)
    summary = t.run()
    test = t.layout.evaluate(t.ctx, CompleteWorks(seq_len=32, split="test"))["loss"]
    valid = t.layout.evaluate(t.ctx, CompleteWorks(seq_len=32, split="valid"))["loss"]
    assert summary["test_loss"] == pytest.approx(test) and summary["valid_loss"] == pytest.approx(
        valid
    )
    assert test != valid


def test_the_scaling_fit_finds_where_a_method_meets_dp(quality):
    """Losses on exact power laws: the fit recovers them, and the crossing is where the two
    laws meet; a method falling slower than DP never meets it."""
    sizes = (1e3, 3e3, 9e3)
    # "parallel": a constant gap, its exponent DP's up to rounding (its crossing would be
    # past any float; the fit says none, where a direct power overflowed).
    laws = {"dp": (5.0, 0.10), "closing": (6.0, 0.12), "drifting": (6.0, 0.08),
            "parallel": (5.5, 0.10)}  # fmt: skip
    summary = {
        f"z{i}": {
            m: {"params": int(n), "test_loss": a * int(n) ** -alpha}
            for m, (a, alpha) in laws.items()
        }  # fmt: skip
        for i, n in enumerate(sizes)
    }
    summary["z1"]["two_sizes"] = {"params": 3000, "test_loss": 4.0}
    summary["z2"]["two_sizes"] = {"params": 9000, "test_loss": 3.9}
    fits = quality.scaling_fit(summary)
    assert "two_sizes" not in fits  # a law through two points says nothing of a trend
    for m, (a, alpha) in laws.items():
        assert fits[m]["a"] == pytest.approx(a, rel=1e-6)
        assert fits[m]["alpha"] == pytest.approx(alpha, rel=1e-6)
    assert fits["closing"]["meets_dp_at"] == pytest.approx((6.0 / 5.0) ** (1 / 0.02), rel=1e-5)
    assert fits["drifting"]["meets_dp_at"] is None and fits["dp"]["meets_dp_at"] is None
    assert fits["parallel"]["meets_dp_at"] is None
    text = quality.render_fits(fits)
    assert "meets DP at" in text and "| parallel | 3 |" in text and "none ahead" in text


def test_the_workers_stage_runs_each_choice_at_fewer_workers_and_reports_them(
    quality, tmp_path, capsys
):
    """The ``workers`` stage plans each method's chosen setting (not another grid point)
    at 2 and 4 workers with seed 1, skips a method of a fixed worker count, and the report
    sets each count's test loss beside DP's at the same count."""
    out = tmp_path / "study"

    def keep(method, setting, valid, test, seed=0, world=8):
        rec = {**_rec("xxs", method, setting, valid, test, seed=seed), "world": world,
               "params": 10, "tokens": 100, "epochs": 0.1, "total_bytes": 1.0,
               "peak_bytes": 1.0, "sim_s": dict.fromkeys(quality.NETWORKS, 1.0)}  # fmt: skip
        path = quality.run_path(out, "xxs", method, setting, seed, 300, world)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec))

    good = {"lr": 6e-3, "outer": (1.0, 0.0)}
    keep("dp", {"lr": 3e-3}, 2.5, 2.5)
    keep("dp", {"lr": 6e-3}, 2.4, 2.6)
    keep("diloco_h30", {"lr": 3e-3, "outer": (1.0, 0.0)}, 2.9, 2.0)
    keep("diloco_h30", good, 2.7, 2.8)
    keep("single", {"lr": 6e-3}, 2.9, 2.9)
    jobs = quality.plan("workers", "xxs", ["dp", "diloco_h30"], 300, out)
    assert sorted((m, quality.setting_key(s), seed, w) for m, s, seed, w in jobs) == [
        ("diloco_h30", "lr0.006_outer1-0", 1, 2), ("diloco_h30", "lr0.006_outer1-0", 1, 4),
        ("dp", "lr0.006", 1, 2), ("dp", "lr0.006", 1, 4),
    ]  # fmt: skip
    # The 8-worker run of seed 1 (the seeds stage's) is kept: the 2- and 4-worker runs are
    # still to train.
    keep("dp", {"lr": 6e-3}, 2.2, 2.2, seed=1)
    args = ["workers", "--size", "xxs", "--steps", "300", "--out", str(out), "--dry-run"]
    assert quality.main([*args, "--methods", "dp", "single"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed == ["dp lr0.006 seed 1 workers 2", "dp lr0.006 seed 1 workers 4"]
    for world, dp, dl in ((2, 2.0, 2.2), (4, 2.1, 2.4), (8, 2.2, 2.75)):
        keep("dp", {"lr": 6e-3}, dp, dp, seed=1, world=world)
        keep("diloco_h30", good, dl, dl, seed=1, world=world)
    summary = quality.summarise(quality.records(out))
    worlds = summary["xxs"]["_workers"]["methods"]
    assert worlds["diloco_h30"] == {"2": 2.2, "4": 2.4, "8": 2.75}
    text = quality.render(summary, [])
    assert "| diloco_h30 | 2.200 (+10.0%) | 2.400 (+14.3%) | 2.750 (+25.0%) |" in text
    assert "single" not in worlds


def test_dps_all_reduce_is_priced_at_the_faster_of_ring_and_tree(quality):
    """A logged ring all-reduce of 8 workers (14 rounds) is priced as a tree (6 rounds,
    each carrying the whole message) where latency dominates, as the ring where bandwidth
    does; other collectives as logged."""
    from jaxcomm.network import Network

    m = 1_000_000
    ring = ["ring_allreduce", 1, m, 1.0, 14, 2 * 7 * m // 8]
    gather = ["allgather", 1, 100, 1.0, 3, 700]
    rows = [{"sim_compute_s": 0.5, "wire": [ring, gather]}]
    slow = Network.parse("50ms,10Gbps")  # latency-bound: the tree's 6 rounds win
    fast = Network.parse("1us,100Mbps")  # bandwidth-bound: the ring's 1.75 M bytes win
    other = slow.wire_seconds(3, 700)
    got = quality.dense_at_best(rows, slow)
    assert got == pytest.approx(0.5 + slow.wire_seconds(6, 6 * m) + other)
    assert got < 0.5 + slow.wire_seconds(14, 2 * 7 * m // 8) + other
    assert quality.dense_at_best(rows, fast) == pytest.approx(
        0.5 + fast.wire_seconds(14, 2 * 7 * m // 8) + fast.wire_seconds(3, 700)
    )


def test_an_outer_step_chosen_at_an_end_of_its_axis_runs_the_next_one_past_it(quality):
    """DiLoCo's outer axis grows past its ends as its step sizes do: plain averaging chosen
    runs outer SGD at lr 1.5 (then 2.0), the paper's Nesterov 0.7 / 0.9 chosen runs lr 1.0;
    an extended value sits next to the end it grew from, for the next size's neighbours."""
    sizes = {"xxs": 300}

    def full(best_outer):
        return [_rec("xxs", "diloco_h30", {"lr": lr, "outer": o},
                     2.0 if (lr, o) == (3e-3, best_outer) else 3.0, 3.0)
                for lr in quality.LRS for o in quality.OUTERS]  # fmt: skip

    recs = full((1.0, 0.0))
    assert quality.pending("xxs", "diloco_h30", 300, recs, sizes) == [
        {"lr": 3e-3, "outer": (1.5, 0.0)}
    ]
    for value, past in (((1.5, 0.0), (2.0, 0.0)), ((2.0, 0.0), None)):
        recs.append(_rec("xxs", "diloco_h30", {"lr": 3e-3, "outer": value}, 1.9, 3.0))
        # The new value's neighbours on the lr axis first (the choice's neighbourhood on
        # the extended axes; not the whole plane), then past.
        plane = quality.pending("xxs", "diloco_h30", 300, recs, sizes)
        assert plane == [{"lr": lr, "outer": value} for lr in (2e-3, 6e-3)]
        recs += [_rec("xxs", "diloco_h30", p, 2.8, 3.0) for p in plane]
        after = quality.pending("xxs", "diloco_h30", 300, recs, sizes)
        assert after == ([{"lr": 3e-3, "outer": past}] if past else [])
    outer = quality.axes("diloco_h30", recs)["outer"]
    assert outer[:3] == ((2.0, 0.0), (1.5, 0.0), (1.0, 0.0))
    near = {"lr": 3e-3, "outer": (1.5, 0.0)}
    assert {p["outer"] for p in quality.grid("diloco_h30", near, recs)} == {
        (2.0, 0.0), (1.5, 0.0), (1.0, 0.0), (0.7, 0.9)
    }  # fmt: skip
    recs = full((0.7, 0.9))
    assert quality.pending("xxs", "diloco_h30", 300, recs, sizes) == [
        {"lr": 3e-3, "outer": (1.0, 0.9)}
    ]
