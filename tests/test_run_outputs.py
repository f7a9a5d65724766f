"""What a finished run leaves and says: the summary's bytes are the log's (mean, peak,
total, against a dense float32 ring), a run is complete only when every output is written
(a kill -9 between them is mended by ``--resume``), a run folder is resumed from its own
saved config, names stay inside ``runs/``, bad input is one line, and a run without a
progress bar still reports progress."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import child_env

from tests.test_trainer import ROOT, _cfg
from train.cli import main
from train.trainer import OUTPUTS, PlainProgress, Trainer

MLP = dict(task="mlp", model={"features": [16]}, dataset="digits")


def _sent(run_dir):
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["sent_bytes"] for r in rows]


@pytest.mark.parametrize(
    "kw",
    [
        dict(aggregator="ring"),
        dict(
            aggregator="marsit",
            optimizer="none",
            aggregator_args={"local_lr": 0.1, "global_lr": 0.002, "full_sync_every": 4},
        ),
    ],
    ids=["dense", "marsit"],
)
def test_the_summary_bytes_are_the_logs(tmp_path, kw):
    """Marsit sends a full-precision round every 4 steps and one-bit rounds between: the
    summary's mean, peak and total are those of every logged step (the last step's bytes
    are not the mean), in summary.json, summary.txt and what the CLI prints."""
    cfg = _cfg(tmp_path, **MLP, **kw, steps=10, checkpoint_every=5)
    summary = Trainer(cfg).run()
    sent = _sent(cfg.run_dir)
    stored = json.loads((cfg.run_dir / "summary.json").read_text())
    for s in (summary, stored):
        assert s["sent_bytes_total"] == sum(sent)
        assert s["sent_bytes_peak"] == max(sent)
        assert s["sent_bytes_mean"] == pytest.approx(np.mean(sent), rel=1e-12)
        dense = s["dense_ring_bytes_per_step"]
        assert s["sent_vs_dense_ring"] == pytest.approx(np.mean(sent) / dense, rel=1e-12)
    text = (cfg.run_dir / "summary.txt").read_text()
    assert f"{sum(sent):,} B" in text and f"{max(sent):,} B" in text
    if kw["aggregator"] == "marsit":
        assert len(set(sent)) == 2 and sent[-1] < np.mean(sent) < max(sent)
        # The ratio's denominator is what a dense ring run of the same model sends (its
        # logged bytes, read from its compiled program), up to the ring's segment padding.
        ring = _cfg(tmp_path / "ring", **MLP, aggregator="ring", steps=2, checkpoint_every=0)
        Trainer(ring).run()
        measured = _sent(ring.run_dir)[0]
        assert summary["dense_ring_bytes_per_step"] == pytest.approx(measured, rel=1e-2)
        assert summary["sent_vs_dense_ring"] == pytest.approx(sum(sent) / (10 * measured), rel=1e-2)
        assert summary["sent_vs_dense_ring"] < 0.5
    else:  # the dense ring of this model, every step
        assert min(sent) >= summary["dense_ring_bytes_per_step"]
        assert summary["sent_vs_dense_ring"] == pytest.approx(1.0, rel=1e-2)  # ring padding


_KILL = """
import os, sys
sys.argv = ["train"] + sys.argv[1:]
import train.plot, train.trainer
target = os.environ["KILL_AT"]
def kill(*a, **k):
    os.kill(os.getpid(), 9)
if target == "params.msgpack":
    train.trainer.save_model_params = kill
elif target == "loss.png":
    train.plot.plot_metrics = kill
else:
    write = train.trainer.write_atomically
    def maybe(path, text):
        if path.name == target:
            kill()
        write(path, text)
    train.trainer.write_atomically = maybe
