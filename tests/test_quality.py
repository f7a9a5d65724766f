"""The quality study's protocol, fast: one tiny size, a few steps, two methods on small
grids. The tuning keeps every grid point's result and picks the one with the lowest
validation loss; the report gives the chosen setting's loss on the separate test split."""

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
    # The held-out text differs (not one split twice).
    assert not np.array_equal(valid.get(np.arange(4))["tokens"], test.get(np.arange(4))["tokens"])


def test_a_narrowed_grid_keeps_the_neighbours(quality):
    near = {"lr": 3e-3, "outer": (0.3, 0.9), "warm": 0.0}
    points = quality.grid("diloco_h30", near)
    assert {p["lr"] for p in points} == {2e-3, 3e-3, 6e-3}
    assert {p["outer"] for p in points} == {(0.1, 0.9), (0.3, 0.9), (0.5, 0.9)}
    assert {p["warm"] for p in points} == {0.0, 0.1}
    assert len(points) == 3 * 3 * 2 and len(quality.grid("diloco_h30")) == 4 * 5 * 2


def test_tuning_picks_the_best_and_reports_the_held_out_split(quality, tmp_path, monkeypatch):
    methods = {
        "dp": {"fixed": {"aggregator": "ring"}, "grid": {"lr": (1e-4, 6e-3)}},
        "diloco_h2": {
            "fixed": quality._diloco(2),
            "grid": {"lr": (1e-4, 6e-3), "outer": ((1.0, 0.0),)},
        },
    }
    monkeypatch.setattr(quality, "METHODS", methods)
    out = tmp_path / "study"
    args = ["--size", "tiny", "--steps", "4", "--out", str(out), "--methods", *methods]
    assert quality.main(["tune", *args]) == 0
    recs = quality.records(out)
    assert len(recs) == 2 + 2  # every grid point kept
    for method in methods:
        mine = [r for r in recs if r["method"] == method]
        best = quality.select(recs, "tiny", method)
        assert best["valid_loss"] == min(r["valid_loss"] for r in mine)
        assert best["setting"]["lr"] == 6e-3  # 1e-4 barely moves in 4 steps
    # A rerun trains nothing: the kept results are reused.
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")}
    assert quality.main(["tune", *args]) == 0
    assert {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*.json")} == before
    assert quality.main(["seeds", *args]) == 0
    assert quality.main(["report", "--out", str(out)]) == 0
    summary = json.loads((out / "quality.json").read_text())["tiny"]
    for method in methods:
        chosen = [r for r in quality.records(out) if r["method"] == method
                  and r["setting"] == quality.select(recs, "tiny", method)["setting"]]  # fmt: skip
        assert sorted(r["seed"] for r in chosen) == [0, 1, 2]
        tests = [r["test_loss"] for r in chosen]
        # The reported loss is the test split's mean over seeds, not the validation loss
        # the choice was made on.
        assert summary[method]["test_loss"] == pytest.approx(np.mean(tests))
        assert all(r["test_loss"] != r["valid_loss"] for r in chosen)
    assert summary["diloco_h2"]["gap_vs_dp"] == pytest.approx(
        summary["diloco_h2"]["test_loss"] / summary["dp"]["test_loss"] - 1
    )
    assert "| dp |" in (out / "quality.md").read_text()
