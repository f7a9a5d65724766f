"""Pipeline trainer: matches data-parallel training with FP32 boundaries; AQ-SGD buffers fill,
both sides agree, and resume (buffers included) is bit-exact."""

import json
import time

import jax
import numpy as np
import pytest

import jaxcomm
from train.config import Config
from train.trainer import Trainer

MODEL = {"num_layers": 4, "width": 32, "num_heads": 2, "seq_len": 16}


def _cfg(tmp_path, **kw):
    base = dict(
        name="pp",
        task="gpt",
        model=MODEL,
        workers=1,
        stages=2,
        microbatches=2,
        global_batch=8,
        steps=4,
        lr=3e-3,
        aggregator="ring",
        checkpoint_every=0,
        progress=False,
        out_dir=str(tmp_path / "run"),
    )
    base.update(kw)
    return Config(**base)


def _losses(cfg):
    return [json.loads(x)["loss"] for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fp32_pipeline_trains_like_data_parallel(tmp_path):
    pp = _cfg(tmp_path / "pp", bw_bits=0)
    Trainer(pp).run()
    dp = _cfg(tmp_path / "dp", stages=1)
    Trainer(dp).run()
    np.testing.assert_allclose(_losses(pp), _losses(dp), rtol=2e-5)


def _audited(trainer, seen):
    """The step's traffic per device, read from its compiled programs."""
    return trainer.step_audit(seen)


def test_aqsgd_pipeline_revisits_samples_and_logs_what_runs(tmp_path):
    # 32 samples, 16 per step: every sample is revisited every two steps.
    cfg = _cfg(
        tmp_path,
        stages=4,
        workers=2,
        global_batch=16,
        boundary="aqsgd",
        fw_bits=2,
        train_samples=32,
        steps=6,
    )
    trainer = Trainer(cfg)
    traffic = []
    trainer.run(metrics_cb=lambda row: traffic.append(trainer.last_traffic))
    # Steps 1-2 are the first epoch (float32), steps 3-6 revisit (deltas): both programs ran.
    assert sorted(trainer.layout._compiled) == [False, True]
    for step, seen in ((0, False), (1, False), (2, True), (5, True)):
        audit = _audited(trainer, seen)
        np.testing.assert_array_equal(traffic[step].sent, audit.sent)
        np.testing.assert_array_equal(traffic[step].rounds.sum(-1), audit.rounds)
        np.testing.assert_array_equal(traffic[step].path_bytes.sum(-1), audit.path_bytes)
    # The pipeline's bytes fall once samples repeat: 2-bit deltas replace float32.
    p2p = jaxcomm.network.KINDS.index("p2p")
    assert traffic[5].path_bytes[0, p2p] < 0.5 * traffic[0].path_bytes[0, p2p]
    for buf in trainer.layout.feed.buffers:
        buf.flush()
    assert all(buf.seen(np.arange(32)).all() for buf in trainer.layout.feed.buffers)
    # Only stage 0's embedding and the last stage's head are used, averaged and updated: the
    # other copies keep their initial values, and the programs that average the used ones
    # run on those stages' devices only.
    first = Trainer(_cfg(tmp_path / "fresh", stages=4, workers=2, global_batch=16))
    for name, owner in (("embed", 0), ("head", 3)):
        now, init = trainer.params[name], first.params[name]
        for a, b in zip(jax.tree.leaves(now), jax.tree.leaves(init), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            unused = [s for s in range(4) if s != owner]
            np.testing.assert_array_equal(a[:, unused], b[:, unused])
            assert not np.array_equal(a[:, owner], b[:, owner])
        assert jaxcomm.wire_audit(trainer.layout._owned_compiled[name]).num_devices == 2
        owners = set(trainer.mesh.devices[:, owner].tolist())
        assert set(trainer.layout.owned.sub_mesh[name].devices.flat) == owners
        shardings = jax.tree.leaves(trainer.layout._owned_compiled[name].input_shardings[0])
        assert shardings[0].device_set == owners
    # Both sides of every boundary consumed the same messages in the last step.
    st = jax.device_get(trainer.layout._last[1])
    for b in range(3):
        np.testing.assert_array_equal(st.prev_out[:, b], st.prev_in[:, b + 1])
    # Buffer work is recorded per step; a prefetch ran while the step before it computed
    # (not across the epoch boundary, whose ids the previous step writes).
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["buffer_prefetch_s"] > 0 for r in rows] == [True, False, True, False, True, False]
    assert all(r["buffer_writeback_s"] > 0 for r in rows)
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    assert (
        summary["buffer_bytes"] == 3 * trainer.layout.feed.buffers[0].nbytes >= 3 * 32 * 16 * 32 * 4
    )


@pytest.mark.parametrize(
    "aggregator,args,optimizer,boundary",
    [
        ("tree", {}, "adam", "fp32"),
        ("ec_quantized", {}, "adam", "directq"),
        ("ssdm", {"lr": 1e-3}, "none", "fp32"),
    ],
)
def test_logged_traffic_equals_the_audit_for_every_aggregator(
    tmp_path, aggregator, args, optimizer, boundary
):
    """With data parallelism, every device's logged bytes, rounds and path bytes equal what
    the step's compiled programs (pipeline step, embedding's and head's) move."""
    cfg = _cfg(
        tmp_path,
        workers=2,
        steps=2,
        aggregator=aggregator,
        aggregator_args=args,
        optimizer=optimizer,
        boundary=boundary,
        fw_bits=3,
    )
    trainer = Trainer(cfg)
    traffic = []
    trainer.run(metrics_cb=lambda row: traffic.append(trainer.last_traffic))
    audit = trainer.step_audit(False)
    for t in traffic:
        np.testing.assert_array_equal(t.sent, audit.sent)
        np.testing.assert_array_equal(t.rounds.sum(-1), audit.rounds)
        np.testing.assert_array_equal(t.path_bytes.sum(-1), audit.path_bytes)
    assert (audit.sent > 0).all()


def test_slow_prefetch_is_exposed_and_not_compute(tmp_path, monkeypatch):
    """A buffer prefetch that outlasts the step it overlaps is charged to
    ``buffer_exposed_s``, and the step's ``compute_s`` stops where the devices did.

    The delay is held back until the step program's outputs are ready, so all of it lies
    past the devices' end whatever the machine's load; the checks compare stamps of the
    same step rather than bounding any measured time."""
    import threading

    import train.pipeline_layout as pipeline_layout

    delay = 0.5
    cfg = _cfg(tmp_path, boundary="aqsgd", fw_bits=2, train_samples=32, steps=4)
    trainer = Trainer(cfg)
    prepare = trainer.layout.feed.prepare
    launch = trainer.layout.launch
    stamps, flights, step_done = [], [], threading.Event()
    ready_at = pipeline_layout.ready_at

    def stamped(tree):
        # One waiting thread runs these in order: the step program's outputs, then the
        # whole step's (see PipelineLayout.launch).
        at = ready_at(tree)
        stamps.append(at)
        step_done.set()
        return at

    def slow(position):
        prep = prepare(position)
        if position > 0:  # the prefetches (step 0 is prepared before the loop)
            assert step_done.wait(60), "the step program never finished"
            time.sleep(delay)
            prep = prep._replace(seconds=prep.seconds + delay)
        return prep

    def launched(t, step, lagging):
        step_done.clear()
        first = len(stamps)
        flight = launch(t, step, lagging)
        flights.append((flight, stamps[first:]))
        return flight

    monkeypatch.setattr(pipeline_layout, "ready_at", stamped)
    trainer.layout.feed.prepare = slow
    trainer.layout.launch = launched
    trainer.run()
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == len(flights) == 4
    for r, (flight, (main_end, device_end)) in zip(rows[:3], flights, strict=False):
        # steps 0-2 each overlap the prefetch of the next one
        assert r["buffer_prefetch_s"] >= delay
        # The whole delay came after the step program's end: all of it is exposed.
        assert r["buffer_exposed_s"] >= delay
        # The step's span is split between compute and exposed buffer time, not counted
        # twice, so compute leaves the delay out.
        span = device_end - flight.dispatched_at
        assert r["compute_s"] + r["buffer_exposed_s"] == pytest.approx(span, abs=1e-6)
        assert r["compute_s"] <= span - delay + 1e-6
        assert r["compute_s"] >= main_end - flight.dispatched_at
    assert rows[3]["buffer_prefetch_s"] == 0.0  # nothing left to prefetch


def test_non_aqsgd_boundaries_keep_no_buffers(tmp_path):
    cfg = _cfg(tmp_path, boundary="directq", fw_bits=2, checkpoint_every=2)
    trainer = Trainer(cfg)
    trainer.run()
    assert trainer.layout.feed.buffers == []
    assert not (cfg.run_dir / "buffers").exists()
    assert json.loads((cfg.run_dir / "summary.json").read_text())["buffer_bytes"] == 0


def test_unstage_inverts_stage_params():
    from models import build_task
    from train.pipeline import stage_params, unstage_params

    task = build_task("gpt", **MODEL)
    params = task.init(jax.random.key(3), {"tokens": np.zeros((2, 17), np.int32)})
    back = unstage_params(stage_params(params, task.module.cfg, 2), task.module.cfg)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(params)
    for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_fine_tune_from_pretrained_params(tmp_path):
    pre = _cfg(tmp_path / "pre", stages=1, steps=2)
    dp = Trainer(pre)
    dp.run()
    path = pre.run_dir / "params.msgpack"
    ft = Trainer(_cfg(tmp_path / "ft", stages=4, init_params=str(path)))
    for a, b in zip(
        jax.tree_util.tree_leaves(dp.model_params()),
        jax.tree_util.tree_leaves(ft.model_params()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    # A pipeline run writes its parameters in the model's layout too.
    ft.run()
    again = Trainer(
        _cfg(tmp_path / "again", stages=1, init_params=str(ft.cfg.run_dir / "params.msgpack"))
    )
    for a, b in zip(
        jax.tree_util.tree_leaves(ft.model_params()),
        jax.tree_util.tree_leaves(again.model_params()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    wider = {**MODEL, "width": 48}
    with pytest.raises(
        ValueError, match=r"init_params .*parameter .* is float32\[.*the model needs"
    ):
        Trainer(_cfg(tmp_path / "bad", stages=1, model=wider, init_params=str(path)))
    with pytest.raises(ValueError, match="init_params must name an existing file"):
        _cfg(tmp_path / "none", init_params=str(tmp_path / "missing.msgpack"))


# Top-k both ways, first visits at 4 bits, the gradients' memory kept (and restored).
SPARSE = {
    "fw_chunk": 64,
    "fw_k": 2,
    "bw_chunk": 32,
    "bw_k": 2,
    "first_bits": 4,
    "bw_memory": True,
}


@pytest.mark.parametrize("args", [{}, SPARSE], ids=["aqsgd", "sparse"])
def test_aqsgd_pipeline_resume_bit_exact(tmp_path, args):
    # 16 samples, 8 per step: the resumed steps 3-4 send deltas against restored buffers.
    kw = dict(stages=2, boundary="aqsgd", fw_bits=3, checkpoint_every=2, train_samples=16)
    kw["boundary_args"] = args
    full = Trainer(_cfg(tmp_path / "a", **kw))
    traffic = []
    full.run(metrics_cb=lambda row: traffic.append(full.last_traffic))
    for step, seen in ((0, False), (3, True)):  # what each program logs is what it sends
        audit = _audited(full, seen)
        np.testing.assert_array_equal(traffic[step].sent, audit.sent)
        np.testing.assert_array_equal(traffic[step].path_bytes.sum(-1), audit.path_bytes)
    p2p = jaxcomm.network.KINDS.index("p2p")
    fp32_fw = 4 * 4 * 16 * 32  # a microbatch of 4 samples, 16 tokens x 32 wide, forward
    drop = traffic[0].path_bytes[0, p2p] / traffic[3].path_bytes[0, p2p]
    assert drop > 1.5, drop  # deltas replace the first visits
    if args:  # sparse both ways: far below float32 in the steady state
        assert traffic[3].path_bytes[0, p2p] < 2 * 2 * fp32_fw / 20
    # Run b goes a step past its checkpoint (step 2): the buffers on disk then hold step 3's
    # writes, which the resume must replace by the checkpoint's snapshot.
    Trainer(_cfg(tmp_path / "b", steps=3, buffer_dir=str(tmp_path / "bufs"), **kw)).run()
    resumed = Trainer(_cfg(tmp_path / "b", buffer_dir=str(tmp_path / "bufs"), **kw))
    replaced = list(resumed.layout.feed.buffers + resumed.layout.feed.memories)
    assert resumed.run(resume=True)["resumed"]
    assert sorted(resumed.layout._compiled) == [True]  # every resumed step revisited
    # The restored buffers live in buffer_dir again, and the ones they replaced are closed.
    feed = resumed.layout.feed
    assert [str(b.path) for b in feed.buffers + feed.memories] == [
        str(tmp_path / "bufs" / name) for name in ["boundary0"] + ["gradient0"] * bool(args)
    ]
    if args:  # the memory was written: both sides' rows of every sample, not zeros
        assert feed.memories[0].seen(np.arange(16)).all()
        assert np.abs(feed.memories[0].read(np.arange(16))).sum() > 0
    assert all(b.closed for b in replaced)
    # A new run must not pick up the buffers another run left in buffer_dir.
    with pytest.raises(ValueError, match="already holds message buffers"):
        Trainer(_cfg(tmp_path / "c", buffer_dir=str(tmp_path / "bufs"), **kw)).run()
    for a, b in zip(
        jax.tree_util.tree_leaves(full.worker_params()),
        jax.tree_util.tree_leaves(resumed.worker_params()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_pipeline_config_errors(tmp_path):
    with pytest.raises(ValueError, match="stages=2 needs model gpt"):
        Config(task="mlp", dataset="digits", stages=2)
    with pytest.raises(ValueError, match="multiple of workers \\* microbatches = 32"):
        Config(stages=2, workers=8, microbatches=4, global_batch=40)
    with pytest.raises(ValueError, match=r"fw_bits must be an integer in \[1, 8\], got 9"):
        Config(stages=2, fw_bits=9)
    with pytest.raises(ValueError, match="boundary_args=.* needs boundary aqsgd"):
        Config(stages=2, boundary="fp32", boundary_args={"fw_chunk": 64, "fw_k": 2})
    with pytest.raises(ValueError, match=r"unknown keys \['fw_chunks'\].*did you mean 'fw_chunk'"):
        Config(stages=2, boundary="aqsgd", boundary_args={"fw_chunks": 64})
    with pytest.raises(ValueError, match="fw_chunk and fw_k go together"):
        Config(stages=2, boundary="aqsgd", boundary_args={"fw_chunk": 64})
    with pytest.raises(ValueError, match="boundary.backward: k must be at most chunk=4, got 8"):
        Config(stages=2, boundary="aqsgd", boundary_args={"bw_chunk": 4, "bw_k": 8})
    with pytest.raises(ValueError, match="fw_rank sends a low-rank code; it excludes fw_chunk"):
        Config(stages=2, boundary="aqsgd", boundary_args={"fw_rank": 2, "fw_chunk": 64, "fw_k": 2})
    with pytest.raises(ValueError, match="boundary_args.first_bits must be a positive integer"):
        Config(stages=2, boundary="aqsgd", boundary_args={"first_bits": 0})
    with pytest.raises(ValueError, match="bw_bucket=64 quantizes, but bw_bits is 0"):
        Config(stages=2, boundary="aqsgd", bw_bits=0, boundary_args={"bw_bucket": 64})
    with pytest.raises(
        ValueError, match="boundary.memory: input should be a valid boolean, got 'yes'"
    ):
        Config(stages=2, boundary="aqsgd", boundary_args={"bw_memory": "yes"})
    with pytest.raises(ValueError, match="boundary.memory needs a compressed backward"):
        Config(stages=2, boundary="aqsgd", bw_bits=0, boundary_args={"bw_memory": True})
    with pytest.raises(
        ValueError, match=r"boundary.forward.rank=17 is larger than one sample of 16 x 32"
    ):
        Trainer(_cfg(tmp_path, boundary="aqsgd", boundary_args={"fw_rank": 17}))


def test_param_count_is_the_models(tmp_path):
    from models import build_task, param_count

    trainer = Trainer(_cfg(tmp_path, stages=4, workers=2, global_batch=16))
    task = build_task("gpt", **MODEL)
    params = task.init(jax.random.key(0, impl="rbg"), trainer.train_data.get(np.arange(2)))
    assert trainer.num_params() == param_count(params)


def test_aggregator_keys_differ_per_stage_and_group(tmp_path):
    """SSDM draws stochastic signs from a key in its state: every stage's blocks, the
    embedding and the head get their own, while data replicas of one group share it."""
    cfg = _cfg(
        tmp_path,
        stages=4,
        workers=2,
        global_batch=16,
        aggregator="ssdm",
        aggregator_args={"lr": 1e-3},
        optimizer="none",
    )
    trainer = Trainer(cfg)
    keys = []
    for group in ("blocks", "embed", "head"):
        (key,) = [
            np.asarray(leaf)
            for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.opt_state[group])[0]
            if "key" in jax.tree_util.keystr(path)
        ]
        keys += list(key.reshape(2, -1, key.shape[-1]).transpose(1, 0, 2))  # per stage
    for k in keys:  # [replicas, words]
        np.testing.assert_array_equal(k[0], k[1])
    distinct = {tuple(k[0]) for k in keys}
    assert len(distinct) == len(keys) == 4 + 1 + 1


def test_write_back_copies_each_boundary_cell_to_the_host_once(tmp_path, monkeypatch):
    """Each boundary's new messages sit on both its sides bit for bit; the write-back copies
    one side of each (boundary, replica) cell to the host, not both."""
    cfg = _cfg(tmp_path, boundary="aqsgd", fw_bits=2, train_samples=16, steps=1, workers=2,
               stages=4, global_batch=16)  # fmt: skip
    trainer = Trainer(cfg)
    trainer.run()
    copies = []
    real = np.asarray

    def counting(a, *args, **kw):
        if isinstance(a, jax.Array):
            copies.append(a.shape)
        return real(a, *args, **kw)

    monkeypatch.setattr(np, "asarray", counting)
    trainer._after_step()
    monkeypatch.setattr(np, "asarray", real)
    assert len(copies) == (cfg.stages - 1) * cfg.workers


def _program_audit(trainer, seen, step):
    """Per-device traffic of step ``step`` (0-based) read from the compiled programs, each
    program's averaging conditional resolved by its own group's schedule."""
    from jaxcomm._src.localsgd import SYNC_SCOPE, sync_branch

    total = np.zeros(trainer.mesh.devices.size, np.int64)
    rounds, path = total.copy(), total.copy()
    schedule = trainer.sync.sync_schedule
    for (program, index), unit in zip(trainer.step_programs(seen), (1, 0, 2), strict=True):
        own = jaxcomm.schedules.as_schedule([(0,) if unit in g else () for g in schedule.groups], 1)
        got = jaxcomm.wire_audit(program).traffic({SYNC_SCOPE: sync_branch(own, step)})
        total[index] += got.sent
        rounds[index] += got.rounds
        path[index] += got.path_bytes
    return total, rounds, path


@pytest.mark.parametrize("method", ["local_sgd", "dreamddp"])
def test_pipeline_replicas_synchronise_by_local_sgd(tmp_path, method):
    """A pipeline (AQ-SGD boundaries) whose data replicas synchronise by local SGD or
    DreamDDP: each parameter group (embedding, a stage's blocks, head) is averaged over the
    replicas at the steps its schedule gives it; logged traffic equals the compiled
    programs' at every step; the clock adds the averaging's ring time to GPipe's timeline.
    DreamDDP's run, stopped after its first step (mid-schedule) and resumed for three,
    ends bit for bit where the uninterrupted run does (local SGD runs the same sync part
    with one group)."""
    kw = dict(
        workers=2,
        boundary="aqsgd",
        fw_bits=3,
        aggregator="none",
        sync={"method": method, "period": 2},
        train_samples=16,
        compute="v100",
        network="1ms,100Mbps",
    )
    full = Trainer(_cfg(tmp_path / "a", **kw))
    rows = []
    full.run(metrics_cb=lambda r: rows.append((r, full.last_traffic)))
    schedule = full.sync.sync_schedule
    assert full.sync.layers == ["embed", "blocks", "head"]
    assert sorted({unit for g in schedule.groups for unit in g}) == [0, 1, 2]
    for r, traffic in rows:
        step = r["step"] - 1
        assert r["sync_layers"] == len(schedule.groups[step % 2])
        sent, rounds, path = _program_audit(full, step >= 2, step)
        np.testing.assert_array_equal(traffic.sent, sent)
        np.testing.assert_array_equal(traffic.rounds.sum(-1), rounds)
        np.testing.assert_array_equal(traffic.path_bytes.sum(-1), path)
    # After a step that averages a group, the two replicas hold the same copy of it (up to
    # the rounding of applying "mean - own" as an update); the others' copies differ.
    last = schedule.groups[-1]
    params = jax.device_get(full.params)
    for unit, name in enumerate(["embed", "blocks", "head"]):
        gap = max(float(np.abs(a[0] - a[1]).max()) for a in jax.tree_util.tree_leaves(params[name]))
        assert (gap < 1e-6) if unit in last else (gap > 1e-4), (name, gap)
    if method == "dreamddp":
        Trainer(_cfg(tmp_path / "b", **kw, steps=1, checkpoint_every=1)).run()
        resumed = Trainer(_cfg(tmp_path / "b", **kw, checkpoint_every=1))
        resumed.run(resume=True)
        assert _losses(resumed.cfg) == [r["loss"] for r, _ in rows]
        leaves = jax.tree_util.tree_leaves
        for x, y in zip(leaves(jax.device_get(resumed.params)), leaves(params), strict=True):
            np.testing.assert_array_equal(x, y)
    if method == "local_sgd":
        # Steps 3 and 4 send deltas; step 4 also averages every group, by a ring over the
        # 2 replicas on each stage: 2 rounds and the group's bytes per message. The
        # busiest stage's averaging is the step's extra time.
        (r3, _), (r4, _) = rows[2], rows[3]
        beta = 8 / 100e6

        def group_bytes(name):
            return sum(a[0, 0].nbytes for a in jax.tree_util.tree_leaves(params[name]))

        per_stage = [
            group_bytes("blocks") + group_bytes("embed"),
            group_bytes("blocks") + group_bytes("head"),
        ]
        extra = 4 * 1e-3 + max(per_stage) * beta
        assert r4["sim_step_s"] - r3["sim_step_s"] == pytest.approx(extra, rel=1e-9)
