"""The data-parallel trainer: loss goes down, metrics and plot, bit-exact resume, bad input."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.checkpoint import Checkpoints, has_rows
from train.cli import main
from train.config import Config, load_config
from train.trainer import Trainer

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = {"num_layers": 1, "width": 32, "num_heads": 2, "seq_len": 32}


def _cfg(tmp_path, **kw):
    base = dict(
        name="t",
        task="gpt",
        model=SMALL,
        workers=8,
        global_batch=16,
        steps=6,
        lr=3e-3,
        aggregator="ring",
        checkpoint_every=3,
        progress=False,
        out_dir=str(tmp_path / "run"),
    )
    base.update(kw)
    return Config(**base)


def test_mlp_loss_goes_down_and_files_written(tmp_path):
    cfg = _cfg(
        tmp_path,
        task="mlp",
        model={"features": [32]},
        dataset="digits",
        steps=40,
        lr=0.01,
        aggregator="psum",
        checkpoint_every=0,
        network="2ms,100Mbps",
    )
    summary = Trainer(cfg).run()
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 40
    assert np.mean([r["loss"] for r in rows[-5:]]) < 0.6 * np.mean([r["loss"] for r in rows[:5]])
    assert summary["valid_accuracy"] > 0.5
    assert (cfg.run_dir / "loss.png").stat().st_size > 1000
    # Modelled time of a ring all-reduce of the fused fp32 gradient over 2 ms / 100 Mbps:
    # 14 rounds, each carrying one ceil(d / 8)-element float32 segment. The metrics and the
    # finite flags are averaged on the host, so nothing else crosses the wire.
    d = summary["params"]
    sent = 2 * 7 * (-(-d // 8)) * 4
    expect = 2 * 7 * 2e-3 + sent * 8 / 100e6
    assert rows[0]["comm_s"] == pytest.approx(expect, rel=1e-6)
    assert rows[0]["sent_bytes"] == sent
    from jaxcomm.network import Network
    from train.trainer import wire_time

    assert wire_time(rows[0]["wire"], Network(2e-3, 100e6)) == pytest.approx(expect, rel=1e-9)
    t = 0.0
    for r in rows:
        t += r["compute_s"] + r["comm_s"]
        assert r["sim_time_s"] == pytest.approx(t, rel=1e-9)


MARSIT = dict(
    task="mlp",
    model={"features": [16]},
    dataset="digits",
    optimizer="none",
    aggregator="marsit",
    aggregator_args={"local_lr": 0.1, "global_lr": 0.01, "full_sync_every": 4},
)


VAR_TOPK = dict(
    aggregator="ar_topk", aggregator_args={"ratio": 0.01, "select": "var"}, optimizer="sgd"
)


@pytest.mark.parametrize(
    "extra", [{}, MARSIT, VAR_TOPK], ids=["gpt-ring-adam", "mlp-marsit", "gpt-var-topk"]
)
def test_resume_is_bit_exact(tmp_path, extra):
    full = Trainer(_cfg(tmp_path / "a", **extra))
    full.run()
    first = Trainer(_cfg(tmp_path / "b", steps=3, **extra))
    first.run()
    resumed = Trainer(_cfg(tmp_path / "b", steps=6, **extra))
    summary = resumed.run(resume=True)
    assert summary["resumed"] and resumed.step == 6
    for a, b in zip(
        jax.tree_util.tree_leaves(full.worker_params()),
        jax.tree_util.tree_leaves(resumed.worker_params()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    opt_a = jax.tree_util.tree_leaves(jax.device_get(full.opt_state))
    opt_b = jax.tree_util.tree_leaves(jax.device_get(resumed.opt_state))
    for a, b in zip(opt_a, opt_b, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.loader.position == full.loader.position
    lines = (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("workers", [1, 4])
def test_a_checkpoint_of_the_earlier_layout_resumes_bit_exactly(tmp_path, workers):
    """Earlier versions held every array one row per worker and saved the equal rows of
    several workers once (``rows.once``), every row of one worker: such a checkpoint (the
    held-once state written back in that layout) resumes to what the uninterrupted run
    reaches."""
    kw = dict(task="mlp", model={"features": [16]}, dataset="digits", workers=workers)
    full = Trainer(_cfg(tmp_path / "a", **kw))
    full.run()
    first = Trainer(_cfg(tmp_path / "b", steps=3, checkpoint_every=0, **kw))
    stacked = first.layout.state_tree

    def earlier(ctx):  # what the earlier layout held: a row per worker of everything
        mesh = first.layout.mesh
        rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        lead = lambda a: (
            a
            if has_rows(a)
            else jax.device_put(  # noqa: E731
                jnp.broadcast_to(a, (workers, *a.shape)), rows
            )
        )
        return jax.tree.map(lead, stacked(ctx))

    first.layout.state_tree = earlier
    first.run()
    old, new = jax.tree.leaves(earlier(first.ctx)), jax.tree.leaves(stacked(first.ctx))
    assert any(np.ndim(a) == np.ndim(b) + 1 for a, b in zip(old, new, strict=True))
    resumed = Trainer(_cfg(tmp_path / "b", steps=6, **kw))
    resumed.run(resume=True)
    for a, b in zip(
        jax.tree.leaves(jax.device_get((full.params, full.opt_state))),
        jax.tree.leaves(jax.device_get((resumed.params, resumed.opt_state))),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_star_topk_in_the_trainer_logs_roots_gain_and_audited_bytes(tmp_path):
    """``aggregator: ar_topk`` trains; each row has the round-robin root and the gain; the
    logged bytes equal the compiled step's collectives for that root."""
    from jaxcomm._src.sparse import ROOT_SCOPE

    cfg = _cfg(
        tmp_path,
        steps=10,
        aggregator="ar_topk",
        aggregator_args={"ratio": 0.05},
        checkpoint_every=0,
    )
    trainer = Trainer(cfg)
    trainer.run()
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["root"] for r in rows] == [t % 8 for t in range(10)]
    assert all(0.05 < r["gain"] < 1.0 for r in rows)
    assert np.mean([r["loss"] for r in rows[-3:]]) < np.mean([r["loss"] for r in rows[:3]])
    audit = trainer.step_audit(branches={ROOT_SCOPE: rows[-1]["root"]})
    np.testing.assert_array_equal(audit.sent, trainer.last_traffic.sent)
    assert rows[-1]["sent_bytes"] == int(audit.sent.max())
    assert rows[-1]["wire"][0][0] == "art_ring"


