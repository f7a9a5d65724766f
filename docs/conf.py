"""Sphinx configuration: Markdown pages (MyST) and an API reference from the docstrings.

Build: ``sphinx-build -W docs docs/_build/html`` (``tests/test_docs.py`` does, with
warnings as errors). The command line and config reference (``cli.md``) is written from
``train.cli`` at every build, so it follows the code.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jaxcomm"
author = "jaxcomm contributors"
copyright = "jaxcomm contributors, Apache-2.0"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["deflist"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # NamedTuple fields are documented once, by autodoc
html_theme = "sphinx_book_theme"  # JAX's and Flax's
html_title = "jaxcomm"
html_static_path = ["_static"]
html_css_files = ["wrap-code.css"]  # code blocks wrap long lines


def _write_cli_page(app) -> None:
    from train.cli import reference_page

    if os.environ.get("JAXCOMM_DOCS_READ_ONLY"):  # the tests build a checkout as it is
        return
    page = Path(app.srcdir) / "cli.md"
    text = reference_page()
    if not page.exists() or page.read_text() != text:
        page.write_text(text)


def setup(app):
    app.connect("builder-inited", _write_cli_page)
