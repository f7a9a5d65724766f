"""The trainer's structure: its modules import each other without a circle (function-local
imports included, ``TYPE_CHECKING`` ones aside), and a layout or a part sees the run's
:class:`~train.context.Context`, never the trainer itself."""

import ast
import inspect
from pathlib import Path

import train.adaptive
import train.checkpoint
import train.context
import train.data_parallel
import train.pipeline_clock
import train.pipeline_feed
import train.pipeline_layout
import train.sync
import train.trainer

TRAIN = Path(train.trainer.__file__).parent


def _imports(path: Path) -> set[str]:
    """Sibling modules ``path`` imports at run time (anywhere in the file, relatively or as
    ``train.<module>``); only the body of an ``if TYPE_CHECKING:`` is left out."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            out.update(n.split(".")[0] for n in names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("train"):
            rest = node.module.split(".")[1:]
            out.update(rest[:1] or [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("train."))
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d) :] + [d]
            if d in graph and d not in state and (found := visit(d)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_circle(tmp_path):
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nfrom .a import x\nif TYPE_CHECKING:\n"
        "    from .b import y\nelse:\n    from .c import z\ndef f():\n"
        "    from train.d import w\n    import train.e\n"
    )
    assert _imports(source) == {"a", "c", "d", "e"}


def test_the_trainer_modules_import_without_a_circle():
    graph = {p.stem: _imports(p) for p in TRAIN.glob("*.py")}
    assert graph["trainer"] >= {"context", "layout", "sync"}  # the finder reads imports
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"


def test_layouts_and_parts_see_the_context_not_the_trainer():
    """No module but the trainer's own callers imports the trainer, and no hook of a
    layout or a part names it."""
    callers = {"trainer", "cli", "estimate", "launch", "__main__"}
    importers = {p.stem for p in TRAIN.glob("*.py") if "trainer" in _imports(p)}
    assert importers <= callers, importers - callers
    classes = [
        train.sync.Part,
        train.sync.Sync,
        train.sync.Controller,
        train.data_parallel.DataParallel,
        train.pipeline_layout.Pipeline,
        train.pipeline_clock.GPipeClock,
        train.pipeline_feed.Feed,
        train.adaptive.AdaptiveRatio,
        *train.trainer.SYNC_PARTS,
    ]
    functions = [f for c in classes for _, f in inspect.getmembers(c, inspect.isfunction)]
    functions += [train.checkpoint.save_run, train.checkpoint.restore_run]
    for fn in functions:
        params = inspect.signature(fn).parameters
        assert not {"t", "trainer"} & set(params), fn
        assert not any("Trainer" in str(p.annotation) for p in params.values()), fn
    hooks = inspect.signature(train.sync.Part.after_step).parameters
    assert hooks["ctx"].annotation in ("Context", train.context.Context)
