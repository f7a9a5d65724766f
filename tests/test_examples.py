"""Every program in ``examples/`` runs a few steps: its loss falls and the unlogged-traffic
check of its compiled step finds nothing."""

import importlib.util
import pathlib
import re
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


@pytest.mark.parametrize("name", sorted(p.stem for p in EXAMPLES.glob("*.py")))
def test_help_gives_the_whole_first_sentence(name, capsys, monkeypatch):
    """``--help`` shows the docstring's first paragraph, not its first line, which can end
    mid-sentence."""
    monkeypatch.setenv("COLUMNS", "1000")  # one line: argparse also breaks at hyphens
    with pytest.raises(SystemExit) as done:
        _load(name).main(["--help"])
    assert done.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    first = " ".join(_load(name).__doc__.split("\n\n")[0].split())
    assert first.endswith(".") and first in out


@pytest.mark.parametrize("aggregator", ["ar_topk", "ec_quantized", "marsit"])
def test_nnx_digits(aggregator):
    out = _load("nnx_digits").main(["--aggregator", aggregator, "--steps", "20"])
    _falls(out["losses"])
    assert out["unlogged"] == ()
    # The accuracy is taken on digits the batches never drew from.
    assert len(out["held_out"]) > 300 and not set(out["held_out"]) & set(out["train"])
    assert 0 <= out["accuracy"] <= 1
    assert out["sent_per_step"] > 0


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
    # Every layer is averaged once per period of 3 steps.
    assert out["sent_per_step"] == pytest.approx(out["ring"] / 3, rel=0.01)


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
        # Found anywhere in the output, in any order: the two processes share one pipe, and
        # a line of one can land inside or after a line of the other.
        def found(pattern: str) -> list[str]:
            return re.findall(rf"\[process {p}\] {pattern}", run.stdout)  # noqa: B023

        losses = [float(x) for x in found(r"step +\d+  loss ([\d.]+)")]
        assert len(losses) == 2 and losses[-1] < 0.6 * losses[0], run.stdout
        sent = found(r"bytes sent per worker per step: ([\d,]+)")
        assert len(sent) == 1 and int(sent[0].replace(",", "")) > 0, run.stdout
        assert found(r"unlogged collectives: (\d+)") == ["0"], run.stdout
