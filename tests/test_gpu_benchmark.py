"""``benchmarks/gpu.py`` runs every part at CPU sizes and records what it measured, so that
time on an accelerator goes to measuring."""

import json
import subprocess
import sys

import pytest
from conftest import child_env

from tests.test_trainer import ROOT


def test_the_accelerator_benchmark_runs_every_part_on_the_cpu(tmp_path):
    env = child_env()
    out = tmp_path / "gpu"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--small", "--steps", "4", "--out", str(out),
         "--device", "h100", "--pytest-args",
         "tests/test_collectives.py -n 0 -k test_ring_all_reduce_equals_psum"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((out / "gpu.json").read_text())
    assert record["meta"]["backend"] == "cpu" and record["meta"]["devices"] == 8
    codecs = {r["codec"]: r for r in record["codecs"]}
    # --device names the accelerator whose HBM bandwidth and roofline the figures use (on
    # a GPU it is detected), so the branches a GPU run takes run here too.
    for name in ("quantize 4-bit", "top-k 0.01 sample", "top-k 0.01 auto"):
        r = codecs[name]
        assert r["time_x_copy"] > 0 and r["share_of"] == "h100 HBM"
        assert 0 < r["share"] < 0.05  # this CPU against 3.35 TB/s (of its own rate: ~0.3-1)
    # 8 simulated devices: the collectives are measured, every result checked against psum.
    (row,) = record["collectives"]
    assert row["elements"] == 65536 and row["ring_sent"] == 2 * 7 * (65536 // 8) * 4
    step = record["step"]
    assert step["workers"] == 8 and step["measured_step_s"] > 0
    assert step["fitted_mfu"] == pytest.approx(
        step["assumed_mfu"] * step["modelled_step_s"] / step["measured_step_s"]
    )
    assert record["tests"]["passed"] >= 1 and record["tests"]["rc"] == 0
    assert "failed" not in record["tests"]
    page = (out / "README.md").read_text()
    for part in ("## Codecs", "## Collectives", "## The main job's step", "## Tests"):
        assert part in page
    for name in ("codecs.md", "topk_selection.md", "collectives.md"):
        assert (out / name).is_file()


def test_device_kinds_map_to_the_table_or_to_nothing():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    match_device = gpu.match_device

    assert match_device("NVIDIA H100 80GB HBM3") == "h100"
    assert match_device("NVIDIA H200") == "h200"
    assert match_device("NVIDIA GeForce RTX 2080 Ti") == "rtx2080ti"
    assert match_device("Tesla V100-SXM2-32GB") == "v100"
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
                  "NVIDIA L4"):  # fmt: skip
        assert match_device(other) is None
