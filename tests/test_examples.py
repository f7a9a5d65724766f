"""Every program in ``examples/`` runs a few steps: its loss falls and the unlogged-traffic
check of its compiled step finds nothing."""

import importlib.util
import pathlib
import subprocess
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
    sys.path.insert(0, str(EXAMPLES))  # examples import each other as scripts do
    try:
        spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLES))


def _falls(losses, k=3):
    losses = np.asarray(losses)
    assert np.all(np.isfinite(losses))
    assert losses[-k:].mean() < 0.9 * losses[:k].mean(), losses


@pytest.mark.parametrize("aggregator", ["ar_topk", "ec_quantized", "marsit"])
def test_nnx_digits(aggregator):
    out = _load("nnx_digits").main(["--aggregator", aggregator, "--steps", "20"])
    _falls(out["losses"])
    assert out["unlogged"] == ()


def test_nnx_flag_offers_every_aggregator():
    from test_contract import CASES

    mod = _load("nnx_digits")
    offered = {f.__code__.co_names[-1] for f in [*mod.AGGREGATORS.values(), *mod.WHOLE.values()]}
    public = {c.make.__code__.co_names[-1] for c in CASES.values() if not c.local}
    assert public <= offered, public - offered


def test_linen_trainstate():
    out = _load("linen_trainstate").main(["--steps", "15"])
    _falls(out["losses"])
    assert out["unlogged"] == ()
    assert 0 < out["sent"] < 100_000  # 4-bit codes, well under the float32 ring's 464,912


def test_pure_jax():
    out = _load("pure_jax").main(["--steps", "51"])
    assert out["losses"][-1] < 0.6 * out["losses"][0]  # full-data loss, after steps 0 and 50
    assert out["unlogged"] == ()
    assert 0 < out["audited"] < 10_000


@pytest.mark.parametrize("sync", ["local_sgd", "dreamddp"])
def test_local_sgd(sync):
    out = _load("local_sgd").main(["--sync", sync, "--steps", "12", "--period", "3"])
    _falls(out["losses"])
    assert out["unlogged"] == ()


def test_pipeline_aqsgd():
    out = _load("pipeline_aqsgd").main(["--epochs", "2", "--samples", "256"])
    _falls(out["losses"])
    assert out["unlogged"] == ()
    fp32, deltas = out["sent"][False], out["sent"][True]
    assert deltas[0] * 8 < fp32[0]  # stage 0 sends 2-bit deltas, not float32


def test_multiprocess():
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "multiprocess.py"), "--steps", "26"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for p in (0, 1):
        lines = [x for x in run.stdout.splitlines() if x.startswith(f"[process {p}]")]
        losses = [float(x.split("loss")[1]) for x in lines if "loss" in x]
        assert len(losses) == 2 and losses[-1] < 0.6 * losses[0], lines
        assert lines[-1].endswith("unlogged collectives: 0")
