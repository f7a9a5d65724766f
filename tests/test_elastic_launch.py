"""The elastic launcher: ``kill -9`` of one of 4 processes mid-run, and the run goes on."""

import json

from test_distributed import _kill_after_checkpoint, _rows, _start


def test_a_killed_process_is_survived_on_a_smaller_world(tmp_path):
    """4 processes of 2 devices (8 workers); process 2 is killed after checkpoint 10. The
    launcher stops the others and restarts the largest world the 3 survivors can form
    whose workers divide the global batch of 16: 2 processes, 4 workers. The run ends by
    itself with every step once, its rows up to the checkpoint untouched, and as many
    samples seen as an uninterrupted run."""
    run = tmp_path / "run"
    sets = ["task=mlp", "dataset=digits", "model={features: [16]}", "workers=8",
            "global_batch=16", "checkpoint_every=5", "eval_every=0", "progress=false",
            "steps=300", f"out_dir={run}"]  # fmt: skip
    args = ["--processes", "4", "--min-processes", "2", "--max-restarts", "2",
            "--config", "configs/dp_default.yaml"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    proc = _start(args)
    _kill_after_checkpoint(proc, run, process=2, step=10)
    before = _rows(run)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    restart = [x for x in err.splitlines() if "lost (SIGKILL)" in x]
    assert len(restart) == 1, err[-3000:]
    assert "process 2 lost (SIGKILL); restart 1 of at most 2: 2 processes, 4 workers" in restart[0]
    step = int(restart[0].rsplit(" ", 1)[-1])
    assert step >= 10
    assert "resuming a run of 8 workers on 4" in out
    assert "[p2]" not in out.split("resuming a run of 8 workers on 4")[-1]  # 2 processes now
    rows = _rows(run)
    assert [r["step"] for r in rows] == list(range(1, 301))
    assert rows[:step] == before[:step]  # nothing before the checkpoint was lost or redone
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 4 and summary["samples_seen"] == 300 * 16
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]


def test_elastic_options_without_min_processes_are_refused(capsys):
    import pytest

    from train import launch

    for flag in (["--max-restarts", "2"], ["--compile-cache", "/tmp/x"]):
        with pytest.raises(SystemExit) as stop:
            launch.main(["--processes", "2", *flag, "--config", "configs/dp_default.yaml"])
        assert stop.value.code == 2
        assert f"{flag[0]} applies to an elastic run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launch.main(["--processes", "2", "--min-processes", "3"])
    assert "--min-processes must be in [1, --processes=2]" in capsys.readouterr().err
