"""The trainer's host loop: step t + 1 is queued before step t is read, batches are
prefetched, a non-finite step still stops the run at that step, lagging changes nothing."""

import json
import shutil
import threading
import time

import jax
import numpy as np
import pytest

import train.trainer as trainer_mod
from train.checkpoint import Checkpoints
from train.config import Config
from train.trainer import Trainer

MLP = dict(task="mlp", model={"features": [16]}, dataset="digits", lr=0.05, optimizer="sgd")


def _cfg(tmp_path, **kw):
    base = dict(
        name="t",
        workers=8,
        global_batch=16,
        aggregator="ring",
        progress=False,
        out_dir=str(tmp_path / "run"),
    )
    return Config(**{**base, **kw})


class _Recorder:
    """Wraps a trainer's compiled step and the host reads to log their order."""

    def __init__(self, trainer, monkeypatch):
        self.events = []
        self.trainer = trainer
        compiled = trainer.layout.compiled_step

        def compiled_and_wrapped(t, key=None):
            program = compiled(t, key)

            def step(*args):
                self.events.append(("dispatch", trainer.loader.position))
                return program(*args)

            return step

        monkeypatch.setattr(trainer.layout, "compiled_step", compiled_and_wrapped)
        accept = trainer._accept

        def accept_and_log(flight, *args):
            self.events.append(("read", flight.step))
            return accept(flight, *args)

        monkeypatch.setattr(trainer, "_accept", accept_and_log)


