"""The documentation: it builds with warnings as errors (links between pages included),
every complete ``python`` block in it and in the README runs as printed, its command line
reference is current, and every relative link points at a file that exists."""

import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from tests.test_trainer import ROOT
from train.cli import reference_page

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if "_build" not in p.parts]
# ```python blocks are complete programs and run here; ```py blocks are fragments of a step
# (highlighted, not run; the long ones run in their own tests with the setup they need).
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


def test_the_cli_reference_page_is_current():
    assert (ROOT / "docs" / "cli.md").read_text() == reference_page(), (
        "docs/cli.md is stale: a docs build (sphinx-build docs ...) rewrites it"
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
    for name in ("ec_quantized_allreduce", "diloco", "wire_audit", "ring_all_reduce"):
        assert name in api
