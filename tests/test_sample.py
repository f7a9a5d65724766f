"""``python -m train.sample``: text from a trained GPT run, reproducible per seed, greedy
decoding equal to the model's argmax, and one-line errors for folders it cannot use."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.config import Config
from train.sample import SampleError, generate, load_run, main
from train.trainer import Trainer

SMALL = {"num_layers": 1, "width": 32, "num_heads": 2, "seq_len": 32}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished tiny GPT run on the Shakespeare bytes."""
    out = tmp_path_factory.mktemp("sample") / "run"
    cfg = Config(
        name="sample",
        task="gpt",
        model=SMALL,
        workers=8,
        global_batch=16,
        steps=3,
        lr=3e-3,
        aggregator="ring",
        checkpoint_every=0,
        progress=False,
        out_dir=str(out),
    )
    Trainer(cfg).run()
    return out


def _argmax_loop(task, params, prompt, length):
    """Greedy decoding written plainly: the whole recent context, its last logits' argmax."""
    seq_len = task.module.cfg.seq_len
    apply = jax.jit(task.module.apply)  # one program a context length (eager: one an op)
    tokens = list(prompt)
    for _ in range(length):
        context = jnp.asarray([tokens[-seq_len:]], jnp.int32)
        logits = apply({"params": params}, context)[0, -1]
        tokens.append(int(jnp.argmax(logits)))
    return np.asarray(tokens[len(prompt) :], np.uint8)


def test_sampling_has_the_length_asked_and_repeats_per_seed(run_dir):
    task, params = load_run(run_dir)
    a = generate(task, params, b"ROMEO:", 40, temperature=1.0, seed=3)
    assert a.shape == (40,) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, generate(task, params, b"ROMEO:", 40, temperature=1.0, seed=3))
    assert not np.array_equal(a, generate(task, params, b"ROMEO:", 40, temperature=1.0, seed=4))
    assert generate(task, params, b"R", 0).shape == (0,)


def test_greedy_is_the_argmax_of_the_models_logits(run_dir):
    task, params = load_run(run_dir)
    # 31 prompt bytes and 10 more pass seq_len (32): the context then slides.
    prompt = b"Now is the winter of our discon"
    greedy = generate(task, params, prompt, 10, temperature=0.0, seed=5)
    np.testing.assert_array_equal(greedy, _argmax_loop(task, params, prompt, 10))
    # The seed plays no part in greedy decoding.
    np.testing.assert_array_equal(greedy, generate(task, params, prompt, 10, temperature=0.0))


def test_cli_writes_the_prompt_and_its_continuation(run_dir, capsysbinary):
    args = [str(run_dir), "--prompt", "To be", "--length", "12", "--seed", "1"]
    assert main([*args, "--temperature", "0.7"]) == 0
    out = capsysbinary.readouterr().out
    assert out.startswith(b"To be") and out.endswith(b"\n") and len(out) == 5 + 12 + 1
    task, params = load_run(run_dir)
    expected = generate(task, params, b"To be", 12, temperature=0.7, seed=1)
    assert out[5:-1] == expected.tobytes()
    assert main([*args, "--temperature", "0"]) == 0
    greedy = _argmax_loop(task, params, b"To be", 12)
    assert capsysbinary.readouterr().out == b"To be" + greedy.tobytes() + b"\n"


def _one_line_error(capsys, argv, code=1):
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_folders_it_cannot_sample_from_get_one_line_errors(run_dir, tmp_path, capsys):
    err = _one_line_error(capsys, [str(tmp_path / "nowhere")])
    assert "does not exist" in err
    err = _one_line_error(capsys, [str(tmp_path)])
    assert "has no config.json" in err
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(run_dir / "config.json", unfinished / "config.json")
    err = _one_line_error(capsys, [str(unfinished)])
    assert "has no params.msgpack" in err and "--resume" in err
    mlp = tmp_path / "mlp"
    mlp.mkdir()
    cfg = Config(task="mlp", model={"features": [16]}, dataset="digits", out_dir=str(mlp))
    (mlp / "config.json").write_text(json.dumps(cfg.to_dict()))
    err = _one_line_error(capsys, [str(mlp)])
    assert "'mlp'" in err and "not a GPT" in err
    wider = tmp_path / "wider"
    shutil.copytree(run_dir, wider)
    saved = json.loads((wider / "config.json").read_text())
    saved["model"]["width"] = 64
    (wider / "config.json").write_text(json.dumps(saved))
    err = _one_line_error(capsys, [str(wider)])
    assert "does not fit the run's config.json" in err
    err = _one_line_error(capsys, [str(run_dir), "--prompt", ""], code=2)
    assert "--prompt" in err
    err = _one_line_error(capsys, [str(run_dir), "--temperature", "-1"], code=2)
    assert "--temperature" in err
    with pytest.raises(SampleError, match="not a GPT"):
        load_run(mlp)
