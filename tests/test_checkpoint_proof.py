"""A checkpoint is resumed only when it proves it is this run's, at the step it claims:
its files are exactly those its checksum file lists (so an empty or malformed list proves
nothing), it stores this folder's run identity and its own step. A checkpoint that fails is
set aside inside the checkpoint folder (a rename, also when that folder is another
filesystem) and the newest one that passes is resumed; one that cannot be verified at all
is resumed only with ``allow_unverified``."""

import json
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest

from tests.test_trainer import _cfg
from train.cli import main
from train.trainer import Trainer

MLP = dict(task="mlp", model={"features": [16]}, dataset="digits", aggregator="ec_quantized")
KW = dict(MLP, steps=6, checkpoint_every=2, keep_checkpoints=5, lr=0.05)


def _params(t):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(t.params))]


def _losses(cfg):
    rows = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(r)["loss"] for r in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of 6 steps (and its losses and parameters)."""
    t = Trainer(_cfg(tmp_path_factory.mktemp("ref"), **KW))
    t.run()
    return _losses(t.cfg), _params(t)


def _four_steps(tmp_path, **kw):
    """A run stopped at step 4 (checkpoints 2 and 4), and its config for 6 steps."""
    Trainer(_cfg(tmp_path, **{**KW, "steps": 4, **kw})).run()
    return _cfg(tmp_path, **{**KW, **kw})


def _flip_a_byte(run_dir, step):
    """Flip one byte of the largest file of checkpoint ``step`` (its array data)."""
    files = [p for p in (run_dir / "checkpoints" / str(step)).rglob("*") if p.is_file()]
    big = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(big.read_bytes())
    data[len(data) // 2] ^= 0xFF
    big.write_bytes(bytes(data))


def _resumes_from(cfg, step, reference, capsys, **run_kw):
    """Resume ``cfg``: it starts from checkpoint ``step`` and ends as the reference does."""
    folder = cfg.run_dir / "checkpoints"
    newest = max(int(p.name) for p in folder.iterdir() if p.name.isdigit())
    t = Trainer(cfg)
    t.run(resume=True, **run_kw)
    err = capsys.readouterr().err
    if step == newest:  # nothing refused (or taken unverified), nothing set aside
        assert "resuming from checkpoint step" not in err and "set aside" not in err, err
    else:  # the newer ones were refused, set aside, and the one resumed named
        assert f"resuming from checkpoint step {step}" in err and "set aside" in err, err
    losses, params = reference
    assert _losses(cfg) == losses
    for a, b in zip(_params(t), params, strict=True):
        np.testing.assert_array_equal(a, b)
    return err


@pytest.mark.parametrize("sums", ["{}", "[]", "null", '{"a": 1}'])
def test_a_checksum_file_that_lists_nothing_proves_nothing(tmp_path, sums, reference, capsys):
    """The newest checkpoint's data damaged and its checksum file emptied (``{}``) or not a
    mapping of sums: it is refused (no traceback), set aside with a note of why, and the run
    resumes from step 2 and ends bit for bit as an uninterrupted run."""
    cfg = _four_steps(tmp_path)
    _flip_a_byte(cfg.run_dir, 4)
    (cfg.run_dir / "checksums" / "4.json").write_text(sums)
    err = _resumes_from(cfg, 2, reference, capsys)
    assert "checkpoint step 4" in err and "not resumed" in err
    aside = cfg.run_dir / "checkpoints" / "damaged"
    assert (aside / "4").is_dir() and "not resumed" in (aside / "4.why").read_text()


def test_a_file_not_in_the_checksum_list_is_refused(tmp_path, reference, capsys):
    cfg = _four_steps(tmp_path)
    (cfg.run_dir / "checkpoints" / "4" / "state" / "stray").write_bytes(b"x")
    err = _resumes_from(cfg, 2, reference, capsys)
    assert "checkpoints/4/state/stray is not among the files" in err


def test_a_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path, reference, capsys):
    """Checkpoint 6 of a run with another lr, copied (with its sums) into this run's folder
    stopped at step 4: refused as another run's, naming the lr; step 4 is resumed."""
    cfg = _four_steps(tmp_path / "mine")
    other = _cfg(tmp_path / "other", **{**KW, "lr": 0.1})
    Trainer(other).run()
    shutil.copytree(other.run_dir / "checkpoints" / "6", cfg.run_dir / "checkpoints" / "6")
    shutil.copy(other.run_dir / "checksums" / "6.json", cfg.run_dir / "checksums" / "6.json")
    err = _resumes_from(cfg, 4, reference, capsys)
    assert "belongs to another run" in err and "lr: checkpoint 0.1 vs config 0.05" in err


