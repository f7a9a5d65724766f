"""The command line explains itself: --help lists the shipped configs, aggregators, sync
methods and network syntax; --list-keys every config key; enumerated values get "did you
mean"; the launcher says what passes through and drops gloo's connection lines; errors are
one short line; the summary reads as text."""

import io
import queue

import pytest

from tests.test_trainer import ROOT, _cfg
from train import launch as launch_mod
from train.aggregators import AGGREGATORS
from train.cli import list_keys, main, shipped_configs
from train.config import SYNCS, Config, key_docs
from train.summary import format_summary
from train.trainer import Trainer


def test_help_lists_configs_aggregators_sync_methods_and_the_network_syntax(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    shipped = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert shipped and [p.split("/")[-1] for p, _ in shipped_configs()] == shipped
    for name in shipped:
        assert f"configs/{name}" in out
    assert all(what for _, what in shipped_configs())  # every config says what it is
    for name in (*AGGREGATORS.names(), *SYNCS.names()):
        assert name in out
    assert "50ms,100Mbps" in out and "--list-keys" in out and "--set name=" in out


def test_list_keys_explains_every_config_key(capsys):
    assert main(["--list-keys"]) == 0
    out = capsys.readouterr().out
    assert out == list_keys() + "\n"
    lines = out.splitlines()
    for name in Config.model_fields:
        head = next(line for line in lines if line.startswith(f"{name} (default"))
        # The line after a key's head is its meaning (indented), never another key.
        assert lines[lines.index(head) + 1].startswith("    "), name
    meanings = {key: text for key, _, text in key_docs()}
    assert all(meanings.values()), [k for k, t in meanings.items() if not t]
    # Every registered choice's fields are listed under its section, named by the choice.
    assert "aggregator.ratio (ar_topk)" in meanings and "sync.outer_lr (diloco)" in meanings
    assert "boundary.memory (aqsgd)" in meanings and "model.width (gpt)" in meanings
    assert "optimizer.schedule.warmup_steps" in meanings


@pytest.mark.parametrize(
    "key, value, hint",
    [("aggregator", "rnig", "ring"), ("optimizer", "adamm", "adam"),
     ("sync.method", "diloc", "diloco"), ("boundary", "aqsdg", "aqsgd"),
     ("compute", "v10", "v100"), ("aggregator_args.ratoi", "0.1", "ratio"),
     ("stragglers.sede", "1", "seed")],
)  # fmt: skip
def test_a_misspelled_choice_gets_did_you_mean(capsys, key, value, hint):
    args = ["--set", f"{key}={value}"]
    if key == "sync.method":
        args += ["--set", "aggregator=none", "--set", "sync.period=2"]
    if key.startswith("aggregator_args"):
        args = ["--set", "aggregator=ar_topk", *args]
    assert main(args) in (1, 2)  # the config (2) or the trainer it builds (1) refuses it
    err = capsys.readouterr().err
    assert f"did you mean {hint!r}?" in err and err.count("\n") == 1


def test_the_launcher_help_says_what_passes_through(capsys):
    with pytest.raises(SystemExit):
        launch_mod.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "passes through to each process's python -m train" in out
    assert "--config" in out and "--resume" in out


def test_the_launcher_drops_gloos_connection_lines_unless_verbose():
    """Whole gloo lines, pieces of them left by its interleaving threads, and one inside a
    progress bar's redraw all go; other lines (and other gloo lines) stay; redraws (``\r``)
    come through as pieces of their own."""
    text = (
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks"
        " is : 1\nstep 1\n[Gloo] something else\nbar 0%[Gloo] Rank 1 is connected to 1 peer"
        " ranks. Expected number of connected peer ranks is : 1\n[Gloo] Rank [Gloo] Rank 3 is"
        " connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"
        "1 is connected to 7 peer ranks. Expected number of connected peer ranks is : 7\n"
        " 10%|#  | 1/10\r 20%|## | 2/10\r"
    )
    keep = ["step 1\n", "[Gloo] something else\n", "bar 0%\n", " 10%|#  | 1/10\r",
            " 20%|## | 2/10\r"]  # fmt: skip
    pieces = [
        "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks"
        " is : 1\n", "step 1\n", "[Gloo] something else\n",
        "bar 0%[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer"
        " ranks is : 1\n", "[Gloo] Rank [Gloo] Rank 3 is connected to 3 peer ranks. Expected"
        " number of connected peer ranks is : 3\n", "1 is connected to 7 peer ranks. Expected"
        " number of connected peer ranks is : 7\n", " 10%|#  | 1/10\r", " 20%|## | 2/10\r",
    ]  # fmt: skip
    for quiet, want in ((True, keep), (False, pieces)):
        out: queue.Queue = queue.Queue()
        launch_mod._pump(0, io.BytesIO(text.encode()), out, quiet)
        got = []
        while (item := out.get())[1] is not None:
            got.append(item[1])
        assert got == want


def test_the_launcher_relays_a_progress_bar_as_redraws(capsys):
    relay = launch_mod._Relay()
    for piece in (" 10%\r", " 20%\r", "done\n"):
        relay.write(0, piece)
    assert capsys.readouterr().out == "\r[p0]  10%\r[p0]  20%\n[p0] done\n"


def test_resuming_a_changed_model_is_one_short_line(tmp_path):
    """A different model's checkpoint is refused naming the keys that differ, not every
    parameter path."""
    kw = dict(task="gpt", steps=1, checkpoint_every=1)
    Trainer(_cfg(tmp_path, **kw)).run()
    wider = _cfg(tmp_path, **{**kw, "model": {**_cfg(tmp_path).model.to_dict(), "width": 64}})
    with pytest.raises(ValueError) as refused:
        Trainer(wider).run(resume=True)
    message = str(refused.value)
    assert "model.width: checkpoint 32 vs config 64" in message
    assert "parameter shapes differ" in message and len(message) < 300 and "\n" not in message


def test_the_summary_reads_as_text():
    text = format_summary(
        {
            "name": "dp_default", "steps": 300, "resumed": False, "final_loss": 2.5591,
            "valid_loss": 2.58, "params": 867328, "sent_bytes_mean": 202376.0,
            "sent_bytes_peak": 6071296, "sent_bytes_total": 12142592,
            "dense_ring_bytes_per_step": 6071296, "sent_vs_dense_ring": 0.03333,
            "sim_time_s": 18.95, "network": "1ms,1Gbps", "compute": "v100", "wall_s": 104.2,
            "sim_compute_s_per_step": 0.00059, "comm_s_per_step": 0.0626,
            "schedule": "every 30 steps",
        }
    )  # fmt: skip
    assert "== dp_default: 300 steps ==" in text
    assert "2.559 training, 2.58 validation" in text
    assert "867,328" in text
    assert "202,376 B (202.38 kB) mean, 6,071,296 B (6.07 MB) peak" in text
    assert "12,142,592 B (12.14 MB), the busiest worker of each step summed" in text
    assert "0.03333x the bytes of a dense float32 ring" in text
    assert "0.59 ms compute + 62.60 ms communication a step" in text
    assert "schedule" in text and "every 30 steps" in text


def test_a_run_writes_its_summary_as_text_beside_the_json(tmp_path):
    run = _cfg(tmp_path, task="mlp", model={"features": [8]}, dataset="digits", steps=2)
    summary = Trainer(run).run()
    assert (run.run_dir / "summary.txt").read_text() == format_summary(summary) + "\n"
    assert summary["sim_compute_s_per_step"] > 0 and summary["comm_s_per_step"] > 0


def test_the_long_silences_are_announced(tmp_path, capsys):
    """With progress on, the compilation before the first step and the final evaluation
    after the last each say what is happening, in that order around the progress bar."""
    run = _cfg(tmp_path, task="mlp", model={"features": [8]}, dataset="digits", steps=2)
    Trainer(run.replace(progress=True)).run()
    err = capsys.readouterr().err
    compiling = err.index("compiling the training step")
    evaluating = err.index("final evaluation and summary")
    assert compiling < err.index("2/2") < evaluating


def test_the_license_file_is_the_one_the_package_declares():
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["license"]
    text = (ROOT / "LICENSE").read_text()
    assert declared == {"text": "Apache-2.0"}
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_a_shipped_config_is_found_from_any_folder(tmp_path, monkeypatch):
    from train.cli import resolve_config

    monkeypatch.chdir(tmp_path)
    found = resolve_config("configs/dp_default.yaml")
    assert found == str(ROOT / "configs" / "dp_default.yaml")
    assert resolve_config("configs/nope.yaml") == "configs/nope.yaml"  # its error names it
    (tmp_path / "mine.yaml").write_text("steps: 3\n")
    assert resolve_config("mine.yaml") == "mine.yaml"  # a file of the user's comes first


def test_terminal_help_is_plain_text_and_hints_come_first(capsys):
    """No docstring markup in --help or --list-keys; a misspelled config file or sync method
    (with or without a period) gets its hint; an unknown key's hint comes before the list."""
    assert main(["--list-keys"]) == 0
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and ":class:" not in out
    assert main(["--config", "configs/dp_defalt.yaml"]) == 2
    assert "did you mean 'dp_default.yaml'" in capsys.readouterr().err
    assert main(["--set", "sync.method=local_sdg"]) == 2
    assert "did you mean 'local_sgd'" in capsys.readouterr().err
    assert main(["--set", "lrr=1"]) == 2
    err = capsys.readouterr().err
    assert err.index("did you mean 'optimizer.lr'") < err.index("allowed keys")
