"""train.estimate: a step costed from shapes alone equals what a real run of it logs."""

import json

import numpy as np
import pytest

import jaxcomm
from train.config import Config
from train.estimate import estimate, main
from train.trainer import Trainer

MODEL = {"num_layers": 2, "width": 32, "num_heads": 2, "seq_len": 16}


def _cfg(tmp_path, **kw):
    base = dict(
        name="est",
        task="gpt",
        model=MODEL,
        workers=8,
        global_batch=16,
        steps=2,
        checkpoint_every=0,
        progress=False,
        compute="a100",
        network="2ms,100Mbps",
        out_dir=str(tmp_path / "run"),
    )
    base.update(kw)
    return Config(**base)


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {
            "workers": 2,
            "stages": 3,  # a middle stage sends both ways and holds no embedding or loss
            "boundary": "aqsgd",
            "fw_bits": 2,
            "train_samples": 32,
            "model": {**MODEL, "num_layers": 3},
        },
    ],
)
def test_estimate_equals_what_a_run_logs(tmp_path, extra):
    cfg = _cfg(tmp_path, steps=3 if extra else 2, **extra)
    est = estimate(cfg)
    trainer = Trainer(cfg)
    rows = []
    trainer.run(metrics_cb=rows.append)
    steady = rows[-1]
    if cfg.stages > 1:  # 32 samples, 16 per step: steps 1-2 first visits, step 3 deltas
        first = rows[0]
        assert est["first_epoch"]["sent_bytes_per_device"] == first["sent_bytes"]
        assert est["first_epoch"]["comm_s"] == pytest.approx(first["comm_s"], rel=1e-9)
        assert est["first_epoch"]["compute_s"] == pytest.approx(first["sim_compute_s"], rel=1e-9)
        assert est["sent_bytes_per_device"] < first["sent_bytes"]
    assert est["sent_bytes_per_device"] == steady["sent_bytes"]
    assert est["comm_s"] == pytest.approx(steady["comm_s"], rel=1e-9)
    assert est["compute_s"] == pytest.approx(steady["sim_compute_s"], rel=1e-9)
    assert est["step_s"] == pytest.approx(steady["sim_step_s"], rel=1e-9)
    if cfg.stages == 1:  # (a pipeline's stages differ, so its step is its timeline)
        assert est["step_s"] == pytest.approx(est["compute_s"] + est["comm_s"])
        assert est["step_time"] == "compute + communication: no overlap"
    else:
        assert est["step_time"].startswith("GPipe's timeline")
    assert est["samples_per_s"] == pytest.approx(16 / est["step_s"])
    assert est["flops_per_device"] > 0


def test_cli_writes_json_and_names_what_it_cannot_cost(tmp_path, capsys):
    out = tmp_path / "e.json"
    args = ["--set", "model.num_layers=1", "--set", "model.width=32", "--set", "model.seq_len=16"]
    assert main([*args, "--set", "compute=h100", "--json", str(out)]) == 0
    est = json.loads(out.read_text())
    for key in ("step_s", "compute_s", "comm_s", "samples_per_s", "flops_per_device"):
        assert np.isfinite(est[key]) and est[key] > 0
    assert est["sent_bytes_per_device"] > 0
    printed = capsys.readouterr().out
    assert "samples_per_s" in printed
    assert "\nnote: step " in printed and " = compute " in printed
    marsit = [*args, "--set", "compute=v100", "--set", "aggregator=marsit"]
    marsit += ["--set", "optimizer=none", "--set", "aggregator_args={local_lr: 0.1, "]
    marsit[-1] += "global_lr: 0.01, full_sync_every: 5}"
    assert main(marsit) == 1
    assert "cannot cost the step's communication" in capsys.readouterr().err
    # Marsit's rounds costed apart: the one-bit round sends 1/32 of the full one's bytes.
    sent = []
    for branch in (0, 1):
        assert main([*marsit, "--branch", f"marsit_round={branch}", "--json", str(out)]) == 0
        est = json.loads(out.read_text())
        assert est["branches"] == {"marsit_round": branch}
        sent.append(est["sent_bytes_per_device"])
    assert 20 * sent[0] < sent[1] < 40 * sent[0]
    assert main([*marsit, "--branch", "cond"]) == 2
    assert "NAME=INDEX" in capsys.readouterr().err


