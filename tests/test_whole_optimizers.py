"""Marsit and the sign methods are whole optimizers, and the README's step takes any optimizer.

The README's own train step (the block between its ``readme-step`` markers) is run as a user
would run it, with one expression changed:

* a whole optimizer in place of ``ec_quantized_all_reduce``, followed by ``optax.sgd(0.1)`` as
  in the README's chain, is refused at trace time with an error naming the transform;
* the form the README gives for Marsit trains the README's problem to its true weights;
* ``optax.adam`` or SGD with momentum in place of ``optax.sgd(0.1)`` train it too (the state
  layout the README shows keeps the optimizer's state replicated).
"""

import contextlib
import io
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomm

README = Path(__file__).resolve().parents[1] / "README.md"
TRUE_W = np.array([1.0, -2.0, 0.5, 3.0])
AGGREGATOR = 'jaxcomm.ec_quantized_all_reduce("data", bits=4)'
OPTIMIZER = "optax.sgd(0.1)"
WHOLE = {
    "marsit": 'jaxcomm.marsit("data", local_lr=0.05, global_lr=1e-3, full_sync_every=10)',
    "signsgd_mv": 'jaxcomm.signsgd_mv("data", lr=1e-3)',
    "ef_signsgd": 'jaxcomm.ef_signsgd("data", lr=1e-3)',
    "ssdm": 'jaxcomm.ssdm("data", lr=1e-3)',
    "cascading_sign": 'jaxcomm.cascading_sign("data", lr=1e-3)',
}


def _readme_step() -> str:
    text = README.read_text()
    block = text.split("<!-- readme-step:begin -->")[1].split("<!-- readme-step:end -->")[0]
    return block.split("```python\n", 1)[1].split("```", 1)[0]


def _tx_line(code: str) -> str:
    (line,) = [ln for ln in code.splitlines() if ln.startswith("tx = ")]
    return line


def _run(code: str) -> np.ndarray:
    """Run a README program in a fresh namespace; the trained ``params["w"]``, flattened."""
    ns = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, str(README), "exec"), ns)  # noqa: S102
    return np.asarray(ns["params"]["w"], np.float64).ravel()


def _replace(code: str, old: str, new: str) -> str:
    assert old in _tx_line(code), f"the README's chain no longer holds {old}"
    return code.replace(_tx_line(code), _tx_line(code).replace(old, new))


@pytest.mark.parametrize("name", WHOLE)
def test_the_readme_chain_with_a_whole_optimizer_then_sgd_is_refused(name):
    """``optax.chain(jaxcomm.<whole optimizer>(...), optax.sgd(0.1))`` in the README's step:
    without the check it trains uphill with no error (Marsit ends far from the true ``w``)."""
    code = _replace(_readme_step(), AGGREGATOR, WHOLE[name])
    assert OPTIMIZER in _tx_line(code)
    with pytest.raises(ValueError) as info:
        _run(code)
    message = str(info.value)
    assert message.startswith(f"jaxcomm.{name} returns the step to apply")
    assert "optax.sgd after it reverses its sign" in message
    assert f"optax.chain(jaxcomm.{name}(...), optax.identity())" in message


def test_the_readmes_form_for_marsit_trains_the_readme_step():
    """The README's sentence ``tx = optax.chain(jaxcomm.marsit(...), optax.identity())``,
    put in its step unchanged otherwise, reaches the true weights."""
    form = r"`(tx = optax\.chain\(jaxcomm\.marsit\(.*?\), optax\.identity\(\)\))`"
    found = re.findall(form, README.read_text())
    assert len(found) == 1, "the README no longer gives the form to use Marsit in"
    code = _readme_step()
    w = _run(code.replace(_tx_line(code), found[0]))
    np.testing.assert_allclose(w, TRUE_W, atol=0.02)


@pytest.mark.parametrize("optimizer", ["optax.adam(0.1)", "optax.sgd(0.1, momentum=0.9)"])
def test_the_readme_step_trains_with_an_optimizer_that_has_state(optimizer):
    """The README's step with ``optax.sgd(0.1)`` swapped for an optimizer that has state:
    the layout it shows must keep that state replicated, so the parameters stay replicated
    (one row per worker for the whole state makes ``shard_map`` refuse ``out_specs=P()``)."""
    w = _run(_replace(_readme_step(), OPTIMIZER, optimizer))
    np.testing.assert_allclose(w, TRUE_W, atol=0.05)
    assert f"`{optimizer}`" in README.read_text(), "the README names the optimizers swapped in"