def test_refuses_to_overwrite_or_mix_checkpoints(tmp_path):
    Trainer(_cfg(tmp_path, steps=3)).run()
    with pytest.raises(ValueError, match="already holds a run's checkpoints"):
        Trainer(_cfg(tmp_path, steps=3)).run()
    other = _cfg(tmp_path, steps=6, model={**SMALL, "width": 64})
    with pytest.raises(ValueError, match="holds a different run.*model"):
        Trainer(other).run(resume=True)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'stesp'.*did you mean 'steps'"):
        load_config(None, ["stesp=3"])
    with pytest.raises(ValueError, match="global_batch must be a multiple of workers=8, got 12"):
        load_config(None, ["global_batch=12"])
    with pytest.raises(ValueError, match=r"aggregator must be one of .* got 'bogus'"):
        load_config(None, ["aggregator=bogus"])
    with pytest.raises(ValueError, match="aggregator.local_lr is required"):
        load_config(None, ["aggregator=marsit"])
    marsit = "aggregator={name: marsit, local_lr: 0.1, global_lr: 0.01, full_sync_every: 5}"
    with pytest.raises(ValueError, match="need optimizer none"):
        load_config(None, [marsit])
    with pytest.raises(ValueError, match="steps: input should be a valid integer, got 'ten'"):
        load_config(None, ["steps=ten"])
    with pytest.raises(ValueError, match="latency|bandwidth|network"):
        load_config(None, ["network=fast"])
    cfg = load_config(ROOT / "configs/dp_default.yaml", ["model.width=64", "steps=7"])
    assert cfg.model.width == 64 and cfg.model.num_layers == 4 and cfg.steps == 7


def test_every_shipped_config_parses():
    files = sorted((ROOT / "configs").glob("*.yaml"))
    assert files
    for f in files:
        load_config(f)