def test_a_checkpoint_renamed_to_another_step_is_refused(tmp_path, reference, capsys):
    """Checkpoint 4 renamed to 6 with its sums rewritten for the new names (a consistent
    rename): its files match their sums, but it holds step 4, so it is refused and the
    newest checkpoint that is what it says, step 2, is resumed."""
    cfg = _four_steps(tmp_path)
    ckpt = cfg.run_dir / "checkpoints"
    os.replace(ckpt / "4", ckpt / "6")
    sums = json.loads((cfg.run_dir / "checksums" / "4.json").read_text())
    renamed = {k.replace("checkpoints/4/", "checkpoints/6/"): v for k, v in sums.items()}
    (cfg.run_dir / "checksums" / "6.json").write_text(json.dumps(renamed))
    (cfg.run_dir / "checksums" / "4.json").unlink()
    err = _resumes_from(cfg, 2, reference, capsys)
    assert "its folder is named 6 but it holds step 4" in err


def test_a_checkpoint_without_sums_needs_the_flag(tmp_path, reference, capsys):
    """No checksum file (its writer stopped between the commit and the sums): without the
    flag step 2 is resumed and the message names --allow-unverified; with it, step 4."""
    cfg = _four_steps(tmp_path / "a")
    (cfg.run_dir / "checksums" / "4.json").unlink()
    err = _resumes_from(cfg, 2, reference, capsys)
    assert "--allow-unverified" in err
    cfg = _four_steps(tmp_path / "b")
    (cfg.run_dir / "checksums" / "4.json").unlink()
    err = _resumes_from(cfg, 4, reference, capsys, allow_unverified=True)
    assert "cannot be verified" in err and "resuming from checkpoint step 2" not in err


def test_a_folder_without_run_identity_is_unverifiable(tmp_path, capsys):
    """A run folder whose run.json is gone: no checkpoint proves it is this run's; the CLI
    says so in one line, naming the flag, and moves nothing; with the flag it resumes."""
    cfg = _four_steps(tmp_path)
    (cfg.run_dir / "run.json").unlink()
    args = ["--resume", str(cfg.run_dir), "--set", "steps=6", "--no-progress"]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "--allow-unverified" in err and "Traceback" not in err
    assert sorted(p.name for p in (cfg.run_dir / "checkpoints").iterdir()) == ["2", "4"]
    assert main([*args, "--allow-unverified"]) == 0
    assert json.loads((cfg.run_dir / "summary.json").read_text())["steps"] == 6


def test_damaged_checkpoints_on_another_filesystem_are_set_aside(tmp_path, reference, capsys):
    """``checkpoints/`` on its own filesystem (a tmpfs mount): the damaged newest one is set
    aside inside it (a rename on that filesystem) and step 2 is resumed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    cfg = _cfg(tmp_path, **{**KW, "steps": 4})
    mount = cfg.run_dir / "checkpoints"
    mount.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        assert os.stat(mount).st_dev != os.stat(cfg.run_dir).st_dev
        Trainer(cfg).run()
        _flip_a_byte(cfg.run_dir, 4)
        _resumes_from(_cfg(tmp_path, **KW), 2, reference, capsys)
        assert (mount / "damaged" / "4").is_dir()
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_step_set_aside_twice_keeps_both(tmp_path, reference, capsys):
    """A kill between the commit and the sums, twice at the same step: the second copy is
    set aside beside the first (nothing overwritten, no endless search for a free name)."""
    cfg = _four_steps(tmp_path)
    (cfg.run_dir / "checksums" / "4.json").unlink()
    _resumes_from(cfg, 2, reference, capsys)  # 4 set aside, then saved again (and 6)
    for step in (4, 6):
        (cfg.run_dir / "checksums" / f"{step}.json").unlink()
    more = _cfg(tmp_path, **{**KW, "steps": 8})
    Trainer(more).run(resume=True)
    err = capsys.readouterr().err
    assert "resuming from checkpoint step 2" in err
    aside = cfg.run_dir / "checkpoints" / "damaged"
    assert {p.name for p in aside.iterdir() if p.is_dir()} == {"4", "4.1", "6"}


def test_the_flag_does_not_let_a_foreign_checkpoint_in(tmp_path, reference, capsys):
    """Another run's checkpoint copied in without its sums is still another run's: refused
    with --allow-unverified too."""
    cfg = _four_steps(tmp_path / "mine")
    other = _cfg(tmp_path / "other", **{**KW, "lr": 0.1})
    Trainer(other).run()
    shutil.copytree(other.run_dir / "checkpoints" / "6", cfg.run_dir / "checkpoints" / "6")
    err = _resumes_from(cfg, 4, reference, capsys, allow_unverified=True)
    assert "belongs to another run" in err and "--allow-unverified" not in err


def test_a_folder_resumed_unverified_keeps_its_own_identity(tmp_path, capsys):
    """run.json lost, resumed with the flag: the folder takes the identity its checkpoints
    store, so its older checkpoints stay resumable (a later damaged newest one falls back
    to them, with no flag)."""
    cfg = _four_steps(tmp_path)
    (cfg.run_dir / "run.json").unlink()
    Trainer(cfg).run(resume=True, allow_unverified=True)
    _flip_a_byte(cfg.run_dir, 6)
    Trainer(_cfg(tmp_path, **{**KW, "steps": 8})).run(resume=True)
    assert "resuming from checkpoint step 4" in capsys.readouterr().err