def test_the_printout_says_how_the_step_time_is_made():
    """The step time is printed with how it comes from compute and communication: their
    sum, their max with overlap, or the layout's timeline when it is neither."""
    from train.estimate import _step_note

    how = {"step_time": "GPipe's timeline: (the layout's words)"}
    added = _step_note({**how, "step_s": 0.003, "compute_s": 0.001, "comm_s": 0.002})
    assert added == "step 3 ms = compute 1 ms + communication 2 ms"
    hidden = _step_note({**how, "step_s": 0.002, "compute_s": 0.001, "comm_s": 0.002})
    assert hidden.startswith("step 2 ms = max(compute 1 ms, communication 2 ms)")
    assert "overlapped" in hidden
    neither = _step_note({**how, "step_s": 0.0025, "compute_s": 0.001, "comm_s": 0.002})
    assert neither.startswith("step 2.5 ms, not compute 1 ms + communication 2 ms = 3 ms")
    assert neither.endswith("GPipe's timeline: (the layout's words)")


def test_shipped_gpt2xl_config_is_the_papers_setting():
    from train.config import load_config

    cfg = load_config("configs/aqsgd_gpt2xl.yaml", [])
    assert (cfg.stages, cfg.workers, cfg.microbatches, cfg.global_batch) == (8, 1, 32, 32)
    m = cfg.model
    assert (m.num_layers, m.width, m.num_heads, m.seq_len, m.vocab_size) == (
        48, 1600, 25, 1024, 50257
    )  # fmt: skip
    assert cfg.boundary.to_dict() == {"name": "fp32", "forward": {"name": "fp32"},
                                      "backward": {"name": "fp32"}}  # fmt: skip
    assert jaxcomm.compute.get_device(cfg.compute).name == "v100"


def test_marsit_resnet50_config_is_the_papers_setting():
    import jax
    import jax.numpy as jnp

    from models import param_count
    from train.config import load_config

    cfg = load_config("configs/marsit_resnet50.yaml", [])
    assert (cfg.workers, cfg.global_batch, cfg.compute) == (64, 6144, "t4")
    assert cfg.aggregator.full_sync_every == 100
    task = cfg.model.build()
    shapes = jax.eval_shape(
        lambda k: task.init(k, {"image": jnp.zeros((1, 224, 224, 3))}), jax.random.key(0)
    )
    assert 25.4e6 < param_count(shapes) < 25.7e6  # ResNet-50: 25.6M


def test_an_aqsgd_pipeline_with_marsit_estimates_both_epochs_by_branch(tmp_path):
    """The pipeline holds its own conditionals (GPipe's ticks); Marsit's round is addressed
    by its scope, and the first-epoch estimate takes the same branch."""
    out = tmp_path / "est.json"
    marsit = "aggregator_args={local_lr: 0.1, global_lr: 0.01, full_sync_every: 2}"
    sets = ["stages=2", "workers=2", "boundary=aqsgd", "microbatches=2", "model.num_layers=2",
            "model.width=32", "model.seq_len=32", "optimizer=none", "aggregator=marsit",
            "compute=v100", marsit]  # fmt: skip
    args = ["--config", "configs/dp_default.yaml"] + [x for s in sets for x in ("--set", s)]
    sent = {}
    for branch in (0, 1):
        assert main([*args, "--branch", f"marsit_round={branch}", "--json", str(out)]) == 0
        est = json.loads(out.read_text())
        first = est["first_epoch"]["sent_bytes_per_device"]
        sent[branch] = (est["sent_bytes_per_device"], first)
    # The full-precision round sends more in both epochs; the first epoch (float32
    # activations) more than the steady state (deltas) in either round.
    assert sent[1][0] > sent[0][0] and sent[1][1] > sent[0][1]
    assert sent[0][1] > sent[0][0] and sent[1][1] > sent[1][0]


def test_the_estimate_key_is_checked_and_makes_its_baseline():
    from train.config import Config

    cfg = Config(estimate={"networks": ["1ms,80Mbps"], "baseline": {"network": "1ms,10Gbps"}})
    base = cfg.estimate_baseline()
    assert base.network == "1ms,10Gbps" and base.estimate == {} and cfg.network != base.network
    with pytest.raises(ValueError, match=r"estimate: unknown keys \['network'\].*networks"):
        Config(estimate={"network": ["1ms,1Gbps"]})
    with pytest.raises(ValueError, match="estimate.networks must be a list of network strings"):
        Config(estimate={"networks": "1ms,1Gbps"})
    with pytest.raises(ValueError, match="unknown config key 'netwrok'"):
        Config(estimate={"baseline": {"netwrok": "1ms,1Gbps"}})