def _rows(cfg):
    return [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_next_step_is_queued_before_a_step_is_read(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, steps=7, checkpoint_every=4, eval_every=0, **MLP)
    trainer = Trainer(cfg)
    rec = _Recorder(trainer, monkeypatch)
    trainer.run()
    order = rec.events
    dispatch_at = {}  # step number -> index of its dispatch in the event log
    n = 0
    for i, (kind, _) in enumerate(order):
        if kind == "dispatch":
            n += 1
            dispatch_at[n] = i
    read_at = {step: i for i, (kind, step) in enumerate(order) if kind == "read"}
    assert sorted(read_at) == list(range(1, 8))
    for t in range(1, 8):
        if t in (4, 7):  # a checkpoint step, the last step: read before anything follows
            assert t + 1 not in dispatch_at or dispatch_at[t + 1] > read_at[t]
        else:
            assert dispatch_at[t + 1] < read_at[t], (t, order)


def test_synchronous_loop_reads_each_step_first(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, steps=4, checkpoint_every=0, async_steps=False, **MLP)
    trainer = Trainer(cfg)
    rec = _Recorder(trainer, monkeypatch)
    trainer.run()
    kinds = [k for k, _ in rec.events]
    assert kinds == ["dispatch", "read"] * 4


@pytest.mark.parametrize("cls", ["every_step", "local_sgd"])
def test_lagged_and_synchronous_runs_are_identical(tmp_path, cls):
    kw = dict(steps=6, checkpoint_every=4, eval_every=3, **MLP)
    if cls == "local_sgd":
        kw.update(aggregator="none", sync={"method": "local_sgd", "period": 2})
    runs = []
    for lag in (True, False):
        cfg = _cfg(tmp_path / str(lag), async_steps=lag, **kw)
        t = Trainer(cfg)
        t.run()
        runs.append((t, _rows(cfg)))
    (a, rows_a), (b, rows_b) = runs
    drop = ("compute_s", "sim_step_s", "sim_time_s", "sim_compute_s")
    strip = [
        [{k: v for k, v in r.items() if k not in drop} for r in rows] for rows in (rows_a, rows_b)
    ]
    assert strip[0] == strip[1]
    assert len(rows_a) == 6 and "valid_loss" in rows_a[2]
    if cls == "local_sgd":
        assert rows_a[0]["divergence"] > 1e-4 > 1e6 * rows_a[1]["divergence"]
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_batches_are_prefetched_and_resume_sees_the_right_position(tmp_path, monkeypatch):
    """Each step's batch is the loader's batch of that step, loaded while the previous step
    ran; a checkpoint stores the position of the first batch not yet trained on."""
    cfg = _cfg(tmp_path, steps=5, checkpoint_every=2, **MLP)
    trainer = Trainer(cfg)
    got = []
    put = trainer.layout.put_batch

    def record(batch):
        got.append(np.asarray(batch["ids"]).copy())
        return put(batch)

    monkeypatch.setattr(trainer.layout, "put_batch", record)
    prefetch = trainer.layout._prefetch
    calls = []
    monkeypatch.setattr(trainer.layout, "_prefetch", lambda t: (calls.append(1), prefetch(t))[1])
    trainer.run()
    # Compile reads batch 0 once; then one load per step, the first four prefetched.
    assert len(calls) == 4
    want = [trainer.train_data.get(trainer.loader.batch_ids(p))["ids"] for p in range(5)]
    for g, w in zip(got[1:6], want, strict=True):
        np.testing.assert_array_equal(g, w)
    # The step-4 checkpoint was written while batch 4 sat prefetched: it stores position 4.
    shutil.rmtree(cfg.run_dir / "checkpoints" / "5")
    more = Trainer(cfg)
    assert more.restore(Checkpoints(more.cfg.run_dir, 3))
    assert more.step == 4 and more.loader.position == 4


def test_nonfinite_step_stops_there_with_lag(tmp_path, monkeypatch):
    """Step 7 turns non-finite while step 8 is already queued: the run stops naming step 7,
    logs steps 1-6 only and keeps the step-6 checkpoint as the newest."""
    cfg = _cfg(tmp_path, steps=12, checkpoint_every=3, **MLP)
    trainer = Trainer(cfg)
    real = trainer_mod.host_finite
    seen = []

    def finite(*flags):
        seen.append(1)
        return real(*flags) and len(seen) != 7

    monkeypatch.setattr(trainer_mod, "host_finite", finite)
    with pytest.raises(FloatingPointError, match="step 7:"):
        trainer.run()
    assert [r["step"] for r in _rows(cfg)] == list(range(1, 7))
    again = Trainer(cfg)
    assert again.restore(Checkpoints(again.cfg.run_dir, 3)) and again.step == 6


def test_lagged_loop_waits_for_the_devices_only_when_reading(tmp_path, monkeypatch):
    """Between the first dispatch and the last read, the loop's own thread waits on device
    values only inside a read of a step (``_accept``): never while dispatching."""
    cfg = _cfg(tmp_path, steps=6, checkpoint_every=0, **MLP)
    trainer = Trainer(cfg)
    main = threading.get_ident()
    state = {"loop": False, "reading": False}
    stalls = []
    real_block, real_to_host = jax.block_until_ready, trainer_mod.to_host

    def block(x):
        if threading.get_ident() == main and state["loop"] and not state["reading"]:
            stalls.append("block_until_ready")
        return real_block(x)

    def to_host(x):
        if state["loop"] and not state["reading"]:
            stalls.append("to_host")
        return real_to_host(x)

    monkeypatch.setattr(jax, "block_until_ready", block)
    monkeypatch.setattr(trainer_mod, "to_host", to_host)
    launch, accept = trainer.layout.launch, trainer._accept

    def launch_flag(*a):
        state["loop"] = True
        return launch(*a)

    def accept_flag(flight, *a):
        state["reading"] = True
        try:
            return accept(flight, *a)
        finally:
            state["reading"] = False
            state["loop"] = flight.step < cfg.steps

    monkeypatch.setattr(trainer.layout, "launch", launch_flag)
    monkeypatch.setattr(trainer, "_accept", accept_flag)
    trainer.run()
    assert stalls == []


def test_lagged_compute_time_leaves_out_the_hosts_own_work(tmp_path, monkeypatch):
    """A metrics callback that sleeps 0.5 s per step makes the host the bottleneck: step
    t + 2 is dispatched only after the callback of step t returns, while step t + 1 is
    done during that sleep. The lagged loop's ``compute_s`` counts only the devices
    (stamped by a waiting thread), so it never reaches back before the step's dispatch
    into the host's sleep. Only stamps of the same run are compared, so load cannot break
    it."""
    cfg = _cfg(tmp_path, steps=6, checkpoint_every=0, **MLP)
    trainer = Trainer(cfg)
    launch = trainer.layout.launch
    flights, slept = {}, {}

    def recorded(t, step, lagging):
        flights[step] = launch(t, step, lagging)
        return flights[step]

    def sleepy(row):
        time.sleep(0.5)
        slept[row["step"]] = time.perf_counter()

    monkeypatch.setattr(trainer.layout, "launch", recorded)
    trainer.run(metrics_cb=sleepy)
    rows = {r["step"]: r for r in _rows(cfg)}
    assert sorted(rows) == sorted(flights) == list(range(1, 7))
    for step in range(3, 7):
        flight = flights[step]
        assert flight.compute_s is None  # lagged: timed by the waiting thread
        assert flight.dispatched_at >= slept[step - 2]
        ready = flight.ready.result()
        assert 0 < rows[step]["compute_s"] <= ready - flight.dispatched_at
