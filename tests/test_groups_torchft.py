"""Replica groups as separate processes over torchft: the outer step equals one program's
Streaming DiLoCo, a killed group leaves the others training, a restarted one is healed
from a live peer, and a stopped run resumes bit-exactly."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import child_env
from flax import serialization

os.environ.setdefault("RUST_LOG", "error")  # before torchft starts its logger
pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parent.parent
# A small GPT, 1 worker a group, Streaming DiLoCo with 2 fragments and an overlap of 1, the
# paper's Nesterov outer step (its momentum in every checkpoint and heal).
SETS = ["model.num_layers=2", "model.width=32", "global_batch=8", "sync.period=10",
        "sync.fragments=2", "sync.overlap=1", "compute=measured", "eval_every=0",
        "eval_batches=1", "sync.outer_lr=0.7", "sync.outer_momentum=0.9"]  # fmt: skip
GROUP = ["groups.start_timeout_s=60"]
CONFIG = str(ROOT / "configs" / "diloco_default.yaml")
# How each group is laid out: its processes, and its own settings.
LAYOUTS = {
    "1 process": (1, ["workers=1"]),
    "2 processes": (2, ["workers=2"]),
    # A pipeline across the group's 2 processes (one stage each); a pipeline in one process
    # is test_groups_of_pipelines_equal_one_programs_pipeline_diloco's.
    "2 stages": (2, ["workers=1", "stages=2"]),
}


def _env():
    env = child_env()
    return {**env, "RUST_LOG": "error", "PYTHONPATH": f"{env['PYTHONPATH']}{os.pathsep}{ROOT}"}


def _sets(extra):
    out = []
    for s in [*SETS, *extra]:
        out += ["--set", s]
    return out


def _launch(out, groups, extra, *flags):
    cmd = [sys.executable, "-m", "train.groups", "--groups", str(groups), "--config", CONFIG,
           "--out", str(out), *flags, *_sets([*GROUP, *extra])]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)


def _params(path):
    tree = serialization.msgpack_restore(Path(path).read_bytes())
    return jax.tree_util.tree_leaves_with_path(tree)


def _rows(folder):
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _logs(out):
    return "\n".join(p.read_text()[-3000:] for p in sorted(Path(out).glob("group_*.log")))


def _groups_against_one_program(tmp_path, common, atol, flags=()):
    """Two groups of one worker each (launched with ``flags``), and one program of two
    workers, on settings ``common``: the groups end bit-identical, within ``atol`` of the
    program, and trained."""
    r = _launch(tmp_path / "g", 2, ["workers=1", "aggregator=ring", *common], *flags)
    assert r.returncode == 0, r.stdout[-2000:] + _logs(tmp_path / "g")
    one = tmp_path / "one"
    cmd = [sys.executable, "-m", "train", "--no-progress", "--config", CONFIG,
           *_sets([*common, "workers=2", "global_batch=16", f"out_dir={one}"])]  # fmt: skip
    r1 = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert r1.returncode == 0, r1.stderr[-2000:]
    a = _params(tmp_path / "g/group_0/params.msgpack")
    b = _params(tmp_path / "g/group_1/params.msgpack")
    c = _params(one / "params.msgpack")
    for (k, x), (_, y), (_, z) in zip(a, b, c, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(k))
        np.testing.assert_allclose(x, z, rtol=0, atol=atol, err_msg=jax.tree_util.keystr(k))
    rows = _rows(one)
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3  # it trained: the comparison is not void


def test_two_groups_equal_one_program_streaming_diloco(tmp_path):
    """Two groups of one worker each (each its own process and JAX runtime) end with the
    theta_sync that one program's Streaming DiLoCo gives two workers on the same samples:
    bit for bit between the groups, within float rounding of the one program."""
    # The paper's Nesterov outer step (lr 0.7, momentum 0.9): its momentum is per fragment.
    common = ["steps=40", "optimizer.name=sgd", "optimizer.lr=0.05", "sync.outer_lr=0.7",
              "sync.outer_momentum=0.9", "checkpoint_every=0"]  # fmt: skip
    # Each group in a network namespace of its own behind a shaped 1 Gbit/s link (where
    # this machine allows it), whose kernel counter is the wire audit of the bytes the
    # transport counted.
    from train import netns

    shaped = netns.available() is None
    flags = ("--network", "1000") if shaped else ()
    _groups_against_one_program(tmp_path, common, atol=2e-6, flags=flags)
    for g in (0, 1):
        s = json.loads((tmp_path / f"g/group_{g}/summary.json").read_text())["groups"]
        # Fragment 0 at steps 5, 15, 25, 35; fragment 1 at 10, 20, 30, 40.
        assert s["exchanges"] == 8 and s["failed"] == 0 and s["heals"] == 0
        rows = _rows(tmp_path / f"g/group_{g}")
        assert [r["sync_fragment"] for r in rows[:10]] == [-1] * 4 + [0] + [-1] * 4 + [1]
        assert {r.get("group_members") for r in rows if "group_members" in r} == {2}
    # The bytes the transport sent (what Gloo's all-gathers were handed, every try) against
    # train.estimate's model of a period: 4 periods, plus the start's handshake (headers).
    from train.config import load_config
    from train.estimate import estimate

    cfg = load_config(CONFIG, [*SETS, *common, "workers=1", "aggregator=ring", "compute=v100",
                               "groups.lighthouse=http://127.0.0.1:1", "groups.slot=0",
                               "groups.count=2"])  # fmt: skip
    per_period = estimate(cfg)["groups"]["sent_bytes_per_period"]
    report = json.loads((tmp_path / "g/summary.json").read_text())
    for g in (0, 1):
        s = json.loads((tmp_path / f"g/group_{g}/summary.json").read_text())["groups"]
        handshake = s["sent_bytes"] - 4 * per_period
        assert 0 <= handshake <= 4 * 80, (s["sent_bytes"], per_period)
        if not shaped:
            continue
        # What left the group's namespace: the counted headers and payloads, plus TCP/IP
        # framing (about 6%) and torchft's control traffic (quorums, heartbeats every
        # 100 ms, the store: 2-3 kB a second in benchmarks/groups_link.py's runs), and
        # nothing as large as a second copy of the payloads.
        link = report["link_tx_bytes"][str(g)]
        control = 5_000 * report["wall_s"] + 32_000
        assert s["sent_bytes"] < link < 1.1 * s["sent_bytes"] + control, (report, s)


def test_groups_of_pipelines_equal_one_programs_pipeline_diloco(tmp_path):
    """Two groups, each a pipeline of 2 stages (one replica), end with the theta_sync that
    one program's DiLoCo over two pipeline replicas gives: the outer step runs on the
    model's own layout and is written back to every stage. The two programs differ in
    float rounding (as a pipeline and data parallelism do, about 1e-4 here after 40
    steps), far below what a misplaced stage, replica or copy of the embedding would give."""
    common = ["steps=40", "optimizer.name=sgd", "optimizer.lr=0.05", "sync.outer_lr=0.7",
              "sync.outer_momentum=0.9", "checkpoint_every=0", "stages=2",
              "sync.fragments=1", "sync.overlap=0"]  # fmt: skip
    _groups_against_one_program(tmp_path, common, atol=5e-4)
    for g in (0, 1):
        s = json.loads((tmp_path / f"g/group_{g}/summary.json").read_text())["groups"]
        assert s["exchanges"] == 4 and s["failed"] == 0 and s["heals"] == 0
        # One float32 model a member: the model's own parameters, not every stage's copy.
        assert s["payload_bytes"] == [
            4 * json.loads((tmp_path / f"g/group_{g}/summary.json").read_text())["params"]
        ]


def _start(slot, count, lighthouse, out, extra, resume=False):
    from train.groups import start_group

    sets = [*SETS, *GROUP, *extra]
    return start_group(slot, count, lighthouse, out, CONFIG, sets, resume=resume, env=_env())


def _wait_rows(folder, step, proc, limit=300):
    end = time.monotonic() + limit
    while time.monotonic() < end:
        rows = _rows(folder)
        if rows and rows[-1]["step"] >= step:
            return rows
        assert proc.poll() is None, f"the group ended early ({proc.returncode})"
        time.sleep(0.2)
    raise AssertionError(f"{folder} did not reach step {step}")


def _await_ready(spare, limit=300):
    """Wait until ``spare`` has loaded its libraries (its log if it ends or takes too long)."""
    end = time.monotonic() + limit
    while not spare.ready():
        assert spare.proc.poll() is None and time.monotonic() < end, spare.log.read_text()
        time.sleep(0.2)


@pytest.fixture
def lighthouse():
    from train.launch import free_port
    from train.replica import lighthouse as make

    os.environ.setdefault("RUST_LOG", "error")
    port = free_port()
    lh = make(f"[::]:{port}", 1, grace_ms=300, heartbeat_ms=1500)
    yield f"http://127.0.0.1:{port}"
    lh.shutdown()


# Group 1 (killed, restarted and healed) is one process in both: "2 processes" covers a
# group of one process beside a group of two.
@pytest.mark.parametrize("layout", ["2 processes", "2 stages"])
def test_a_killed_group_leaves_the_other_training_and_a_restart_is_healed(
    tmp_path, lighthouse, layout
):
    """kill -9 of group 1 mid-run: group 0 goes on alone (the same process, no restart).
    Group 1 restarted with no checkpoint of its own, on a hot spare started beside the
    groups, is healed from group 0's live state: it starts at group 0's step (its first
    life's metrics rows kept, its second life's output in the same log), and both end with
    bit-identical theta_sync. With group 0 one jax.distributed job of 2 processes, its leader
    alone meets the loss of group 1 and serves the heal, and both its processes end with
    the same state. With both groups pipelines of 2 stages (group 0's across its 2
    processes, one stage each: the head's optimizer state lives on process 1 alone), the
    heal carries every stage's parameters and optimizer state and the outer state on the
    model's own layout, gathered from both of group 0's processes into its leader."""
    from train.groups import Spare, group_args, start_group

    processes, own = LAYOUTS[layout]
    # A group of 2 processes steps about three times as fast as one process of 2 devices:
    # it runs longer, so that it is still running when group 1 comes back.
    steps = 600 if processes == 1 else 1200
    extra = [*own, "aggregator=ring", f"steps={steps}", "checkpoint_every=0"]
    # At the normal class (an idle-class spare could wait for the busy test machine to
    # leave it cycles until group 0 has finished).
    spare = Spare(tmp_path, 0, _env(), idle=False)
    sets0 = [*SETS, *GROUP, *extra]
    p0 = start_group(0, 2, lighthouse, tmp_path, CONFIG, sets0, env=_env(), processes=processes)
    p1 = _start(1, 2, lighthouse, tmp_path, extra)
    try:
        _await_ready(spare)
        _wait_rows(tmp_path / "group_1", 25, p1)
        p1.send_signal(signal.SIGKILL)
        p1.wait()
        killed_at = _rows(tmp_path / "group_0")[-1]["step"]
        rows0 = _wait_rows(tmp_path / "group_0", killed_at + 30, p0)
        alone = [r["group_members"] for r in rows0 if r["step"] > killed_at + 10
                 and "group_members" in r]  # fmt: skip
        assert alone and set(alone) == {1}, alone
        before = _rows(tmp_path / "group_1")
        assert not (tmp_path / "group_1" / "checkpoints").is_dir() or not any(
            p.name.isdigit() for p in (tmp_path / "group_1" / "checkpoints").iterdir()
        )  # nothing of its own to resume: the restart must come from a live peer
        args = group_args(1, 2, lighthouse, tmp_path, CONFIG, [*SETS, *GROUP, *extra])
        p1 = spare.take(args, tmp_path / "group_1.log", None)
        assert p0.wait(timeout=600) == 0, _logs(tmp_path)
        assert p1.wait(timeout=600) == 0, _logs(tmp_path)
    finally:
        for p in (p0, p1):
            if p.poll() is None:
                p.kill()
        spare.stop()
    log0 = (tmp_path / "group_0.log").read_text()
    assert log0.count("compiling the training step") == 1  # never restarted
    log1 = (tmp_path / "group_1.log").read_text()
    assert log1.count("compiling the training step") == 2  # the spare's life logged there too
    assert "compiling" not in spare.log.read_text()
    s1 = json.loads((tmp_path / "group_1/summary.json").read_text())
    assert s1["groups"]["heals"] == 1, s1["groups"]
    s0 = json.loads((tmp_path / "group_0/summary.json").read_text())
    if processes > 1:  # each process's (theta_sync, parameters) ids, gathered at the end
        ids = s0["groups"]["process_ids"]
        assert len(ids) == processes and all(i == ids[0] for i in ids), ids
    # Group 0 served the heal over its checkpoint server: its parameters, Adam's two
    # moments, and every fragment's theta_sync and outer momentum, five float32 models; a
    # pipeline's parameters hold each later stage's copy of the embedding and the head too.
    model = 4 * s0["params"]
    extra = 0
    if "stages=2" in own:
        tree = serialization.msgpack_restore((tmp_path / "group_0/params.msgpack").read_bytes())
        extra = 4 * sum(np.size(a) for k in ("embed", "head") for a in jax.tree.leaves(tree[k]))
    assert s0["groups"]["heals_served"] == 1, s0["groups"]
    # Streamed as raw bytes (pickled NumPy arrays would take about 7.2 models).
    heal = s0["groups"]["heal_sent_bytes"]
    assert 5 * model + extra < heal < 5.5 * model + extra, s0["groups"]
    assert s1["groups"]["heal_sent_bytes"] == 0
    # What group 1 installed (parameters, optimizer state, step, data position, read back
    # from its devices) is what group 0 served, bit for bit.
    assert s1["groups"]["heal_taken_ids"] == s0["groups"]["heal_served_ids"], (s0, s1)
    assert len(s1["groups"]["heal_taken_ids"]) == 1
    rows1 = _rows(tmp_path / "group_1")
    # Its first life's rows are kept; its second starts where group 0 was, not at step 1.
    assert rows1[: len(before)] == before
    first = rows1[len(before)]["step"]
    assert first > killed_at + 10
    a = _params(tmp_path / "group_0/params.msgpack")
    b = _params(tmp_path / "group_1/params.msgpack")
    for (k, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(k))
    rows0 = _rows(tmp_path / "group_0")
    assert [r["step"] for r in rows0] == list(range(1, steps + 1))
    assert rows0[-1]["loss"] < rows0[0]["loss"]


def test_a_group_of_two_processes_is_healed_and_its_processes_agree(tmp_path, lighthouse):
    """Group 0 is one jax.distributed job of 2 processes (1 device each; its first process
    alone talks to the other groups and hands each outcome to the other at the merge).
    Started first, as a restart into a running run (``groups.rejoin``), it waits at its
    start until group 1, started after it, has committed an exchange, and is healed from
    group 1's live state. Its last exchange (fragment 1's, launched at the last step) fails
    in its leader (injected: ``JAXCOMM_TEST_FAIL_EXCHANGE_AT``), which hands that outcome to
    the other process: neither merges it, group 1 takes that step alone, and both of group
    0's processes still end with the leader's theta_sync and the same parameters (checked
    in the run; its ids in the summary). The groups end bit-identical in fragment 0 and
    apart in fragment 1."""
    from train.groups import start_group

    extra = ["workers=2", "global_batch=8", "aggregator=ring", "steps=400",
             "checkpoint_every=0", "groups.start_timeout_s=2"]  # fmt: skip
    sets = [*SETS, *GROUP, *extra, "groups.rejoin=true", "groups.start_timeout_s=240"]
    env = {**_env(), "JAXCOMM_TEST_FAIL_EXCHANGE_AT": "400"}
    p0 = start_group(0, 2, lighthouse, tmp_path, CONFIG, sets, env=env, processes=2)
    p1 = None
    try:
        # Group 1 starts once group 0 is compiling: it is then in its start's wait (for a
        # heal) before group 1 has gone far.
        end = time.monotonic() + 300
        log0 = tmp_path / "group_0.log"
        while not (log0.is_file() and "compiling the training step" in log0.read_text()):
            assert p0.poll() is None and time.monotonic() < end, _logs(tmp_path)
            time.sleep(0.2)
        p1 = _start(1, 2, lighthouse, tmp_path, extra)
        assert p0.wait(timeout=600) == 0, _logs(tmp_path)
        assert p1.wait(timeout=600) == 0, _logs(tmp_path)
    finally:
        for p in (p0, p1):
            if p is not None and p.poll() is None:
                p.kill()
    s0 = json.loads((tmp_path / "group_0/summary.json").read_text())["groups"]
    assert s0["heals"] == 1 and s0["exchanges"] > 10 and s0["failed"] == 1, s0
    ids = s0["process_ids"]
    assert len(ids) == 2 and ids[0] == ids[1], ids
    rows0 = _rows(tmp_path / "group_0")
    assert rows0[0]["step"] > 1  # started where group 1 was when it healed it, not at step 1
    assert rows0[-1]["group_failed"] is True
    assert _rows(tmp_path / "group_1")[-1]["group_members"] == 1
    a = _params(tmp_path / "group_0/params.msgpack")
    b = _params(tmp_path / "group_1/params.msgpack")
    same = {}  # each layer: bit-identical in both groups or apart in every leaf
    for (k, x), (_, y) in zip(a, b, strict=True):
        same.setdefault(k[0].key, set()).add(bool(np.array_equal(x, y)))
    assert all(len(v) == 1 for v in same.values()), same
    assert {v.pop() for v in same.values()} == {True, False}, same


def test_a_spare_loads_at_the_idle_class_and_says_so_of_a_malformed_order(tmp_path):
    from train.groups import Spare

    idle = Spare(tmp_path, 1, _env(), idle=True)
    try:  # the wrapper's first line sets the class; the imports come after the exec
        end = time.monotonic() + 60
        while os.sched_getscheduler(idle.proc.pid) != os.SCHED_IDLE:
            assert idle.proc.poll() is None and time.monotonic() < end
            time.sleep(0.05)
    finally:
        idle.stop()
    spare = Spare(tmp_path, 0, _env(), idle=False)
    try:
        _await_ready(spare)
        tmp = spare.order.with_suffix(".tmp")
        tmp.write_text('{"id": 0, "log": "x"}')
        tmp.replace(spare.order)
        assert spare.proc.wait(timeout=60) == 2
    finally:
        spare.stop()
    assert "not an order ('argv')" in spare.log.read_text()


def test_one_spare_forks_every_restart_and_reports_how_each_ended(tmp_path):
    """A spare serves order after order, each a fork of the one loaded process: a fork's
    exit code comes back through its handle (0 for a clean end, 2 for a config that does
    not exist, -9 for a SIGKILL, as Popen reports them), each fork's output goes to its own
    log, and the spare is still there, ready, after all three."""
    from train.groups import Spare

    spare = Spare(tmp_path, 0, _env(), idle=False)
    try:
        _await_ready(spare)
        ok = spare.take(["--list-keys"], tmp_path / "a.log", None)
        assert ok.wait(timeout=120) == 0, (tmp_path / "a.log").read_text()
        bad = spare.take(["--config", str(tmp_path / "none.yaml")], tmp_path / "b.log", None)
        assert bad.wait(timeout=120) == 2
        # A fork that waits (itself a spare, for an order nobody writes) until killed.
        held = spare.take(["--standby", str(tmp_path / "inner.json")], tmp_path / "c.log", None)
        end = time.monotonic() + 60
        while not (tmp_path / "inner.json.ready").is_file():
            assert held.poll() is None and time.monotonic() < end
            time.sleep(0.05)
        assert held.pid != spare.proc.pid and held.poll() is None
        held.kill()
        assert held.wait(timeout=60) == -signal.SIGKILL
        assert spare.ready() and spare.taken == 3
    finally:
        spare.stop()
    assert "sync.outer_lr" in (tmp_path / "a.log").read_text()
    assert "none.yaml" in (tmp_path / "b.log").read_text()
    assert "sync.outer_lr" not in (tmp_path / "b.log").read_text()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_stopped_run_of_int8_groups_resumes_bit_exactly(tmp_path, layout):
    """Two groups exchanging error-fed int8 pseudo-gradients, stopped at step 20 and
    resumed to 30, end where an uninterrupted run to 30 ends, bit for bit (theta_sync,
    the error feedback and the outer momentum are in each group's checkpoint). With 2
    processes a group, each group is one jax.distributed job whose leader alone talks to
    the other group: its checkpoint is written by both processes and read back by both.
    With 2 stages, each group is a pipeline across its 2 processes (a stage each) whose
    outer state is kept on the model's own layout and written back to each stage at the
    resume."""
    processes, own = LAYOUTS[layout]
    extra = [*own, "aggregator=ring", "checkpoint_every=10", "sync.compress=int8"]
    flags = ["--processes-per-group", str(processes)]
    r = _launch(tmp_path / "whole", 2, [*extra, "steps=30"], *flags)
    assert r.returncode == 0, _logs(tmp_path / "whole")
    r = _launch(tmp_path / "cut", 2, [*extra, "steps=20"], *flags)
    assert r.returncode == 0, _logs(tmp_path / "cut")
    r = _launch(tmp_path / "cut", 2, [*extra, "steps=30"], "--resume", *flags)
    assert r.returncode == 0, _logs(tmp_path / "cut")
    for g in (0, 1):
        a = _params(tmp_path / f"whole/group_{g}/params.msgpack")
        b = _params(tmp_path / f"cut/group_{g}/params.msgpack")
        for (k, x), (_, y) in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(k))
        s = json.loads((tmp_path / f"cut/group_{g}/summary.json").read_text())
        assert s["resumed"] and s["groups"]["heals"] == 0
        payload = s["groups"]["payload_bytes"]
        # int8 codes and a float32 scale per 512 entries: about a quarter of float32.
        sizes = [len(x.reshape(-1)) for _, x in a]
        assert sum(payload) < 0.27 * 4 * sum(sizes)


def _own_lighthouse(port):
    """A lighthouse in a process of its own (so that a test can kill it), once it serves."""
    code = ("import time; from train.replica import lighthouse; "
            f"lh = lighthouse('[::]:{port}', 1, grace_ms=300, heartbeat_ms=1500); "
            "print('ready', flush=True); time.sleep(10**9)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_groups_whose_lighthouse_dies_train_on_alone_and_say_why(tmp_path):
    """The lighthouse killed mid-run: every later exchange fails within its stated limits
    (no hang), each group says so on stderr naming the limit, merges nothing of the
    others', and finishes its steps and its summary on its own model."""
    from train.launch import free_port

    port = free_port()
    lh = _own_lighthouse(port)
    limits = ["groups.timeout_s=3", "groups.quorum_timeout_s=3", "groups.retries=0"]
    extra = ["workers=1", "aggregator=ring", "steps=80", "checkpoint_every=0", *limits]
    address = f"http://127.0.0.1:{port}"
    procs = [_start(g, 2, address, tmp_path, extra) for g in (0, 1)]
    try:
        _wait_rows(tmp_path / "group_0", 25, procs[0])
        lh.kill()
        lh.wait()
        for p in procs:
            assert p.wait(timeout=600) == 0, _logs(tmp_path)
    finally:
        for p in [*procs, lh]:
            if p.poll() is None:
                p.kill()
    for g in (0, 1):
        s = json.loads((tmp_path / f"group_{g}/summary.json").read_text())
        assert s["steps"] == 80
        assert s["groups"]["failed"] >= 1 and s["groups"]["exchanges"] >= 2, s["groups"]
        log = (tmp_path / f"group_{g}.log").read_text()
        assert "failed in every try" in log and "nothing was merged" in log, log[-3000:]
        # Alone after the lighthouse died: every exchange after it had no member but this.
        rows = _rows(tmp_path / f"group_{g}")
        late = [r for r in rows if r["step"] > 40 and "group_members" in r]
        assert late and all(r["group_members"] <= 1 for r in late), late


def test_a_group_stopped_past_the_heartbeat_is_left_out_then_healed(tmp_path, lighthouse):
    """Group 1 frozen (SIGSTOP) for 8 s, past the lighthouse's 1.5 s heartbeat: group 0
    goes on without it (left out of its quorums, never waiting past the limits), and
    once it resumes, behind the others' count, it is healed from group 0 and both end with
    the same theta_sync."""
    extra = ["workers=1", "aggregator=ring", "steps=240", "checkpoint_every=0",
             "groups.timeout_s=5", "groups.quorum_timeout_s=20"]  # fmt: skip
    procs = [_start(g, 2, lighthouse, tmp_path, extra) for g in (0, 1)]
    try:
        _wait_rows(tmp_path / "group_1", 30, procs[1])
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = _rows(tmp_path / "group_0")[-1]["step"]
        time.sleep(8)
        procs[1].send_signal(signal.SIGCONT)
        for p in procs:
            assert p.wait(timeout=600) == 0, _logs(tmp_path)
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            if p.poll() is None:
                p.kill()
    rows0 = _rows(tmp_path / "group_0")
    alone = [r for r in rows0 if r["step"] > stopped_at and r.get("group_members") == 1]
    assert alone, "group 0 never exchanged without the frozen group"
    s1 = json.loads((tmp_path / "group_1/summary.json").read_text())["groups"]
    assert s1["heals"] >= 1, s1
    a = _params(tmp_path / "group_0/params.msgpack")
    b = _params(tmp_path / "group_1/params.msgpack")
    for (k, x), (_, y) in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(k))