def test_cli_runs_and_reports(tmp_path, capsys):
    rc = main(
        [
            "--config",
            str(ROOT / "configs/dp_default.yaml"),
            "--no-progress",
            "--set",
            "steps=2",
            "--set",
            f"out_dir={tmp_path / 'cli'}",
            "--set",
            "model.num_layers=1",
            "--set",
            "model.width=32",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "steps ==" in out and "sent a step" in out and "simulated time" in out
    assert main(["--set", "nope=1"]) == 2


def test_nonfinite_step_stops_with_error_and_keeps_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, optimizer="sgd", lr=1e30, steps=20, checkpoint_every=1)
    with pytest.raises(FloatingPointError, match="non-finite") as stop:
        Trainer(cfg).run()
    # The message names the checkpoint to continue from, and it is on disk.
    saved = int(str(stop.value).split("newest checkpoint, step ")[1].split(" ")[0])
    assert (cfg.run_dir / "checkpoints" / str(saved)).is_dir() and "--resume" in str(stop.value)
    # Every checkpoint on disk holds finite parameters.
    resumed = Trainer(_cfg(tmp_path, optimizer="sgd", lr=1e30, steps=20, checkpoint_every=1))
    assert resumed.restore(Checkpoints(cfg.run_dir, cfg.keep_checkpoints))
    for leaf in jax.tree_util.tree_leaves(resumed.worker_params()):
        assert np.all(np.isfinite(leaf))


def _busy(seconds):
    end = __import__("time").perf_counter() + seconds
    while __import__("time").perf_counter() < end:
        pass


def test_named_device_makes_simulated_time_independent_of_the_host(tmp_path):
    """``compute=v100``: the step time is the roofline of the compiled step, so a second run
    with the host kept busy reports the same simulated time, step for step."""
    import multiprocessing

    import jaxcomm

    rows = []
    for i, busy in enumerate((False, True)):
        cfg = _cfg(tmp_path / str(i), compute="v100", steps=3, checkpoint_every=0)
        procs = []
        if busy:
            ctx = multiprocessing.get_context("spawn")
            procs = [ctx.Process(target=_busy, args=(60,)) for _ in range(2)]
            for p in procs:
                p.start()
        try:
            trainer = Trainer(cfg)
            trainer.run()
        finally:
            for p in procs:
                p.terminate()
        lines = (cfg.run_dir / "metrics.jsonl").read_text().splitlines()
        rows.append([json.loads(x) for x in lines])
    assert [r["sim_time_s"] for r in rows[0]] == [r["sim_time_s"] for r in rows[1]]
    cost = jaxcomm.audit.program_cost(trainer.layout.compiled_step(trainer.ctx)).per_device()
    want = float(jaxcomm.compute.roofline("v100").seconds(cost).max())
    assert [r["sim_compute_s"] for r in rows[1]] == [want] * 3
    assert rows[1][0]["compute_s"] != want  # the host's own time is still recorded


def test_compute_config_errors():
    with pytest.raises(ValueError, match="unknown device 'k80'; known devices: v100, a100"):
        Config(compute="k80")
    with pytest.raises(ValueError, match="dtype 'bf16' has no peak on v100"):
        Config(compute="v100:bf16")
    with pytest.raises(ValueError, match="mfu: input should be less than or equal to 1, got 2.0"):
        Config(compute="a100", mfu=2.0)
    with pytest.raises(ValueError, match="mfu=0.4 needs compute=<device>"):
        Config(mfu=0.4)
    with pytest.raises(ValueError, match="mfu: input should be greater than 0, got 0"):
        Config(compute="v100", mfu=0)
    with pytest.raises(ValueError, match="the models compute in float32.*not 'bf16'"):
        Config(compute="a100:bf16")


def test_stragglers_slow_the_simulated_step_as_configured(tmp_path):
    """With ``compute=v100``, worker 3 at twice the time makes every step's compute twice
    the roofline's (the collectives wait for it); the clock adds exactly that."""
    plain = Trainer(_cfg(tmp_path / "a", compute="v100", steps=2, checkpoint_every=0))
    plain.run()
    slow = _cfg(
        tmp_path / "b", compute="v100", steps=2, checkpoint_every=0, stragglers={"slow": {3: 2.0}}
    )
    Trainer(slow).run()
    a = [json.loads(x) for x in (plain.cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (slow.run_dir / "metrics.jsonl").read_text().splitlines()]
    for ra, rb in zip(a, b, strict=True):
        assert rb["sim_compute_s"] == pytest.approx(2 * ra["sim_compute_s"])
        assert rb["comm_s"] == pytest.approx(ra["comm_s"])
    assert b[-1]["sim_time_s"] == pytest.approx(a[-1]["sim_time_s"] + a[0]["sim_compute_s"] * 2)
    with pytest.raises(ValueError, match=r"stragglers.slow: workers \[8\] do not exist among 8"):
        _cfg(tmp_path, stragglers={"slow": {8: 2.0}})
    with pytest.raises(ValueError, match=r"stragglers: unknown keys \['sigma'\]"):
        _cfg(tmp_path, stragglers={"sigma": 0.1})


def test_a_step_with_unlogged_traffic_is_refused_before_it_runs(tmp_path, monkeypatch):
    """A collective that no jaxcomm log accounts for (here a ``pmean`` after the optimizer)
    stops the trainer at its first compiled step, naming the collective."""
    import optax

    import jaxcomm
    import train.sync

    def update(u, s, p=None):
        return jax.tree.map(lambda g: jax.lax.pmean(jaxcomm.varying(g, "data"), "data"), u), s

    leak = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
    every_step = train.sync.EveryStep.make_tx
    monkeypatch.setattr(
        train.sync.EveryStep, "make_tx", lambda self, ctx: optax.chain(every_step(self, ctx), leak)
    )
    cfg = _cfg(tmp_path, task="mlp", model={"features": [8]}, dataset="digits", steps=2)
    with pytest.raises(jaxcomm.UnloggedTrafficError, match=r"all-reduce of \(f32\[8\], .*psum"):
        Trainer(cfg).run()
    assert (
        not (cfg.run_dir / "metrics.jsonl").exists()
        or not (cfg.run_dir / "metrics.jsonl").read_text()
    )


def test_a_second_run_into_a_live_run_folder_is_refused(tmp_path):
    """While a run holds its folder's lock, another run into the same folder stops with a
    clear error and writes nothing there."""
    import fcntl

    cfg = _cfg(tmp_path, task="mlp", model={"features": [8]}, dataset="digits", steps=2)
    cfg.run_dir.mkdir(parents=True)
    with open(cfg.run_dir / ".lock", "a+") as held:  # the first run's lock, held
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242 on elsewhere")
        held.flush()
        with pytest.raises(RuntimeError, match=r"another run is writing to .*4242 on elsewhere"):
            Trainer(cfg).run()
        assert not (cfg.run_dir / "metrics.jsonl").exists()
    Trainer(cfg).run()  # released: the folder is free again
    assert (cfg.run_dir / "metrics.jsonl").read_text().count("\n") == 2


def _largest_file(root):
    return max((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["overwrite", "truncate", "empty_metadata"])
def test_a_damaged_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, capsys, damage):
    """Eight bytes overwritten in a data file, a truncated data file or an emptied metadata
    file of the newest checkpoint: the resume says which checkpoint is damaged, continues
    from the one before, and ends bit-identical to an uninterrupted run."""
    kw = dict(task="mlp", model={"features": [16]}, dataset="digits", lr=0.05)
    full = Trainer(_cfg(tmp_path / "a", steps=6, checkpoint_every=2, **kw))
    full.run()
    part = Trainer(_cfg(tmp_path / "b", steps=4, checkpoint_every=2, **kw))
    part.run()
    ckpt = tmp_path / "b" / "run" / "checkpoints" / "4"
    if damage == "empty_metadata":
        target = ckpt / "meta" / "metadata"
        target.write_text("")
    else:
        target = _largest_file(ckpt / "state")
        data = bytearray(target.read_bytes())
        if damage == "overwrite":
            data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
        else:
            data = data[: len(data) // 2]
        target.write_bytes(bytes(data))
    resumed = Trainer(_cfg(tmp_path / "b", steps=6, checkpoint_every=2, **kw))
    summary = resumed.run(resume=True)
    err = capsys.readouterr().err
    assert "checkpoint step 4" in err and "is not resumed" in err and "trying the next older" in err
    assert "differs from what was written" in err or "is missing" in err
    assert summary["resumed"]
    for a, b in zip(
        jax.tree_util.tree_leaves(full.worker_params()),
        jax.tree_util.tree_leaves(resumed.worker_params()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_no_intact_checkpoint_is_refused_naming_each(tmp_path):
    kw = dict(task="mlp", model={"features": [8]}, dataset="digits")
    Trainer(_cfg(tmp_path, steps=4, checkpoint_every=2, **kw)).run()
    for step in (2, 4):
        (tmp_path / "run" / "checkpoints" / str(step) / "meta" / "metadata").write_text("{}")
    with pytest.raises(ValueError, match=r"no checkpoint .* can be resumed .*step 4 .*step 2 "):
        Trainer(_cfg(tmp_path, steps=6, checkpoint_every=2, **kw)).run(resume=True)


def test_step_sizes_may_change_on_resume_and_nothing_else(tmp_path, capsys):
    """Marsit's (and the sign family's) step sizes are aggregator arguments: a resume with a
    smaller one continues, saying so; another setting that differs is still refused."""
    Trainer(_cfg(tmp_path, steps=2, **MARSIT)).run()
    smaller = {**MARSIT, "aggregator_args": {**MARSIT["aggregator_args"], "global_lr": 0.005}}
    resumed = Trainer(_cfg(tmp_path, steps=4, **smaller))
    assert resumed.run(resume=True)["resumed"] and resumed.step == 4
    assert "aggregator_args.global_lr changed: 0.01 -> 0.005" in capsys.readouterr().out
    resumed = Trainer(_cfg(tmp_path, steps=5, lr=1e-3, **{**smaller, "optimizer": "none"}))
    resumed.run(resume=True)
    assert "resuming with lr changed" in capsys.readouterr().out
    other = {**MARSIT, "aggregator_args": {**MARSIT["aggregator_args"], "full_sync_every": 2}}
    with pytest.raises(
        ValueError, match="aggregator_args.full_sync_every: checkpoint 4 vs config 2"
    ):
        Trainer(_cfg(tmp_path, steps=6, **other)).run(resume=True)


def test_config_reads_numbers_as_written_and_names_bad_files(tmp_path):
    """1e-3 and 1e30 (strings to YAML 1.1) are numbers; mfu can be set; an empty, binary or
    malformed config file, an out_dir that is a file and a misspelled model key each get an
    error naming the file or the key."""
    cfg = load_config(None, ["lr=1e-3", "compute=v100", "mfu=0.4", "memory_efficiency=1e0"])
    assert cfg.lr == 1e-3 and cfg.mfu == 0.4 and cfg.memory_efficiency == 1.0
    assert load_config(None, ["lr=1e30"]).lr == 1e30
    assert load_config(None, ["mfu=null"]).mfu is None
    (tmp_path / "f.yaml").write_text("lr: 1e-4\ncompute: v100\nmfu: 5e-1\n")
    assert load_config(tmp_path / "f.yaml").lr == 1e-4
    with pytest.raises(ValueError, match="optimizer.lr: input should be a valid number"):
        load_config(None, ["lr=fast"])
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(ValueError, match="empty.yaml' is empty"):
        load_config(tmp_path / "empty.yaml")
    (tmp_path / "bad.yaml").write_text("steps: 3\nmodel: {width: 4\n")
    with pytest.raises(ValueError, match=r"bad.yaml' is not valid YAML at line \d+"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "bin.yaml").write_bytes(bytes(range(256)))
    with pytest.raises(ValueError, match="bin.yaml' is not text"):
        load_config(tmp_path / "bin.yaml")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_config(None, [f"out_dir={tmp_path / 'file'}"])
    with pytest.raises(ValueError, match="cannot be a folder.*is a file"):
        load_config(None, [f"out_dir={tmp_path / 'file' / 'sub'}"])
    # Numbers inside mappings too: an aggregator's step size, adaptive candidates.
    nested = load_config(
        None,
        ["aggregator=ar_topk", "aggregator_args.ratio=1e-2", "adaptive={candidates: [1e-1, 1e-2]}"],
    )
    assert nested.aggregator.ratio == 0.01 and nested.adaptive["candidates"] == [
        0.1,
        0.01,
    ]
    from models import build_task

    with pytest.raises(ValueError, match="did you mean 'widht' -> 'width'"):
        build_task("gpt", widht=64)
