"""Tests for ``models``: shapes, causality, stage-by-stage equivalence, ordering, training."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import (
    GPT,
    MLP,
    Block,
    Embed,
    GPTConfig,
    Head,
    ResNet,
    Task,
    build_task,
    layer_groups,
    param_count,
)

SMALL = dict(vocab_size=32, seq_len=16, num_layers=4, width=32, num_heads=4, mlp_ratio=2)


def _key(seed: int) -> jax.Array:
    """A PRNG key; the rbg implementation compiles much faster than threefry on CPU."""
    return jax.random.key(seed, impl="rbg")


def _tokens(seed: int, cfg: GPTConfig, batch: int = 2, length: int | None = None) -> jax.Array:
    length = cfg.seq_len if length is None else length
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, length)), jnp.int32)


def _image_batch(seed: int, batch: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "image": jnp.asarray(rng.normal(size=(batch, 8, 8, 1)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, 10, batch), jnp.int32),
    }


@pytest.fixture(scope="module")
def small_gpt():
    cfg = GPTConfig(**SMALL)
    model = GPT(cfg)
    params = jax.jit(model.init)(_key(0), _tokens(1, cfg))["params"]
    return cfg, model, params


def test_gpt_output_shape_dtype_and_determinism(small_gpt):
    cfg, model, params = small_gpt
    tokens = _tokens(2, cfg, batch=3, length=cfg.seq_len)
    logits = model.apply({"params": params}, tokens)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab_size)
    assert logits.dtype == jnp.float32
    np.testing.assert_array_equal(logits, model.apply({"params": params}, tokens))
    short = model.apply({"params": params}, tokens[:, :5])
    assert short.shape == (3, 5, cfg.vocab_size)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


def test_gpt_rejects_too_long_sequence(small_gpt):
    cfg, model, params = small_gpt
    with pytest.raises(ValueError, match=str(cfg.seq_len + 1)):
        model.apply({"params": params}, _tokens(0, cfg, length=cfg.seq_len + 1))


def test_gpt_is_causal(small_gpt):
    cfg, model, params = small_gpt
    tokens = _tokens(3, cfg)
    base = model.apply({"params": params}, tokens)
    for t in (0, 5, cfg.seq_len - 1):
        changed = tokens.at[:, t].set((tokens[:, t] + 1) % cfg.vocab_size)
        out = model.apply({"params": params}, changed)
        np.testing.assert_allclose(out[:, :t], base[:, :t], rtol=1e-6, atol=1e-6)
        assert not np.allclose(out[:, t], base[:, t])


def test_gpt_stages_match_full_model(small_gpt):
    cfg, model, params = small_gpt
    assert layer_groups(params) == ["embed"] + [f"block_{i}" for i in range(4)] + ["head"]
    tokens = _tokens(4, cfg)
    full = model.apply({"params": params}, tokens)

    h = Embed(cfg).apply({"params": params["embed"]}, tokens)
    assert h.shape == (2, cfg.seq_len, cfg.width)
    for i in range(cfg.num_layers):
        h = Block(cfg).apply({"params": params[f"block_{i}"]}, h)
        assert h.shape == (2, cfg.seq_len, cfg.width)
    staged = Head(cfg).apply({"params": params["head"]}, h)
    np.testing.assert_allclose(staged, full, rtol=1e-5, atol=1e-5)


def test_standalone_block_matches_gpt_block_3(small_gpt):
    cfg, model, params = small_gpt
    captured = {}

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.module.name == "block_3" and context.method_name == "__call__":
            captured["in"], captured["out"] = args[0], out
        return out

    with nn.intercept_methods(interceptor):
        model.apply({"params": params}, _tokens(7, cfg))
    block_3 = Block(cfg).apply({"params": params["block_3"]}, captured["in"])
    np.testing.assert_allclose(block_3, captured["out"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(width=130, num_heads=4), r"width.*130"),
        (dict(num_layers=0), r"num_layers.*positive.*0"),
        (dict(vocab_size=-5), r"vocab_size.*-5"),
        (dict(num_heads=2.0), r"num_heads.*2\.0"),
    ],
)
def test_gpt_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_mlp_shapes_groups_and_param_count():
    model = MLP(features=(32, 16), num_classes=10)
    x = jnp.ones((4, 8, 8, 1), jnp.float32)
    params = jax.jit(model.init)(_key(0), x)["params"]
    assert model.apply({"params": params}, x).shape == (4, 10)
    assert layer_groups(params) == ["dense_0", "dense_1", "head"]
    assert param_count(params) == (64 * 32 + 32) + (32 * 16 + 16) + (16 * 10 + 10)

    deep = MLP(features=(4,) * 12)
    shapes = jax.eval_shape(lambda: deep.init(_key(0), x)["params"])
    assert layer_groups(shapes) == [f"dense_{i}" for i in range(12)] + ["head"]


def test_resnet_shapes_groups_and_no_batch_stats():
    model = ResNet(channels=(8, 16, 24), blocks_per_stage=2, num_classes=7)
    x = jnp.ones((3, 8, 8, 1), jnp.float32)
    variables = jax.jit(model.init)(_key(0), x)
    assert set(variables) == {"params"}
    params = variables["params"]
    assert model.apply(variables, x).shape == (3, 7)
    assert layer_groups(params) == [
        "stem",
        "stage0_block0",
        "stage0_block1",
        "stage1_block0",
        "stage1_block1",
        "stage2_block0",
        "stage2_block1",
        "head",
    ]
    assert "proj" not in params["stage0_block0"]
    assert "proj" in params["stage1_block0"] and "proj" not in params["stage1_block1"]
    assert params["stage2_block0"]["conv_1"]["kernel"].shape == (3, 3, 16, 24)

    _, state = model.apply(variables, x, capture_intermediates=True)
    inter = state["intermediates"]
    assert inter["stage0_block1"]["__call__"][0].shape == (3, 8, 8, 8)
    assert inter["stage1_block0"]["__call__"][0].shape == (3, 4, 4, 16)
    assert inter["stage2_block0"]["__call__"][0].shape == (3, 2, 2, 24)


def test_bottleneck_resnet_with_imagenet_stem():
    model = ResNet(channels=(4, 8), blocks_per_stage=(1, 2), bottleneck=True, imagenet_stem=True)
    x = jnp.ones((2, 32, 32, 3), jnp.float32)
    variables = jax.jit(model.init)(_key(0), x)
    params = variables["params"]
    assert params["stem"]["conv"]["kernel"].shape == (7, 7, 3, 4)
    assert params["stage0_block0"]["conv_3"]["kernel"].shape == (1, 1, 4, 16)  # 4x expansion
    assert "proj" in params["stage0_block0"] and "proj" not in params["stage1_block1"]
    _, state = model.apply(variables, x, capture_intermediates=True)
    inter = state["intermediates"]
    assert inter["stem"]["__call__"][0].shape == (2, 8, 8, 4)  # 7x7/2 conv, 3x3/2 pool
    assert inter["stage1_block1"]["__call__"][0].shape == (2, 4, 4, 32)
    with pytest.raises(ValueError, match="one count per stage"):
        ResNet(channels=(4, 8), blocks_per_stage=(1, 2, 3))
    with pytest.raises(ValueError, match="bottleneck must be a bool"):
        ResNet(bottleneck=1)


def test_layer_groups_numeric_order():
    gpt = GPT(GPTConfig(**{**SMALL, "num_layers": 12, "width": 8, "num_heads": 2}))
    shapes = jax.eval_shape(lambda: gpt.init(_key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    assert layer_groups(shapes) == ["embed"] + [f"block_{i}" for i in range(12)] + ["head"]

    names = ["head", "stage1_block0", "stage0_block10", "stage0_block2", "stem", "stage10_block0"]
    assert layer_groups(dict.fromkeys(names)) == [
        "stem",
        "stage0_block2",
        "stage0_block10",
        "stage1_block0",
        "stage10_block0",
        "head",
    ]


def test_param_count_accepts_shapes():
    params = {"a": jnp.ones((2, 3)), "b": {"c": jax.ShapeDtypeStruct((4, 5), jnp.float32)}}
    assert param_count(params) == 26


def _train(task: Task, batch: dict, steps: int = 30, lr: float = 3e-3) -> tuple[float, float]:
    params = jax.jit(task.init)(_key(0), batch)
    opt = optax.adam(lr)
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state):
        (loss, _), grads = jax.value_and_grad(task.loss, has_aux=True)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    first = None
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        first = float(loss) if first is None else first
    final, metrics = jax.jit(task.loss)(params, batch)
    assert set(metrics) == {"loss", "accuracy"}
    assert 0.0 <= float(metrics["accuracy"]) <= 1.0
    assert np.isclose(float(metrics["loss"]), float(final))
    return first, float(final)


def test_gpt_task_trains():
    task = build_task("gpt", **SMALL)
    cfg = task.module.cfg
    tokens = _tokens(5, cfg, batch=4, length=cfg.seq_len + 1)
    batch = {"tokens": tokens, "ids": jnp.arange(4)}
    params = jax.jit(task.init)(_key(0), batch)
    loss, metrics = task.loss(params, batch)
    assert loss.shape == () and metrics["loss"].shape == ()
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.5
    first, final = _train(task, batch)
    assert final < 0.7 * first


@pytest.mark.parametrize(
    "name, kwargs",
    [("mlp", dict(features=(64, 64))), ("cnn", dict(channels=(8, 16)))],
)
def test_classifier_tasks_train(name, kwargs):
    task = build_task(name, **kwargs)
    batch = {**_image_batch(6), "ids": jnp.arange(16)}
    first, final = _train(task, batch)
    assert final < 0.5 * first


def test_build_task_modules():
    assert isinstance(build_task("gpt").module, GPT)
    assert build_task("gpt").module.cfg == GPTConfig()
    mlp = build_task("mlp", features=[8, 8], num_classes=3).module
    assert isinstance(mlp, MLP) and mlp.features == (8, 8) and mlp.num_classes == 3
    cnn = build_task("cnn", blocks_per_stage=2).module
    assert isinstance(cnn, ResNet) and cnn.blocks_per_stage == 2


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("transformer", {}, r"'transformer'.*gpt.*mlp.*cnn"),
        ("mlp", dict(width=3), r"'width'.*features.*num_classes"),
        ("gpt", dict(depth=2), r"'depth'.*vocab_size"),
        ("cnn", dict(channels=()), r"channels.*\(\)"),
        ("cnn", dict(blocks_per_stage=0), r"blocks_per_stage.*0"),
        ("mlp", dict(features=(8, -1)), r"features.*-1"),
        ("mlp", dict(num_classes=0), r"num_classes.*0"),
        ("gpt", dict(width=10, num_heads=4), r"width.*10"),
    ],
)
def test_build_task_errors(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_task(name, **kwargs)
