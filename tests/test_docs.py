"""The documentation: it builds with warnings as errors (links between pages included),
every complete ``python`` block in it and in the README runs as printed, every ``py``
fragment runs in the setting its page describes, its command line
reference is current, and every relative link points at a file that exists."""

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from tests.test_trainer import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if "_build" not in p.parts]
# ```python blocks are complete programs and run as printed; ```py blocks are fragments of a
# step, run below in the setting their page describes.
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for page in PAGES:
        for i, m in enumerate(BLOCK.finditer(page.read_text())):
            yield pytest.param(page, m.group(1), id=f"{page.relative_to(ROOT)}#{i}")


@pytest.mark.parametrize("page, code", list(_blocks()))
def test_every_python_block_runs_as_printed(page, code):
    """Each block runs in a fresh namespace; a last line ``print(...)  # text`` must print
    that text."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(page), "exec"), {"__name__": "__docs__"})  # noqa: S102
    last = code.rstrip().splitlines()[-1]
    if last.startswith("print(") and "  # " in last:
        assert out.getvalue().strip().splitlines()[-1] == last.split("  # ", 1)[1].strip()


def test_the_readme_example_is_there_and_learns():
    """The README's own step is among the blocks run above, and it says what it prints."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- readme-step:begin -->")[1].split("<!-- readme-step:end -->")[0]
    assert "```python" in block and "# [ 1.  -2.   0.5  3. ]" in block
    assert len(block.strip().splitlines()) <= 40


@pytest.mark.parametrize("name", ["api", "cli"])
def test_the_reference_pages_are_current(name):
    import runpy

    page = runpy.run_path(str(ROOT / "docs" / "conf.py"))[f"{name}_page"]
    assert (ROOT / "docs" / f"{name}.md").read_text() == page(), (
        f"docs/{name}.md is stale: a docs build (sphinx-build docs ...) rewrites it"
    )


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_relative_links_point_at_files_that_exist():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in _LINK.findall(text):
            if re.match(r"^(https?:|mailto:|#)", target):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_docs_build_with_warnings_as_errors(tmp_path):
    """Sphinx (MyST pages, autodoc API reference) with -W: a broken link between pages, a
    malformed docstring or a page outside the table of contents fails the build."""
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(ROOT / "docs"), str(tmp_path / "html")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "JAXCOMM_DOCS_READ_ONLY": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (tmp_path / "html" / "api.html").read_text()
    for name in ("ec_quantized_all_reduce", "diloco", "wire_audit", "ring_all_reduce"):
        assert name in api
    # Code blocks wrap long lines (a command cut off at the page's edge cannot be copied).
    assert "_static/wrap-code.css" in api
    assert "pre-wrap" in (tmp_path / "html" / "_static" / "wrap-code.css").read_text()


# ```py fragments: each runs here in the setting its page describes, its free names given
# values of that setting, and what the page says of its result is checked.
FRAGMENT = re.compile(r"^```py\n(.*?)^```", re.S | re.M)


def _fragments():
    for page in PAGES:
        for i, m in enumerate(FRAGMENT.finditer(page.read_text())):
            yield f"{page.relative_to(ROOT)}#{i}", m.group(1)


def _quantize(code):
    import math

    import jax
    import numpy as np

    n = 10_000
    x = jax.numpy.asarray(np.random.default_rng(0).normal(size=n), np.float32)
    ns = {"x": x, "key": jax.random.key(0)}
    exec(compile(code, "library.md", "exec"), ns)  # noqa: S102
    assert ns["x_hat"].shape == x.shape and ns["x_hat"].dtype == x.dtype
    expect = math.ceil(n * 4 / 8) + 4 * math.ceil(n / 512)
    assert ns["jaxcomm"].codecs.payload_bytes(ns["q"]) == expect


def _ring(code):
    import jax
    import numpy as np

    import jaxcomm

    x = np.arange(8 * 16, dtype=np.float32)
    ns = {"jax": jax, "jaxcomm": jaxcomm, "x": x}
    exec(compile(code, "library.md", "exec"), ns)  # noqa: S102
    got = np.asarray(jax.jit(ns["f"])(ns["x"]))
    np.testing.assert_allclose(got, np.tile(x.reshape(8, 16).sum(0), 8))