def test_a_group_started_with_another_config_stops_with_one_clear_error(tmp_path, lighthouse):
    """Two live groups whose configs differ (the inner learning rate): the headers'
    settings fingerprints differ, the majority rule keeps one group's, and the other stops
    at its first exchange with one line naming why and what to do; the kept group trains
    on alone and merges nothing of the other's."""
    base = ["workers=1", "aggregator=ring", "steps=40", "checkpoint_every=0",
            "optimizer.name=sgd"]  # fmt: skip
    procs = [_start(g, 2, lighthouse, tmp_path, [*base, f"optimizer.lr={0.05 + 0.01 * g}"])
             for g in (0, 1)]  # fmt: skip
    try:
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert sorted(codes) == [0, 1] or sorted(codes) == [0, 2], (codes, _logs(tmp_path))
    bad, good = (0, 1) if codes[0] else (1, 0)
    log = (tmp_path / f"group_{bad}.log").read_text()
    assert "is left out of every exchange: another run's settings" in log, log[-2000:]
    assert "the same config" in log
    rows = _rows(tmp_path / f"group_{good}")
    assert rows[-1]["step"] == 40
    kept = [r["group_kept"] for r in rows if "group_kept" in r]
    assert kept and all(k <= 1 for k in kept), kept  # it exchanged, alone
