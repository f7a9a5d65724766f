"""Multi-process training through train.launch (gloo on CPU) and the launcher's faults."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from conftest import child_env
from flax import serialization

from train import launch as launch_mod
from train.config import load_config
from train.trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL_GPT = ["--set", "model.num_layers=1", "--set", "model.width=32", "--set", "model.seq_len=32"]


def _launch(args, timeout=600):
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "train.launch", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _start(args, *, sigint_ignored=False):
    """``python -m train.launch args`` started in the background (pipes for its output);
    ``sigint_ignored``: with SIGINT ignored, as a shell starts a background job."""
    import signal

    def ignore():
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    env = child_env()
    return subprocess.Popen(
        [sys.executable, "-m", "train.launch", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ignore if sigint_ignored else None,
    )


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _params(run_dir):
    state = serialization.msgpack_restore((run_dir / "params.msgpack").read_bytes())
    return jax.tree.leaves(state)


def _kill_after_checkpoint(proc, run_dir, *, process, step):
    """``kill -9`` launched ``process`` of ``proc`` (read from the launcher's stderr) as soon
    as checkpoint ``step`` of ``run_dir`` is committed: its checksum file is written (a
    checkpoint folder without one is unverifiable and not resumed)."""
    pid = None
    while pid is None:
        line = proc.stderr.readline()
        assert line, f"launcher ended before starting process {process}"
        if line.startswith(f"[launch] process {process}: pid "):
            pid = int(line.split()[-1])
    sums = run_dir / "checksums" / f"{step}.json"
    deadline = time.monotonic() + 300
    while not sums.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint appeared"
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)


def _single(overrides, run_dir):
    cfg = load_config(str(ROOT / "configs/dp_default.yaml"), [*overrides, f"out_dir={run_dir}"])
    Trainer(cfg).run()


def test_two_processes_end_where_one_process_ends(tmp_path):
    """The README's main job for 4 steps as 2 processes x 4 CPU devices (gloo) and as one
    process with 8: the same losses, validation loss, bytes and parameters (to 1e-5: XLA
    compiles the 4-device and 8-device programs separately)."""
    sets = ["steps=4", "checkpoint_every=2", "eval_every=2", "progress=false"]
    two = tmp_path / "two"
    args = ["--processes", "2", "--config", "configs/dp_default.yaml"]
    for s in [*sets, f"out_dir={two}"]:
        args += ["--set", s]
    proc = _launch(args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[p0]" in proc.stdout and "sent a step" in proc.stdout
    assert "final_loss" not in "".join(
        line for line in proc.stdout.splitlines(True) if line.startswith("[p1]")
    )
    one = tmp_path / "one"
    _single(sets, one)
    a, b = _rows(two), _rows(one)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-6)
    np.testing.assert_allclose(a[1]["valid_loss"], b[1]["valid_loss"], rtol=1e-6)
    assert [r["sent_bytes"] for r in a] == [r["sent_bytes"] for r in b]
    for x, y in zip(_params(two), _params(one), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["2", "4"]
    # The 2-process checkpoint resumes in one process with 8 devices (Orbax restores the
    # global arrays into this mesh) and continues like the single-process run.
    cfg = load_config(
        str(ROOT / "configs/dp_default.yaml"), [*sets[1:], "steps=5", f"out_dir={two}"]
    )
    resumed = Trainer(cfg)
    resumed.run(resume=True)
    more = Trainer(
        load_config(str(ROOT / "configs/dp_default.yaml"), [*sets[1:], "steps=5", f"out_dir={one}"])
    )
    more.run(resume=True)
    np.testing.assert_allclose(_rows(two)[-1]["loss"], _rows(one)[-1]["loss"], rtol=1e-6)


def _sleeper(seconds=120, woke=None):
    """A process that sleeps; with ``woke``, it creates that file if it sleeps to the end."""
    code = f"import time; time.sleep({seconds})"
    if woke is not None:
        code += f"; open({str(woke)!r}, 'w').close()"
    return [sys.executable, "-c", code]


def test_a_failing_process_stops_the_others(capsys, tmp_path):
    woke = tmp_path / "woke"
    rc = launch_mod.launch(
        2,
        [],
        devices_per_process=1,
        grace_s=2.0,
        commands=[
            _sleeper(woke=woke),
            [sys.executable, "-c", "import sys; print('bye'); sys.exit(3)"],
        ],
    )
    assert rc == 3
    assert not woke.exists()  # stopped, not waited out
    captured = capsys.readouterr()
    assert "[p1] bye" in captured.out
    assert "process 1 failed (exit code 3); stopping the other processes" in captured.err


def test_sigkill_is_reported_as_128_plus_signal(capsys):
    kill = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    rc = launch_mod.launch(2, [], devices_per_process=1, grace_s=2.0, commands=[_sleeper(), kill])
    assert rc == 128 + signal.SIGKILL
    assert "process 1 failed (signal 9)" in capsys.readouterr().err


def test_the_first_process_to_fail_is_blamed_with_the_error_it_reported(capsys, tmp_path):
    """Process 0 reports an error and exits at once (as ``python -m train`` does in a
    multi-process run), while process 1 would fail later on its own (as on gloo's
    timeout): the launcher stops process 1 and names process 0 with its error line."""
    woke = tmp_path / "woke"
    said_and_exits = [
        sys.executable,
        "-c",
        "import sys; print('error: the folder is taken', flush=True); sys.exit(1)",
    ]
    fails_later = [
        sys.executable,
        "-c",
        f"import sys, time; time.sleep(60); open({str(woke)!r}, 'w').close(); "
        "print('timed out'); sys.exit(1)",
    ]
    rc = launch_mod.launch(
        2, [], devices_per_process=1, grace_s=2.0, commands=[said_and_exits, fails_later]
    )
    assert rc == 1
    assert not woke.exists()  # stopped, not waited out
    captured = capsys.readouterr()
    assert "[p0] error: the folder is taken" in captured.out
    assert "timed out" not in captured.out
    assert "process 0 failed (exit code 1): the folder is taken; stopping" in captured.err
    assert "process 1 failed" not in captured.err


def test_a_reported_error_keeps_the_process_exit_code(capsys):
    """A process that reports an error and exits by itself: its own exit code."""
    code = "import sys; print('error: bad key', flush=True); sys.exit(2)"
    rc = launch_mod.launch(
        2, [], devices_per_process=1, grace_s=2.0,
        commands=[[sys.executable, "-c", code], _sleeper()],
    )  # fmt: skip
    assert rc == 2
    assert "process 0 failed (exit code 2): bad key; stopping" in capsys.readouterr().err


_HOLD_LOCK = """
import sys, time
from pathlib import Path
from train.checkpoint import run_lock
with run_lock(Path(sys.argv[1])):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_launch_into_a_busy_run_folder_reports_process_0s_refusal(tmp_path):
    """Another live run holds the run folder's lock: process 0 refuses it, and the launcher
    reports that refusal at once instead of process 1's failure when gloo gives up waiting
    for process 0 (which waits for process 1 in JAX's shutdown meanwhile)."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(run)],
        cwd=ROOT,
        env=child_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        args = ["--processes", "2", "--config", "configs/dp_default.yaml", *SMALL_GPT]
        for s in ["workers=2", "global_batch=8", "model.seq_len=16", "steps=2",
                  "progress=false", f"out_dir={run}"]:  # fmt: skip
            args += ["--set", s]
        proc = _launch(args)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"[p0] error: another run is writing to {str(run)!r} (process {holder.pid}" in (
        proc.stdout
    )
    assert (
        f"[launch] process 0 failed (exit code 1): another run is writing to {str(run)!r}"
        in proc.stderr
    )
    assert "process 1 failed" not in proc.stderr
    assert "timed out" not in proc.stdout  # gloo's wait was not what ended it


def test_launcher_rejects_a_process_count_that_does_not_divide_the_mesh(capsys):
    rc = launch_mod.main(["--processes", "3", "--config", str(ROOT / "configs/dp_default.yaml")])
    assert rc == 2
    assert "--processes=3 must divide" in capsys.readouterr().err


def test_killed_run_resumes_from_its_last_complete_checkpoint(tmp_path):
    """SIGKILL one of two processes mid-run: the launcher stops the other and fails; a
    partial checkpoint left behind is ignored; ``--resume`` continues from the newest
    complete checkpoint and ends where an uninterrupted run ends."""
    run = tmp_path / "run"
    common = ["--config", "configs/dp_default.yaml", *SMALL_GPT]
    sets = ["checkpoint_every=5", "eval_every=0", "progress=false", f"out_dir={run}"]
    args = ["--processes", "2", *common]
    for s in [*sets, "steps=100000"]:
        args += ["--set", s]
    proc = _start(args)
    _kill_after_checkpoint(proc, run, process=1, step=10)
    ckpt = run / "checkpoints"
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGKILL
    assert "process 1 failed (signal 9)" in err
    done = sorted(int(p.stem) for p in (run / "checksums").glob("*.json"))
    assert done and done[-1] >= 10
    before = _rows(run)  # steps run before the kill, some past the newest checkpoint
    # A checkpoint that was being written when the process died is never picked up.
    partial = ckpt / f"{done[-1] + 5}.orbax-checkpoint-tmp-1"
    partial.mkdir()
    (partial / "junk").write_text("half written")
    steps = done[-1] + 10
    args = ["--processes", "2", *common, "--resume"]
    for s in [*sets, f"steps={steps}"]:
        args += ["--set", s]
    again = _launch(args)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"{steps} steps (resumed) ==" in again.stdout
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # Steps up to the checkpoint are the killed run's own rows (host times included): the
    # run continued from step done[-1], it did not start over.
    assert rows[: done[-1]] == before[: done[-1]]
    ref = tmp_path / "ref"
    _single(
        [o.split("=", 1)[0] + "=" + o.split("=", 1)[1] for o in SMALL_GPT[1::2]]
        + ["checkpoint_every=0", "eval_every=0", "progress=false", f"steps={steps}"],
        ref,
    )
    np.testing.assert_allclose(rows[-1]["loss"], _rows(ref)[-1]["loss"], rtol=1e-5)
    for x, y in zip(_params(run), _params(ref), strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5)


_WRAPPER = """
import sys, time
from train import launch
sleeper = [sys.executable, "-c",
           "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"]
sys.exit(launch.launch(2, [], devices_per_process=1, grace_s=2.0,
                       commands=[sleeper + [sys.argv[1] + "0"], sleeper + [sys.argv[1] + "1"]]))
"""


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def _start_wrapper(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRAPPER, str(tmp_path / "pid")], cwd=ROOT)
    pids = []
    deadline = time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        pids = [int(p.read_text()) for p in tmp_path.glob("pid*") if p.read_text()]
        time.sleep(0.2)
    assert len(pids) == 2, "the launched processes did not start"
    return proc, pids


_LOUD_FAILURE = """
import sys
from train import launch
loud = [sys.executable, "-c", "import os, sys\\nfor i in range(3000): print('line', i)\\n"
        "print('error: boom', flush=True)\\nos._exit(1)"]
quiet = [sys.executable, "-c", "import time; time.sleep(60)"]
sys.exit(launch.launch(2, [], devices_per_process=1, grace_s=2.0, commands=[loud, quiet]))
"""


def test_a_failure_is_reported_with_the_error_its_process_wrote_last():
    """A process that writes much and then its error as it exits: its exit is seen while
    its lines still wait to be relayed; the launcher reads them out first, so it names
    the error (it once said only "failed (exit code 1)", under load)."""
    proc = subprocess.run([sys.executable, "-c", _LOUD_FAILURE], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "[launch] process 0 failed (exit code 1): boom; stopping" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert proc.stdout.count("[p0] line ") == 3000


def test_children_die_with_a_killed_launcher(tmp_path):
    """``kill -9`` of the launcher, which no handler sees, still ends its processes."""
    proc, pids = _start_wrapper(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    # A safety deadline, not a timing: the children would otherwise sleep 120 s.
    deadline = time.monotonic() + 100
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_sigterm_to_the_launcher_exits_143_and_stops_everything(tmp_path):
    proc, pids = _start_wrapper(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert not any(_alive(p) for p in pids)


def test_a_local_coordinator_listens_on_loopback_only(monkeypatch):
    from train import distributed

    seen, gloo = {}, []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.update(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    # This process's own backends are not touched: where gloo would listen is recorded.
    monkeypatch.setattr(distributed, "_gloo_listener", lambda *where: lambda: gloo.append(where))
    env = {"JAXCOMM_COORDINATOR": "127.0.0.1:4321", "JAXCOMM_NUM_PROCESSES": "2",
           "JAXCOMM_PROCESS_ID": "0"}  # fmt: skip
    assert distributed.initialize(env)
    assert seen["coordinator_bind_address"] == "127.0.0.1:4321"
    assert gloo == [("127.0.0.1", None)]  # gloo on loopback too
    distributed.initialize({**env, "JAXCOMM_COORDINATOR": "10.1.2.3:4321"})
    assert seen["coordinator_bind_address"] is None  # a cluster: JAX's default
    assert gloo == [("127.0.0.1", None)]  # and gloo on the host name's address, JAX's default
    distributed.initialize(
        {**env, "JAXCOMM_COORDINATOR": "10.1.2.3:4321", "JAXCOMM_GLOO_INTERFACE": "eth1"}
    )
    assert gloo[-1] == (None, "eth1")


_PIPE = ["workers=2", "stages=2", "boundary=aqsgd", "fw_bits=3", "global_batch=8",
         "microbatches=2", "model.num_layers=2", "model.width=32", "model.seq_len=16",
         "train_samples=16"]  # fmt: skip
# Without AQ-SGD's buffer (its first and later visits are two programs, which the adaptive
# search would compile for each candidate ratio; pipeline_diloco crosses with the buffer).
_PIPE_DIRECTQ = [s if s != "boundary=aqsgd" else "boundary=directq" for s in _PIPE]
# A pipeline's replicas of a stage share a process here, so its replica averaging does not
# cross processes: DiLoCo's (fragments, overlap, compression, the outer state) stands for the
# pipeline sync methods across processes, and local SGD and DreamDDP on a pipeline are
# tested in one process (test_pipeline_trainer); their averaging across processes is
# local_sgd_stragglers'.
_COMBOS = {
    "pipeline_diloco": [
        *_PIPE, "aggregator=none",
        "sync={method: diloco, period: 2, fragments: 2, overlap: 1, compress: int8}",
    ],
    "dp_diloco": [
        "workers=2", "global_batch=16", "model.num_layers=1", "model.width=32",
        "model.seq_len=16", "aggregator=none",
        "sync={method: diloco, period: 2, compress: sparseloco, outer_momentum: 0}",
    ],
    "pipeline_adaptive": [
        *_PIPE_DIRECTQ, "aggregator=ar_topk", "aggregator_args={select: star}", "optimizer=adam",
        "lr=3e-3", "adaptive={candidates: [0.1, 0.01], trial_steps: 1, min_interval: 2}",
        "network=50ms,1Gbps",
    ],
    "dp_adaptive": [
        "workers=2", "global_batch=16", "model.num_layers=1", "model.width=32",
        "model.seq_len=16", "aggregator=ar_topk", "aggregator_args={select: star}",
        "adaptive={candidates: [0.1, 0.01], trial_steps: 1, min_interval: 2}",
        # Latency-bound: the choice rests on rounds and gains, not on the host-timed
        # selection (which separate runs measure differently).
        "network=50ms,1Gbps",
    ],
    "local_sgd_stragglers": [
        "workers=2", "global_batch=16", "model.num_layers=1", "model.width=32",
        "model.seq_len=16", "aggregator=none", "sync={method: local_sgd, period: 3}",
        "stragglers={seed: 1, compute_sigma: 0.3, latency_jitter: 0.5}",
    ],
}  # fmt: skip


@pytest.mark.parametrize("combo", list(_COMBOS))
def test_new_combinations_on_two_processes_resume_bit_exactly(tmp_path, combo):
    """Each combination the composed trainer newly allows runs as two processes under the
    launcher, stopped at step 3 and resumed to 6, and ends bit for bit where one
    uninterrupted process ends: every logged column but host timings (losses, bytes,
    simulated time, ratios, averaged layers) and the parameters. A pipeline's stages sit
    on different processes (its messages cross between them, deltas from step 3); data
    parallelism's workers do (its averaging crosses)."""
    sets = [*_COMBOS[combo], "checkpoint_every=3", "eval_every=0", "progress=false"]
    two = tmp_path / "two"
    for steps, resume in ((3, False), (6, True)):
        args = ["--processes", "2", "--config", "configs/dp_default.yaml"]
        for s in [*sets, f"steps={steps}", f"out_dir={two}"]:
            args += ["--set", s]
        proc = _launch(args + (["--resume"] if resume else []))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-12000:]
    one = tmp_path / "one"
    cfg = load_config(str(ROOT / "configs/dp_default.yaml"), [*sets, "steps=6", f"out_dir={one}"])
    Trainer(cfg).run()
    volatile = ("compute_s", "buffer_prefetch_s", "buffer_exposed_s", "buffer_writeback_s")
    a, b = (
        [{k: v for k, v in r.items() if k not in volatile} for r in _rows(d)] for d in (two, one)
    )
    assert a == b
    if "boundary=aqsgd" in sets:
        p2p = [sum(w[5] for w in r["wire"] if w[0] == "p2p") for r in a]
        assert p2p[3] < p2p[0] / 2  # deltas once the samples repeat
        # Each process keeps (and checkpoints) the message buffers of its own stage.
        assert sorted(q.name for q in (two / "buffers" / "6").iterdir()) == [
            "process0",
            "process1",
        ]
    for x, y in zip(_params(two), _params(one), strict=True):
        np.testing.assert_array_equal(x, y)
