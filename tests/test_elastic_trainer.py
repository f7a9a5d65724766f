"""The trainer resumes on a different number of workers: every stateful aggregator and sync
method, 8 workers to 4 and back to 8 (a pipeline: 4 data replicas of 2 stages to 2 and back).

Each case runs 3 steps on the first world, 3 on the second and 2 on the third, and checks:

* the restored state keeps each rule's invariant against the state that was saved (rows
  equal on every worker bit for bit, error feedback's mean over workers, re-cut segments,
  replicas averaged), checked as in ``test_elastic``;
* the loader continues at the same global sample count: the steps' rows are 1..8 with no
  gap, and the loader ends where an uninterrupted run's ends;
* the loss continues: synchronous training's first step on 4 workers equals an
  uninterrupted 8-worker run's (same parameters, same global batch), and no resumed step's
  loss is more than ``JUMP`` from the uninterrupted run's.
"""

import json

import jax
import numpy as np
import pytest
from test_elastic import _check_rules

from train.checkpoint import Checkpoints, has_rows
from train.config import Config
from train.trainer import Trainer

# Largest relative gap allowed between a resumed step's loss and the uninterrupted run's.
JUMP = 0.1

_MLP = dict(task="mlp", model={"features": [16]}, dataset="digits", global_batch=32, lr=0.05)
_SIGN = dict(_MLP, optimizer="none")
_PIPE = dict(
    task="gpt",
    model={"num_layers": 2, "width": 32, "num_heads": 2, "seq_len": 16},
    stages=2,
    global_batch=16,
    microbatches=2,
    train_samples=32,
    lr=3e-3,
    optimizer="adam",
)

# cascading_sign is left out: it keeps nothing but a counter and a key (resized in
# test_elastic), and at 8 workers its direction's variance diverges on any model here.
# name: (config, whether synchronous (every worker holds the same model after each step and
# the step's loss does not depend on the number of workers)).
CASES = {
    "ring": (dict(_MLP, aggregator="ring"), True),
    "ec_quantized": (dict(_MLP, aggregator="ec_quantized", aggregator_args={"bits": 4}), True),
    "ar_topk": (dict(_MLP, aggregator="ar_topk", aggregator_args={"ratio": 0.05}), True),
    "lw_topk": (dict(_MLP, aggregator="lw_topk", aggregator_args={"ratio": 0.05}), True),
    "ms_topk": (dict(_MLP, aggregator="ms_topk", aggregator_args={"ratio": 0.05}), True),
    "marsit": (
        dict(
            _SIGN,
            aggregator="marsit",
            aggregator_args={"local_lr": 0.1, "global_lr": 0.01, "full_sync_every": 4},
        ),
        True,
    ),
    "signsgd_mv": (dict(_SIGN, aggregator="signsgd_mv", aggregator_args={"lr": 0.01}), True),
    "ef_signsgd": (dict(_SIGN, aggregator="ef_signsgd", aggregator_args={"lr": 0.01}), True),
    "ssdm": (dict(_SIGN, aggregator="ssdm", aggregator_args={"lr": 0.01}), True),
    "local_sgd": (dict(_MLP, aggregator="none", sync={"method": "local_sgd", "period": 2}), False),
    "enp": (dict(_MLP, aggregator="none", sync={"method": "enp", "period": 2}), False),
    "dreamddp": (dict(_MLP, aggregator="none", sync={"method": "dreamddp", "period": 2}), False),
    "diloco_int8": (
        dict(_MLP, aggregator="none", sync={"method": "diloco", "period": 2, "compress": "int8"}),
        False,
    ),
    "diloco_sparseloco": (
        dict(
            _MLP,
            aggregator="none",
            sync={"method": "diloco", "period": 2, "compress": "sparseloco"},
        ),
        False,
    ),
    "pipeline_aqsgd_ec": (
        dict(_PIPE, boundary="aqsgd", aggregator="ec_quantized", aggregator_args={"bits": 4}),
        True,
    ),
}


def _cfg(tmp_path, name, workers, steps, extra):
    pipeline = "stages" in extra
    return Config(
        name=name,
        workers=workers // 2 if pipeline else workers,
        steps=steps,
        checkpoint_every=3,
        eval_every=0,
        progress=False,
        out_dir=str(tmp_path / name),
        **extra,
    )


