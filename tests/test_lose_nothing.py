"""Runs that lose nothing: a signal saves the last completed step, resuming a finished run
changes nothing, resuming an empty folder says so, and the summary is never replaced by
one without results."""

import json
import os
import re
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import child_env

from tests.test_distributed import _start
from tests.test_trainer import _cfg
from train.checkpoint import has_rows
from train.cli import main
from train.trainer import Interrupted, NothingToResume, Trainer

MLP = dict(task="mlp", model={"features": [16]}, dataset="digits", aggregator="ec_quantized")


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _stop_at(step: int, sig: int):
    """A metrics callback that raises ``sig`` in this process once ``step`` is logged."""

    def cb(row):
        if row["step"] == step:
            signal.raise_signal(sig)

    return cb


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals need main"
)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_checkpoints_the_last_step_and_resume_ends_bit_exact(tmp_path, sig):
    """With no checkpoint due for 100 steps, Ctrl-C (or SIGTERM) at step 3 of 12 saves the
    steps done (3, or 4 when the next was already dispatched), names --resume, and the
    resumed run ends where an uninterrupted one does: every logged loss and the error
    feedback's residuals (the run's per-worker state) alike."""
    kw = dict(MLP, steps=12, checkpoint_every=100, lr=0.05)
    run = _cfg(tmp_path, **kw)
    before = signal.getsignal(signal.SIGINT)  # the default, or ignored in a background job
    with pytest.raises(Interrupted, match="continue with python -m train --resume ") as stop:
        Trainer(run).run(metrics_cb=_stop_at(3, sig))
    assert stop.value.signum == sig
    assert str(stop.value).endswith(f"--resume {run.run_dir}")  # the folder, named
    saved = sorted(int(p.name) for p in (run.run_dir / "checkpoints").iterdir())
    assert saved in ([3], [4]) and f"at step {saved[0]} of 12" in str(stop.value)
    assert not (run.run_dir / "summary.json").exists()  # a summary is for a finished run
    # The handlers are gone with the run: the test process keeps its own.
    assert signal.getsignal(signal.SIGINT) is before
    resumed = Trainer(run)
    summary = resumed.run(resume=True)
    ref = Trainer(_cfg(tmp_path / "ref", **kw))
    ref_summary = ref.run()
    assert [r["loss"] for r in _rows(run.run_dir)] == [r["loss"] for r in _rows(ref.cfg.run_dir)]
    assert summary["final_loss"] == ref_summary["final_loss"]
    leaves = [jax.tree_util.tree_leaves(t.opt_state) for t in (resumed, ref)]
    for x, y in zip(*leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_resuming_a_finished_run_changes_nothing_and_can_go_further(tmp_path, capsys):
    run = _cfg(tmp_path, **MLP, steps=4, checkpoint_every=2)
    first = Trainer(run).run()
    files = {n: (run.run_dir / n).read_bytes() for n in ("summary.json", "metrics.jsonl")}
    again = Trainer(run).run(resume=True)
    assert "already complete at step 4" in capsys.readouterr().out
    assert again["already_complete"] and again["final_loss"] == first["final_loss"]
    assert {n: (run.run_dir / n).read_bytes() for n in files} == files
    # A larger steps continues from the end.
    more = Trainer(_cfg(tmp_path, **MLP, steps=6, checkpoint_every=2)).run(resume=True)
    assert more["steps"] == 6 and more["final_loss"] is not None
    assert [r["step"] for r in _rows(run.run_dir)] == list(range(1, 7))


def test_a_summary_lost_after_the_last_checkpoint_is_written_again_with_results(tmp_path):
    """A run that stopped between its final checkpoint and its summary gets the summary on
    resume, with the last step's loss and bytes from the log (not nulls)."""
    run = _cfg(tmp_path, **MLP, steps=4, checkpoint_every=2)
    first = Trainer(run).run()
    (run.run_dir / "summary.json").unlink()
    again = Trainer(run).run(resume=True)
    stored = json.loads((run.run_dir / "summary.json").read_text())
    for s in (again, stored):
        assert s["final_loss"] == first["final_loss"]
        for key in ("sent_bytes_mean", "sent_bytes_peak", "sent_bytes_total"):
            assert s[key] == first[key], key
        assert s["valid_loss"] == pytest.approx(first["valid_loss"], rel=1e-6)


def test_resuming_an_empty_folder_says_there_is_nothing_to_resume(tmp_path, capsys):
    run = _cfg(tmp_path, **MLP, steps=2)
    with pytest.raises(NothingToResume, match="nothing to resume in .*run without --resume"):
        Trainer(run).run(resume=True)
    assert not (run.run_dir / "checkpoints").exists() or not any(
        (run.run_dir / "checkpoints").iterdir()
    )
    assert not (run.run_dir / "metrics.jsonl").exists()
    args = ["--set", "task=mlp", "--set", "dataset=digits", "--set", "steps=2"]
    args += ["--set", f"out_dir={tmp_path / 'cli'}", "--no-progress", "--resume"]
    assert main(args) == 1
    assert "nothing to resume" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()  # nothing made: no lock, no checkpoint folder


def test_a_second_run_into_a_used_folder_is_told_how_to_choose_another(tmp_path):
    run = _cfg(tmp_path, **MLP, steps=2, checkpoint_every=2)
    Trainer(run).run()
    with pytest.raises(ValueError, match=r"--resume.*--set name=.*--set out_dir="):
        Trainer(run).run()


def _stderr_so_far(proc) -> str:
    """What the launcher printed on stderr up to now (its pid lines come first)."""
    text = ""
    while "process 1: pid" not in text:
        text += proc.stderr.readline()
    return text


@pytest.mark.parametrize("target", ["launcher", "one process"])
def test_a_signal_saves_every_process_and_resume_ends_as_one_run(tmp_path, target):
    """Two processes; once step 4 is logged (no checkpoint due), SIGINT to the launcher
    (which asks every process to stop) or SIGTERM to process 1 alone (which only it sees:
    without agreement process 0 would go on alone and hang in the next collective): the
    processes agree on the step, save it together, exit naming --resume; the resumed
    run (``--resume DIR`` alone, or the settings repeated) equals one uninterrupted
    process's."""
    sets = ["task=mlp", "dataset=digits", "model.features=[16]", "workers=4",
            "global_batch=16", "aggregator=ec_quantized", "checkpoint_every=100",
            "eval_every=0", "progress=false", "steps=40"]  # fmt: skip
    two = tmp_path / "two"
    args = ["--processes", "2"]
    for s in [*sets, f"out_dir={two}"]:
        args += ["--set", s]
    # Started as a shell's background job (SIGINT ignored): a SIGINT sent on purpose still
    # stops the run.
    proc = _start(args, sigint_ignored=target == "launcher")
    metrics = two / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    if target == "launcher":
        proc.send_signal(signal.SIGINT)
    else:
        pid = int(re.search(r"process 1: pid (\d+)", _stderr_so_far(proc)).group(1))
        os.kill(pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    want = 130 if target == "launcher" else 128 + signal.SIGTERM
    assert proc.returncode == want, out[-2000:] + err[-2000:]
    # Each process names the launcher's command (it was started by one).
    assert f"continue with python -m train.launch --processes 2 --resume {two}" in out
    saved = [int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(saved) == 1 and 4 <= saved[0] < 40
    # Resumed from the folder alone (its saved config), or with every setting repeated.
    again = _start(
        ["--processes", "2", "--resume", str(two)] if target == "launcher" else [*args, "--resume"]
    )
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, out[-2000:] + err[-2000:]
    one = tmp_path / "one"
    args = []
    for s in [*sets, f"out_dir={one}"]:
        args += ["--set", s]
    assert main(args) == 0
    a, b = _rows(two), _rows(one)
    assert [r["step"] for r in a] == list(range(1, 41))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


@pytest.mark.parametrize("target", ["launcher", "one process"])
def test_a_second_ctrl_c_stops_at_once_without_hanging(tmp_path, target):
    """Ctrl-C twice, 0.1 s apart, to the launcher or to process 1 alone: everything ends
    without hanging (a process that skipped the save must not wait in JAX's shutdown
    barrier for the others; a hang meets the 120 s safety deadline, far above the few
    seconds it takes), with no traceback and no process left; the launcher says what
    happened in one line."""
    sets = ["task=mlp", "dataset=digits", "model.features=[16]", "workers=4",
            "global_batch=16", "checkpoint_every=100", "eval_every=0", "progress=false",
            "steps=100000"]  # fmt: skip
    run = tmp_path / "run"
    args = ["--processes", "2"]
    for s in [*sets, f"out_dir={run}"]:
        args += ["--set", s]
    proc = _start(args)
    pid = int(re.search(r"process 1: pid (\d+)", _stderr_so_far(proc)).group(1))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    for _ in range(2):
        if target == "launcher":
            proc.send_signal(signal.SIGINT)
        else:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.1)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in out + err and "DEADLINE_EXCEEDED" not in out + err, err[-3000:]
    if target == "launcher":
        assert proc.returncode == 130
        assert "[launch] stopped at once" in err
    else:
        # Stopped at once (119), or the second Ctrl-C came while the checkpoint was being
        # written, which it waits for (then the run stops as after one Ctrl-C: 130).
        assert proc.returncode in (119, 130), err[-2000:]
        if proc.returncode == 119:
            assert "stopped at once by a second Ctrl-C" in err


def _sharded(rows: np.ndarray):
    mesh = jax.make_mesh((8,), ("data",))
    return jax.device_put(
        rows, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    )


def test_arrays_equal_on_every_worker_are_saved_once_and_restored_bit_for_bit(
    tmp_path, monkeypatch
):
    """Rows equal bit for bit (NaN and -0.0 included) are written once; rows that differ
    anywhere, even 0.0 against -0.0 or in one element, are written whole; the restore gives
    back every array exactly, in its sharding."""
    from train.checkpoint import Checkpoints

    rng = np.random.default_rng(0)
    row = rng.normal(size=(5, 3)).astype(np.float32)
    row[0, 0], row[1, 1] = np.nan, -0.0
    same = np.broadcast_to(row, (8, 5, 3)).copy()
    one_off = same.copy()
    one_off[6, 4, 2] = np.nextafter(one_off[6, 4, 2], np.float32(np.inf))
    signed = same.copy()
    signed[3, 1, 1] = 0.0  # -0.0 elsewhere
    state = {
        "same": _sharded(same),
        "one_off": _sharded(one_off),
        "signed": _sharded(signed),
        "ints": _sharded(np.tile(np.arange(4, dtype=np.int32), (8, 1))),
        "flags": _sharded(np.ones((8, 2), np.bool_)),
        "half": _sharded(np.broadcast_to(row.astype(jnp.bfloat16), (8, 5, 3)).copy()),
        "bytes": _sharded(np.tile(np.arange(6, dtype=np.uint8), (8, 1))),
        "step": np.asarray(7, np.int64),
    }
    store = Checkpoints(tmp_path, keep=1)
    # The save writes each shard from one replica (not one slice per device, each by an
    # eagerly compiled op) and leaves Orbax's array handler as it found it.
    handler = ocp.type_handlers.get_type_handler(jax.Array)
    seen, serialize = [], handler.serialize
    monkeypatch.setattr(
        handler,
        "serialize",
        lambda *a, **k: seen.append(handler._use_replica_parallel) or serialize(*a, **k),
    )
    before = handler._use_replica_parallel
    store.save(7, state, {"run": 1}, {})
    assert seen and not any(seen) and handler._use_replica_parallel == before
    rows = json.loads((tmp_path / "checkpoints" / "7" / "rows" / "metadata").read_text())
    assert sorted(rows["once"]) == ["['bytes']", "['flags']", "['half']", "['ints']", "['same']"]
    step, back, _ = store.restore(state, {"run": 1})
    store.close()
    assert step == 7
    for k, v in state.items():
        got = np.asarray(back[k])
        assert got.dtype == np.asarray(v).dtype
        np.testing.assert_array_equal(
            got.reshape(-1).view(np.uint8), np.asarray(v).reshape(-1).view(np.uint8)
        )
        if k != "step":
            assert back[k].sharding == v.sharding


def test_the_main_jobs_checkpoint_holds_one_copy_of_the_replicated_state(tmp_path):
    """Data parallelism with a dense ring: parameters and Adam's moments are identical on
    the 8 workers, so a checkpoint is about one copy of them (3 x 4 bytes per parameter),
    not eight; the error feedback of a compressed aggregator stays per worker."""
    run = _cfg(tmp_path, steps=2, checkpoint_every=2)
    t = Trainer(run)
    t.run()
    n = t.num_params()
    ckpt = run.run_dir / "checkpoints" / "2"
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    # Orbax's OCDBT files vary in size from run to run (one copy measured 417-705 KB for
    # 365 KB of arrays); eight copies would be 2.9 MB. Which leaves were written once is
    # checked exactly below.
    assert 3 * 4 * n <= size < 3 * 3 * 4 * n
    # Held once in the run (no worker axis), or a per-worker leaf whose rows were equal
    # and written once: every leaf of this synchronous run.
    once = json.loads((ckpt / "rows" / "metadata").read_text())["once"]
    leaves = jax.tree_util.tree_leaves({"p": t.params, "o": t.opt_state})
    held = [a for a in leaves if not has_rows(a)]
    assert len(held) >= len(jax.tree_util.tree_leaves(t.params))
    assert len(once) + len(held) == len(leaves)
    ec = _cfg(tmp_path / "ec", **MLP, steps=2, checkpoint_every=2)
    t = Trainer(ec)
    t.run()
    once = json.loads((ec.run_dir / "checkpoints" / "2" / "rows" / "metadata").read_text())["once"]
    residual = [
        jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path({"opt_state": t.opt_state})[0]
    ]
    assert any("residual" in r or "error" in r for r in residual)
    assert not [r for r in once if "residual" in r or "error" in r]


def test_a_summary_of_an_earlier_shorter_run_is_not_taken_for_this_ones(tmp_path):
    """Run 2 steps (summary of step 2), resume to 4 but stop at 4 without a summary (as a
    stop between the last checkpoint and the summary leaves it): resuming at 4 writes step
    4's summary and model, it does not return step 2's as complete."""
    run = _cfg(tmp_path, **MLP, steps=2, checkpoint_every=2)
    Trainer(run).run()
    longer = _cfg(tmp_path, **MLP, steps=4, checkpoint_every=2)
    full = Trainer(longer).run(resume=True)
    (run.run_dir / "summary.json").write_text(
        json.dumps({**json.loads((run.run_dir / "summary.json").read_text()), "steps": 2})
    )
    again = Trainer(longer).run(resume=True)
    assert again["steps"] == 4 and not again.get("already_complete")
    assert again["final_loss"] == full["final_loss"]
    assert json.loads((run.run_dir / "summary.json").read_text())["steps"] == 4


def test_a_torn_last_metrics_row_does_not_block_resume(tmp_path, capsys):
    run = _cfg(tmp_path, **MLP, steps=4, checkpoint_every=2)
    Trainer(run).run()
    path = run.run_dir / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 5, "loss": 1.2')  # a crash mid-write
    more = Trainer(_cfg(tmp_path, **MLP, steps=6, checkpoint_every=2)).run(resume=True)
    assert "line 5 is not a complete row (dropped)" in capsys.readouterr().err
    assert more["steps"] == 6 and [r["step"] for r in _rows(run.run_dir)] == list(range(1, 7))


def test_keys_complex_and_old_checkpoints_round_trip(tmp_path):
    """Typed PRNG keys and complex arrays (which cannot be compared bit for bit here) are
    saved whole even when equal on every worker; a checkpoint written before rows were
    saved once (no ``rows`` item, no sums, no run identity) restores as it was written when
    asked to resume an unverifiable checkpoint."""
    from train.checkpoint import Checkpoints

    keys = jax.random.split(jax.random.key(0), 8)
    same_keys = jax.random.wrap_key_data(
        np.broadcast_to(np.asarray(jax.random.key_data(keys[:1])), (8, 2)).copy()
    )
    state = {
        "keys": _sharded(same_keys),
        "complex": _sharded(np.ones((8, 3), np.complex64)),
        "w": _sharded(np.ones((8, 4), np.float32)),
    }
    store = Checkpoints(tmp_path / "a", keep=1)
    store.save(1, state, {"run": 1}, {})
    rows = json.loads((tmp_path / "a" / "checkpoints" / "1" / "rows" / "metadata").read_text())
    assert rows["once"] == ["['w']"]
    _, back, _ = store.restore(state, {"run": 1})
    store.close()
    np.testing.assert_array_equal(jax.random.key_data(back["keys"]), jax.random.key_data(same_keys))
    np.testing.assert_array_equal(np.asarray(back["complex"]), np.ones((8, 3), np.complex64))
    # The format before: every worker's rows, no "rows" item.
    import orbax.checkpoint as ocp

    old = Checkpoints(tmp_path / "b", keep=1)
    plain = {"w": _sharded(np.arange(32, dtype=np.float32).reshape(8, 4))}
    old.manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(plain),
                     meta=ocp.args.JsonSave({"run": 1}), extras=ocp.args.JsonSave({})),
                     force=True)  # fmt: skip
    old.manager.wait_until_finished()
    with pytest.raises(ValueError, match="--allow-unverified"):  # no sums, no run identity
        old.restore(plain, {"run": 1})
    _, back, _ = old.restore(plain, {"run": 1}, allow_unverified=True)
    old.close()
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(plain["w"]))


def test_a_signal_before_the_first_step_saves_nothing_and_says_so(tmp_path):
    """SIGINT while the step compiles: nothing to save yet, so the run ends at once with
    that said in one line (exit 130) and leaves no checkpoint; a run started afterwards in
    the same folder starts fresh without being told to resume."""
    import subprocess
    import sys

    from tests.test_trainer import ROOT

    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "train", "--set", "task=mlp", "--set", "dataset=digits",
           "--set", "steps=5", "--set", f"out_dir={run}"]  # fmt: skip
    env = child_env()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    seen = ""
    while "compiling the training step" not in seen:
        line = proc.stderr.readline()
        assert line, seen + proc.communicate()[0]
        seen += line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out + err
    assert "before step 1; nothing new to save" in out + err
    assert "Traceback" not in out + err
    assert not (run / "checkpoints").exists() or not any(
        p.name.isdigit() for p in (run / "checkpoints").iterdir()
    )
    assert main(["--set", "task=mlp", "--set", "dataset=digits", "--set", "steps=2",
                 "--set", f"out_dir={run}", "--no-progress"]) == 0  # fmt: skip