def _sgd_step(reduce):
    """A data-parallel SGD step over 8 workers (dense all-reduce), its parameters and batch."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((8,), ("data",))
    tx = optax.chain(jaxcomm.dense_all_reduce("data", reduce=reduce), optax.sgd(0.1))
    specs = (P("data"), P())

    def loss_fn(params, x):
        return jnp.mean((x @ params["w"]) ** 2)

    def per_worker(params, opt_state, batch):
        agg, rest = opt_state
        grads = jaxcomm.worker_grad(loss_fn, "data")(params, batch)
        updates, (agg, rest) = tx.update(grads, (jax.tree.map(lambda a: a[0], agg), rest), params)
        return optax.apply_updates(params, updates), (jax.tree.map(lambda a: a[None], agg), rest)

    step = jax.shard_map(
        per_worker, mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs)
    )
    params = {"w": jnp.ones((128, 8))}  # 1,024 float32
    init = lambda p: (jax.tree.map(lambda a: a[None], tx.init(p)[0]), tx.init(p)[1])  # noqa: E731
    opt_state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    x = np.random.default_rng(0).normal(size=(64, 128)).astype(np.float32)
    return step, params, opt_state, jax.device_put(x, NamedSharding(mesh, P("data")))


def _audit(code):
    import numpy as np

    import jaxcomm

    step, params, opt_state, batch = _sgd_step("ring")
    ns = {"jax": __import__("jax"), "jaxcomm": jaxcomm, "step": step}
    ns.update(params=params, opt_state=opt_state, batch=batch)
    exec(compile(code, "library.md", "exec"), ns)  # noqa: S102
    # A ring all-reduce of 1,024 float32 over 8 workers: 2 (N-1) messages of d / N each.
    assert np.asarray(ns["audit"].sent_bytes()).tolist() == [2 * 7 * 128 * 4] * 8


def _cost(code):
    import jax
    import jax.numpy as jnp

    import jaxcomm

    a = jnp.ones((256, 512), jnp.float32)
    compiled = jax.jit(lambda a, b: a @ b).lower(a, a.T).compile()
    ns = {"jax": jax, "jaxcomm": jaxcomm, "compiled": compiled}
    exec(compile(code, "library.md", "exec"), ns)  # noqa: S102
    assert int(ns["cost"].matmul_flops[0]) == 2 * 256 * 512 * 256
    assert jaxcomm.compute.roofline("v100").seconds(ns["cost"])[0] > 0


def _aqsgd(code):
    """Stage 0 sends to stage 1; both hold the same previous messages; the receiver's
    result equals the sender's new previous messages bit for bit."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm

    mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
    rng = np.random.default_rng(0)
    previous = rng.normal(size=(16, 64)).astype(np.float32)
    a = np.stack([previous + 0.1 * rng.normal(size=(16, 64)), np.zeros((16, 64))])

    def per_stage(a, previous):
        ns = {"jaxcomm": jaxcomm, "a": a[0], "previous": previous, "seen": True, "s": 0}
        ns["key"] = jax.random.key(1)
        exec(compile(code, "aqsgd.md", "exec"), ns)  # noqa: S102
        nbytes = jnp.asarray(jaxcomm.codecs.payload_bytes(ns["payload"]))
        return ns["h"][None], ns["new_prev"][None], nbytes[None]

    f = jax.jit(
        jax.shard_map(per_stage, mesh=mesh, in_specs=(P("stage"), P()), out_specs=P("stage"))
    )
    h, new_prev, nbytes = f(
        jax.device_put(a.astype(np.float32), NamedSharding(mesh, P("stage"))), previous
    )
    np.testing.assert_array_equal(np.asarray(h)[1], np.asarray(new_prev)[0])
    assert not np.array_equal(np.asarray(h)[1], previous)
    # 3-bit codes of 16 x 64 and one float32 scale per row: the page's formula.
    assert np.asarray(nbytes).tolist() == [16 * 64 * 3 // 8 + 4 * 16] * 2


def _worker(code, page):
    """Build as printed; then the step's lines on every worker inside ``shard_map``, each
    worker with its own parameters, for 10 steps; the loss must fall."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomm
    import models

    build, step = code.split("# inside jax.shard_map")
    step = "\n".join(line for line in step.splitlines()[1:] if not line.startswith("#"))
    rng = np.random.default_rng(0)
    if "x, y)" in step:  # the user's step of user-step.md: linear regression (200 inputs)
        params = {"w": jnp.zeros((200, 1)), "b": jnp.zeros(1)}
        x = rng.normal(size=(8, 10, 8, 200)).astype(np.float32)
        data = (x, x @ rng.normal(size=(200, 1)).astype(np.float32))

        def loss_fn(p, x, y):
            return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

        names = ("x", "y")
    else:  # the README's GPT, four blocks
        task = models.build_task("gpt", num_layers=4, width=32, num_heads=2, seq_len=16)
        tokens = rng.integers(0, 65, size=(8, 10, 4, 17)).astype(np.int32)
        params = task.init(jax.random.key(0), {"tokens": jnp.asarray(tokens[0, 0])})
        data = ({"tokens": tokens},)

        def loss_fn(p, batch):
            return task.loss(p, batch)[0]

        names = ("batch",)
    ns = {"jax": jax, "jaxcomm": jaxcomm, "models": models, "optax": optax}
    ns.update(params=params, loss_fn=loss_fn, batch=jax.tree.map(lambda a: a[0, 0], data[-1]))
    out = __import__("io").StringIO()
    with __import__("contextlib").redirect_stdout(out):
        exec(compile(build, page, "exec"), ns)  # noqa: S102
    for line in build.splitlines():
        if line.startswith("print(") and "  # " in line:
            assert out.getvalue().strip() == line.split("  # ", 1)[1].strip()
    tx = ns["tx"]

    def per_worker(params, *data):
        params = jax.tree.map(lambda a: a[0], params)

        def one_step(carry, t):  # the page's lines, as printed, as one step of a scan
            params, opt_state = carry
            scope = {"jaxcomm": jaxcomm, "optax": optax, "loss_fn": loss_fn, "tx": tx}
            scope.update(params=params, opt_state=opt_state)
            scope.update(zip(names, jax.tree.map(lambda a: a[0, t], data), strict=True))
            exec(compile(step, page, "exec"), scope)  # noqa: S102
            return (scope["params"], scope["opt_state"]), None

        (params, _), _ = jax.lax.scan(one_step, (params, tx.init(params)), jnp.arange(10))
        return jax.tree.map(lambda a: a[None], params)

    mesh = jax.make_mesh((8,), ("data",))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))  # noqa: E731
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (8, *a.shape)), params)
    f = jax.jit(jax.shard_map(per_worker, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    trained = jax.device_get(f(put(stacked), *put(data)))

    def mean_loss(stacked):
        each = []
        for w in range(8):
            mine = jax.tree.map(lambda a, w=w: a[w], stacked)
            each.append(loss_fn(mine, *jax.tree.map(lambda a, w=w: a[w, 0], data)))
        return float(np.mean(each))

    before, after = mean_loss(stacked), mean_loss(trained)
    assert np.isfinite(after) and after < before, (before, after)


_SETTINGS = {
    "docs/library.md#0": _quantize,
    "docs/library.md#1": _ring,
    "docs/library.md#2": _audit,
    "docs/library.md#3": _cost,
    "docs/algorithms/aqsgd.md#0": _aqsgd,
    "docs/algorithms/artopk.md#0": _worker,
    "docs/algorithms/dreamddp.md#0": _worker,
    "docs/algorithms/marsit.md#0": _worker,
    "docs/algorithms/powersgd.md#0": _worker,
    "docs/algorithms/demo.md#0": _worker,
    # Runs for a whole DiLoCo period in tests/test_diloco.py (theta_sync checked).
    "docs/algorithms/diloco.md#0": None,
}


def test_every_fragment_has_a_setting():
    assert sorted(name for name, _ in _fragments()) == sorted(_SETTINGS)


@pytest.mark.parametrize(
    "name, code",
    [pytest.param(*f, id=f[0]) for f in _fragments() if _SETTINGS.get(f[0])],
)
def test_every_fragment_runs_in_its_setting(name, code):
    run = _SETTINGS[name]
    if run is _worker:
        run(code, name)
    else:
        run(code)