from train.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("at", ["params.msgpack", "loss.png", "summary.txt", "summary.json"])
def test_a_kill_between_the_outputs_is_mended_by_resume(tmp_path, at):
    """kill -9 as each output is about to be written: the folder does not claim a finished
    run, and ``--resume DIR`` (nothing else) writes every output, the model equal to an
    uninterrupted run's."""
    sets = ["task=mlp", "dataset=digits", "model.features=[16]", "steps=4", "checkpoint_every=2"]
    args = [a for s in sets for a in ("--set", s)] + ["--no-progress"]
    run = tmp_path / "run"
    env = {**child_env(), "KILL_AT": at}
    proc = subprocess.run(
        [sys.executable, "-c", _KILL, *args, "--set", f"out_dir={run}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not all((run / n).is_file() for n in OUTPUTS)
    assert not (run / "summary.json").exists()  # written last: the run is not complete
    assert main(["--resume", str(run), "--no-progress"]) == 0
    assert all((run / n).is_file() for n in OUTPUTS)
    ref = tmp_path / "ref"
    assert main([*args, "--set", f"out_dir={ref}"]) == 0
    assert (run / "params.msgpack").read_bytes() == (ref / "params.msgpack").read_bytes()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_loss"] is not None


def test_resume_reads_the_run_folders_own_config(tmp_path, capsys, monkeypatch):
    """A run started with a config and overrides continues from its folder alone
    (``--resume DIR``, or ``--resume --set name=``), with its own settings; ``--set`` on top
    still applies (more steps)."""
    monkeypatch.chdir(tmp_path)
    start = ["--config", "configs/marsit_default.yaml", "--set", "steps=4", "--set",
             "checkpoint_every=2", "--set", "model.features=[16]", "--set", "name=mine",
             "--no-progress"]  # fmt: skip
    assert main(start) == 0
    assert main(["--resume", "runs/mine", "--set", "steps=6", "--no-progress"]) == 0
    assert main(["--resume", "--set", "name=mine", "--set", "steps=8", "--no-progress"]) == 0
    rows = (tmp_path / "runs" / "mine" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == list(range(1, 9))
    saved = json.loads((tmp_path / "runs" / "mine" / "config.json").read_text())
    assert saved["aggregator"]["name"] == "marsit" and saved["model"]["features"] == [16]
    # A second run with other settings into the same folder is told the command that works.
    capsys.readouterr()
    other = ["--set", "name=mine", "--set", "task=mlp", "--set", "dataset=digits"]
    assert main([*other, "--no-progress"]) == 1
    assert "python -m train --resume runs/mine" in capsys.readouterr().err


def test_python_m_train_alone_does_not_write_into_the_main_jobs_folder():
    from train.cli import resolve_config
    from train.config import Config, load_config

    main_job = load_config(resolve_config("configs/dp_default.yaml"))
    assert Config().run_dir != main_job.run_dir


@pytest.mark.parametrize("name", ["../../etc", "a/b", "..", ".", "", "x\\y"])
def test_a_name_is_one_folder_name(tmp_path, name, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--set", f"name={name}", "--set", "steps=1"]) == 2
    err = capsys.readouterr().err
    assert "name must be one folder name" in err and "out_dir" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--set", "seed=99999999999999999999"],
            "seed: input should be less than or equal to 4294967295",
        ),
        (["--set", "workers=4096", "--set", "global_batch=4096"], "simulates at most 1024"),
        (["--set", "name=\udcff\udcfe"], "is not valid UTF-8"),
        (["--config", "BOMB"], "values (each YAML alias counted at its full size)"),
        (["--config", "SELF"], "refers to itself"),
    ],
)
def test_bad_input_is_one_line(tmp_path, args, says, capsys):
    bomb = "a: &a [" + ",".join(["x"] * 10) + "]\n"
    for i, key in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        bomb += f"{key}: &{key} [" + ",".join([f"*{prev}"] * 10) + "]\n"
    (tmp_path / "bomb.yaml").write_text(bomb)
    (tmp_path / "self.yaml").write_text("a: &a [*a]\n")
    paths = {"BOMB": str(tmp_path / "bomb.yaml"), "SELF": str(tmp_path / "self.yaml")}
    assert main([paths.get(a, a) for a in args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err


def test_a_read_only_run_folder_is_one_line(tmp_path, capsys):
    if os.geteuid() == 0:  # root writes anywhere: make the folder a read-only mount instead
        run = tmp_path / "ro"
        run.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(run)], capture_output=True
        )
        if done.returncode:
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        run = tmp_path / "ro"
        run.mkdir(mode=0o555)
    try:
        args = ["--set", "task=mlp", "--set", "dataset=digits", "--set", "steps=1"]
        assert main([*args, "--set", f"out_dir={run}", "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(run)], check=True)


def test_resume_while_a_run_is_starting_says_it_is_in_progress(tmp_path, capsys):
    from train.checkpoint import run_lock

    run = tmp_path / "run"
    run.mkdir()
    with run_lock(run):
        assert main(["--resume", str(run), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "a run is in progress there" in err and str(os.getpid()) in err


def test_without_a_bar_progress_is_a_plain_line(tmp_path, capsys):
    """``--no-progress``: the compile and final-evaluation lines still show, and a plain
    line reports the step (every 30 s, and at the end)."""
    cfg = _cfg(tmp_path, **MLP, steps=3)
    Trainer(cfg).run()
    err = capsys.readouterr().err
    assert err.index("compiling the training step") < err.index("step 3/3")
    assert err.index("step 3/3") < err.index("final evaluation and summary")
    bar = PlainProgress("x", total=5, start=1, every_s=0.0)
    for _ in range(4):
        bar.set_postfix(loss="1.0")
        bar.update(1)
    assert capsys.readouterr().err.splitlines()[0].startswith("x: step 2/5, loss 1.0")
    quiet = PlainProgress("x", total=5, start=0, every_s=1e9)
    for _ in range(5):
        quiet.update(1)
    assert capsys.readouterr().err.splitlines() == [line for line in ["x: step 5/5 (0 s)"]]


def test_a_finished_run_missing_an_output_gets_it_on_resume(tmp_path, capsys):
    cfg = _cfg(tmp_path, **MLP, steps=2)
    Trainer(cfg).run()
    model = (cfg.run_dir / "params.msgpack").read_bytes()
    for name in ("params.msgpack", "loss.png"):
        (cfg.run_dir / name).unlink()
    Trainer(cfg).run(resume=True)
    assert "params.msgpack, loss.png are missing" in capsys.readouterr().out
    assert (cfg.run_dir / "params.msgpack").read_bytes() == model
    assert (cfg.run_dir / "loss.png").is_file()


def test_resume_by_name_resumes_that_folder_even_when_copied(tmp_path, monkeypatch):
    """A run resumed by its folder records that folder; a copy of it resumed by name
    writes into the copy, not into the folder its config.json names."""
    monkeypatch.chdir(tmp_path)
    sets = ["task=mlp", "dataset=digits", "model.features=[8]", "steps=2", "name=a"]
    assert main([a for s in sets for a in ("--set", s)] + ["--no-progress"]) == 0
    assert main(["--resume", "runs/a", "--set", "steps=3", "--no-progress"]) == 0
    import shutil

    shutil.copytree("runs/a", "runs/b")
    before = (tmp_path / "runs" / "a" / "metrics.jsonl").read_text()
    assert main(["--resume", "--set", "name=b", "--set", "steps=4", "--no-progress"]) == 0
    assert (tmp_path / "runs" / "a" / "metrics.jsonl").read_text() == before
    rows = (tmp_path / "runs" / "b" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4


def test_the_dense_ring_follows_each_steps_workers(tmp_path):
    """Resumed from 8 workers on 4: the ratio to a dense ring counts each step's own ring."""
    cfg = _cfg(tmp_path, **MLP, aggregator="ring", steps=2, checkpoint_every=2)
    Trainer(cfg).run()
    more = _cfg(tmp_path, **MLP, aggregator="ring", steps=4, workers=4, checkpoint_every=2)
    s = Trainer(more).run(resume=True)
    rows = [json.loads(r) for r in (more.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["workers"] for r in rows] == [8, 8, 4, 4]
    dense = [2 * (n - 1) * 4 * s["params"] // n for n in (8, 8, 4, 4)]
    assert s["sent_vs_dense_ring"] == pytest.approx(sum(_sent(more.run_dir)) / sum(dense))
    assert s["dense_ring_bytes_per_step"] == pytest.approx(np.mean(dense))


@pytest.mark.parametrize("folder", ["odd #2", "2024", "true", "a: b", "null"])
def test_resume_takes_the_folder_as_written(tmp_path, folder):
    """``--resume DIR`` (the CLI's and the launcher's, which rewrites it for its restarts)
    names that folder whatever YAML would make of its text: no comment, number, boolean or
    mapping, and never another folder."""
    from train.cli import config_from_args, parser
    from train.config import Config
    from train.launch import _resume_folder_as_out_dir

    run = tmp_path / folder
    run.mkdir()
    (run / "config.json").write_text(json.dumps(Config(name="x", steps=3).to_dict()))
    args = parser().parse_args(["--resume", str(run), "--set", "steps=5"])
    cfg = config_from_args(args)
    assert cfg.run_dir == run and cfg.steps == 5
    rewritten = _resume_folder_as_out_dir(["--resume", str(run), "--set", "steps=5"], str(run))
    assert config_from_args(parser().parse_args(rewritten)).run_dir == run
