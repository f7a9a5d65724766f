"""Pipeline trainer: matches data-parallel training with FP32 boundaries; AQ-SGD buffers fill,
both sides agree, and resume (buffers included) is bit-exact."""

import json

import jax
import numpy as np
import pytest

from train.config import Config
from train.pipeline_trainer import PipelineTrainer
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
    PipelineTrainer(pp).run()
    dp = _cfg(tmp_path / "dp", stages=1)
    Trainer(dp).run()
    np.testing.assert_allclose(_losses(pp), _losses(dp), rtol=2e-5)


def test_aqsgd_pipeline_buffers_and_bytes(tmp_path):
    cfg = _cfg(tmp_path, stages=4, workers=2, global_batch=16, boundary="aqsgd", fw_bits=2)
    trainer = PipelineTrainer(cfg)
    trainer.run()
    for buf in trainer.buffers:
        buf.flush()
    ids = np.concatenate([trainer.loader.batch_ids(p) for p in range(4)])
    assert all(buf.seen(np.unique(ids)).all() for buf in trainer.buffers)
    # Both sides of every boundary consumed the same messages in the last step.
    st = jax.device_get(trainer._last_state)
    for b in range(3):
        np.testing.assert_array_equal(st.prev_out[:, b], st.prev_in[:, b + 1])
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    # First visits cross in fp32; the wire record shows 2 M p2p messages per step.
    p2p = [[w for w in r["wire"] if w[0] == "p2p"][0] for r in rows]
    assert all(w[1] == 4 for w in p2p)
    # A step's bytes are the pipeline's p2p payloads plus the data-parallel all-reduce share.
    from jaxcomm.network import as_bytes, find_logs

    (dp_log,) = find_logs(trainer.opt_state)
    ring = int(np.max(as_bytes(dp_log.sent_bytes)))
    assert ring > 0
    assert rows[-1]["sent_bytes"] == ring + p2p[-1][2]
    # Buffer I/O on the critical path is recorded per step; the buffers' size in the summary.
    assert all(r["buffer_copy_s"] > 0 and r["buffer_read_wait_s"] >= 0 for r in rows)
    summary = json.loads((cfg.run_dir / "summary.json").read_text())
    n = len(trainer.train_data)
    assert summary["buffer_bytes"] == 3 * trainer.buffers[0].nbytes >= 3 * n * 16 * 32 * 4


def test_non_aqsgd_boundaries_keep_no_buffers(tmp_path):
    cfg = _cfg(tmp_path, boundary="directq", fw_bits=2, checkpoint_every=2)
    trainer = PipelineTrainer(cfg)
    trainer.run()
    assert trainer.buffers == []
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
    ft = PipelineTrainer(_cfg(tmp_path / "ft", stages=4, init_params=str(path)))
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


def test_aqsgd_pipeline_resume_bit_exact(tmp_path):
    kw = dict(stages=2, boundary="aqsgd", fw_bits=3, checkpoint_every=2)
    full = PipelineTrainer(_cfg(tmp_path / "a", **kw))
    full.run()
    PipelineTrainer(_cfg(tmp_path / "b", steps=2, **kw)).run()
    resumed = PipelineTrainer(_cfg(tmp_path / "b", **kw))
    assert resumed.run(resume=True)["resumed"]
    for a, b in zip(
        jax.tree_util.tree_leaves(full.worker_params()),
        jax.tree_util.tree_leaves(resumed.worker_params()),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_pipeline_config_errors():
    with pytest.raises(ValueError, match="stages=2 needs task='gpt'"):
        Config(task="mlp", dataset="digits", stages=2)
    with pytest.raises(ValueError, match="multiple of workers \\* microbatches = 32"):
        Config(stages=2, workers=8, microbatches=4, global_batch=40)
    with pytest.raises(ValueError, match=r"fw_bits must be an integer in \[1, 8\], got 9"):
        Config(stages=2, fw_bits=9)


def test_param_count_is_the_models(tmp_path):
    from models import build_task, param_count

    trainer = PipelineTrainer(_cfg(tmp_path, stages=4, workers=2, global_batch=16))
    task = build_task("gpt", **MODEL)
    params = task.init(jax.random.key(0, impl="rbg"), trainer.train_data.get(np.arange(2)))
    assert trainer.num_params() == param_count(params)