def test_shipped_100x_config_is_gpt2xl_at_100x_below_float32_each_way():
    """The AQ-SGD paper's GPT2-XL pipeline with the chosen codec: the payloads one sample's
    deltas and gradients make (their arrays' bytes) are at least 100x below float32's."""
    import jax

    from train.config import load_config
    from train.pipeline_layout import make_boundary

    cfg = load_config("configs/activations_100x.yaml", [])
    paper = load_config("configs/aqsgd_gpt2xl.yaml", [])
    assert cfg.model == paper.model
    assert (cfg.stages, cfg.workers, cfg.microbatches) == (paper.stages, 1, 32)
    act = jax.ShapeDtypeStruct((1, 1024, 1600), jax.numpy.float32)
    fw, bw = jaxcomm.pipeline.boundary_message_bytes(make_boundary(cfg), act, seen=True)
    assert 100 <= 1024 * 1600 * 4 / fw < 110 and 100 <= 1024 * 1600 * 4 / bw < 110
    first, _ = jaxcomm.pipeline.boundary_message_bytes(make_boundary(cfg), act, seen=False)
    assert first == 1024 * 1600 // 2 + 4 * 1024  # 4-bit codes and a scale per token


def test_a_pipeline_with_the_gradient_memory_estimates(tmp_path):
    """The estimate compiles a memory pipeline from shapes (its state has the memory); what
    the memory's step sends is audited against its log in ``tests/test_pipeline.py``."""
    out = tmp_path / "est.json"
    sets = ["stages=2", "workers=2", "boundary=aqsgd", "microbatches=2", "model.num_layers=2",
            "model.width=32", "model.seq_len=32", "compute=v100",
            "boundary_args={fw_rank: 2, bw_rank: 2, bw_memory: true}"]  # fmt: skip
    args = ["--config", "configs/dp_default.yaml"] + [x for s in sets for x in ("--set", s)]
    assert main([*args, "--json", str(out)]) == 0
    est = json.loads(out.read_text())
    assert 0 < est["sent_bytes_per_device"] < est["first_epoch"]["sent_bytes_per_device"]


def test_a_measured_estimate_times_each_compiled_program_here(monkeypatch):
    """``compute: measured``: each of the step's programs runs here on zero inputs of its
    own shapes and placement (a program that could not run would raise), once untimed and
    ``MEASURE_RUNS`` times timed, and the compute is the median of the timed runs: on a
    clock where the runs take 50, 1, 2, 3, 4 and 90 s, the median of runs 1-5 is 3 s (their
    mean would be 20 s, all six runs' 25 s)."""
    import time

    import train.estimate as est_mod
    from train.config import load_config

    runs = []

    class Clock:
        """``time`` as ``train.estimate`` sees it, with a scripted ``perf_counter``."""

        calls = 0

        def perf_counter(self):
            run, end = divmod(self.calls, 2)  # each run reads the clock at its start and end
            self.calls += 1
            if end:
                runs.append(run)
            return 1000.0 * run + end * [50.0, 1.0, 2.0, 3.0, 4.0, 90.0][run]

        def __getattr__(self, name):
            return getattr(time, name)

    cfg = load_config(None, ["model.num_layers=1", "model.width=32", "model.seq_len=16",
                             "compute=measured", "workers=2"])  # fmt: skip
    ctx = Trainer(cfg, abstract=True).ctx
    monkeypatch.setattr(est_mod, "time", Clock())
    seconds = est_mod._measured_seconds(ctx, None)
    monkeypatch.setattr(est_mod, "time", time)
    assert runs == list(range(est_mod.MEASURE_RUNS + 1))  # one program, six runs
    assert seconds == 3.0
    with pytest.raises(ValueError, match="cannot resolve its branches"):
        estimate(cfg, {"marsit_round": 0})
    full = estimate(cfg)
    assert full["compute"] == "measured" and full["mfu"] is None
    assert full["compute_s"] > 0 and full["step_s"] >= full["compute_s"]
