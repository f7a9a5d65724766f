"""``benchmarks/gpu.py`` runs every part at CPU sizes and records what it measured, so that
time on an accelerator goes to measuring."""

import json
import os
import subprocess
import sys

from tests.test_trainer import ROOT


def test_the_accelerator_benchmark_runs_every_part_on_the_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = tmp_path / "gpu"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--small", "--steps", "4", "--out", str(out),
         "--pytest-args", "-m quick -k test_ring_all_reduce_equals_psum"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "gpu.json").read_text())
    assert record["meta"]["backend"] == "cpu" and record["meta"]["devices"] == 8
    codecs = {r["codec"]: r for r in record["codecs"]}
    for name in ("quantize 4-bit", "top-k 0.01 sample", "top-k 0.01 auto"):
        assert codecs[name]["time_x_copy"] > 0 and codecs[name]["share"] > 0
        assert codecs[name]["share_of"] == "the copy's rate"  # no HBM peak for a CPU
    # 8 simulated devices: the collectives are measured, every result checked against psum.
    (row,) = record["collectives"]
    assert row["elements"] == 65536 and row["ring_sent"] == 2 * 7 * (65536 // 8) * 4
    step = record["step"]
    assert step["workers"] == 8 and step["measured_step_s"] > 0 and step["fitted_mfu"] is None
    assert record["tests"]["passed"] >= 1 and record["tests"]["rc"] == 0
    assert "failed" not in record["tests"]
    page = (out / "README.md").read_text()
    for part in ("## Codecs", "## Collectives", "## The main job's step", "## Tests"):
        assert part in page
    for name in ("codecs.md", "topk_selection.md", "collectives.md"):
        assert (out / name).is_file()