# ------------------------------------------------------------------- which chains are refused

_MARSIT = lambda: jaxcomm.marsit("data", local_lr=0.05, global_lr=1e-3, full_sync_every=10)


def _trace(mesh8, tx):
    """Trace (no compile) a user's step with ``tx`` inside ``shard_map`` over ``data``."""

    def loss_fn(params, x):
        return jnp.mean((x @ params["w"]) ** 2)

    def step(params, x):
        grads = jaxcomm.worker_grad(loss_fn, "data")(params, x)
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)

    f = jax.shard_map(step, mesh=mesh8, in_specs=(P(), P("data")), out_specs=P())

    def shaped(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh8, spec))

    return jax.eval_shape(f, {"w": shaped((4, 1), P())}, shaped((16, 4), P("data")))


ALLOWED = {
    "alone": lambda: _MARSIT(),
    "identity after": lambda: optax.chain(_MARSIT(), optax.identity()),
    "clipping before": lambda: optax.chain(optax.clip_by_global_norm(1.0), _MARSIT()),
    "nested, identities after": lambda: optax.chain(
        optax.chain(optax.clip(1.0), _MARSIT()), optax.chain(optax.identity(), optax.identity())
    ),
    "named chain, identity after": lambda: optax.named_chain(
        ("marsit", _MARSIT()), ("none", optax.identity())
    ),
    "a schedule's shape after": lambda: optax.chain(
        _MARSIT(), jaxcomm.scheduled_step(optax.cosine_decay_schedule(1.0, 10))
    ),
}
REFUSED = {
    "sgd after": lambda: optax.chain(_MARSIT(), optax.sgd(0.1)),
    "adam after": lambda: optax.chain(_MARSIT(), optax.adam(1e-3)),
    "identity then sgd after": lambda: optax.chain(_MARSIT(), optax.identity(), optax.sgd(0.1)),
    "sgd after a nested chain": lambda: optax.chain(
        optax.chain(optax.clip(1.0), _MARSIT()), optax.sgd(0.1)
    ),
    "a schedule then scale after": lambda: optax.chain(
        _MARSIT(), jaxcomm.scheduled_step(lambda count: 1.0), optax.scale(-1.0)
    ),
    "sgd with a schedule after": lambda: optax.chain(
        _MARSIT(), optax.sgd(optax.cosine_decay_schedule(0.1, 10))
    ),
    "optax's scale by schedule after": lambda: optax.chain(
        _MARSIT(), optax.scale_by_schedule(lambda count: 1.0)
    ),
    "named chain, sgd after": lambda: optax.named_chain(
        ("marsit", _MARSIT()), ("sgd", optax.sgd(0.1))
    ),
    "inside apply_if_finite": lambda: optax.apply_if_finite(
        optax.chain(_MARSIT(), optax.sgd(0.1)), 3
    ),
}


@pytest.mark.parametrize("name", ALLOWED)
def test_a_whole_optimizer_alone_or_followed_by_identity_traces(mesh8, name):
    out = _trace(mesh8, ALLOWED[name]())
    assert out["w"].shape == (4, 1)


@pytest.mark.parametrize("name", REFUSED)
def test_a_whole_optimizer_followed_by_another_transform_is_refused(mesh8, name):
    with pytest.raises(ValueError, match=r"^jaxcomm\.marsit returns the step to apply"):
        _trace(mesh8, REFUSED[name]())


def test_whole_optimizers_are_told_apart_from_gradient_aggregators():
    for expr in WHOLE.values():
        assert isinstance(eval(expr), jaxcomm.WholeOptimizer), expr  # noqa: S307
    for tx in (
        jaxcomm.ec_quantized_all_reduce("data"),
        jaxcomm.dense_all_reduce("data"),
        jaxcomm.ar_topk("data", ratio=0.1),
    ):
        assert not isinstance(tx, jaxcomm.WholeOptimizer)