def _rows(t):
    return [json.loads(x) for x in (t.cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def _restored(cfg):
    """A trainer of ``cfg`` with the run's newest checkpoint restored, not stepped."""
    t = Trainer(cfg)
    store = Checkpoints(cfg.run_dir, cfg.keep_checkpoints)
    try:
        assert t.restore(store)
    finally:
        store.close()
    return t


def _check_state(before, after, n):
    """The arrays with a row per worker follow their resize rules; the arrays held once
    (every worker's the same) are unchanged bit for bit and still held once."""
    old, new = before.layout.state_tree(before.ctx), after.layout.state_tree(after.ctx)
    once = 0
    for (path, a), b in zip(*(jax.tree_util.tree_flatten_with_path(old)[0], jax.tree.leaves(new)),
                            strict=True):  # fmt: skip
        assert has_rows(a) == has_rows(b), jax.tree_util.keystr(path)
        if not has_rows(a):
            once += 1
            bits = lambda x: np.asarray(x).reshape(-1).view(np.uint8)  # noqa: E731
            name = jax.tree_util.keystr(path)
            # Held once, and truly the same: every device's copy, as the steps left it.
            copies = [bits(shard.data) for shard in a.addressable_shards]
            assert len(copies) > 1 and all((c == copies[0]).all() for c in copies), name
            np.testing.assert_array_equal(bits(b), bits(a), err_msg=name)
    rows = lambda tree: jax.tree.map(lambda a: a if has_rows(a) else None, tree)  # noqa: E731
    _check_rules(jax.device_get(rows(old)), jax.device_get(rows(new)), n)
    return once


@pytest.mark.parametrize("case", CASES)
def test_a_run_resumes_on_half_and_then_twice_the_workers(tmp_path, case, capsys):
    extra, synchronous = CASES[case]
    ref = Trainer(_cfg(tmp_path, "ref", 8, 8, extra))
    ref.run()
    first = Trainer(_cfg(tmp_path, "run", 8, 3, extra))
    first.run()
    before = first
    for workers, steps in ((4, 6), (8, 8)):
        cfg = _cfg(tmp_path, "run", workers, steps, extra)
        n = cfg.workers
        after = _restored(cfg)
        assert after.step == before.step and after.loader.position == before.loader.position
        once = _check_state(before, after, n)
        if synchronous and cfg.stages == 1:  # the parameters are held once
            assert once >= len(jax.tree.leaves(after.params))
        said = capsys.readouterr().out
        assert f"resuming a run of {before.n} workers on {n}" in said
        if extra.get("sync", {}).get("method") in ("local_sgd", "enp", "dreamddp"):
            assert "schedule are this world's own" in said
        after.run(resume=True)  # restores the same checkpoint again, then steps
        before = after
        if workers == 4:
            first_loss = _rows(after)[3]["loss"]
            if synchronous:  # same parameters, same global batch: the same loss
                assert first_loss == pytest.approx(_rows(ref)[3]["loss"], rel=1e-4)
    rows, ref_rows = _rows(before), _rows(ref)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert before.loader.position == ref.loader.position == 8
    pairs = zip(rows[3:], ref_rows[3:], strict=True)
    gaps = [abs(r["loss"] - q["loss"]) / q["loss"] for r, q in pairs]
    print(f"{case}: largest loss gap to the uninterrupted run {max(gaps):.4f}")
    assert max(gaps) <= JUMP, gaps


def test_a_world_size_change_allows_nothing_else_that_shapes_the_run(tmp_path):
    """Workers may change on resume; workers together with the global batch, the model or
    the aggregator are refused as another run's checkpoint (and nothing is written)."""
    extra = CASES["ec_quantized"][0]
    Trainer(_cfg(tmp_path, "run", 8, 1, extra)).run()
    for change in (
        {"global_batch": 64},
        {"model": {"features": [32]}},
        {"aggregator_args": {"bits": 2}},
    ):
        cfg = _cfg(tmp_path, "run", 4, 2, {**extra, **change})
        with pytest.raises(ValueError, match="holds a different run"):
            Trainer(cfg).run(resume=True)
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]
