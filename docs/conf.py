"""Sphinx configuration: Markdown pages (MyST) and an API reference from the docstrings.

Build: ``sphinx-build -W docs docs/_build/html`` (``tests/test_docs.py`` does, with
warnings as errors). The command line and config reference (``cli.md``) is written from
``train.cli``, and the API reference (``api.md``) from ``jaxcomm``'s namespaces
(:func:`api_page`), at every build, so both follow the code.
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


def api_page() -> str:
    """The API reference (``api.md``): the top level's names, then each namespace's
    ``__all__``, in that order, documented from the docstrings."""
    import jaxcomm

    namespaces = [n for n in jaxcomm.__all__ if isinstance(getattr(jaxcomm, n), type(jaxcomm))]
    elsewhere = {n for ns in namespaces for n in getattr(jaxcomm, ns).__all__}
    # A name also in a namespace is documented there (once: Sphinx refuses a duplicate).
    top = [n for n in jaxcomm.__all__ if n not in namespaces and n not in elsewhere]
    parts = [
        "# API reference",
        "",
        "Written from `jaxcomm`'s namespaces at every docs build (`docs/conf.py`, `api_page`);",
        "a test checks that this page is current. What a train step uses is at the top level",
        "(`jaxcomm.ar_topk`, `jaxcomm.diloco`, `jaxcomm.wire_audit`, ...); the rest is in the",
        "namespaces below (`jaxcomm.codecs.quantize`, `jaxcomm.network.Network`, ...). Names",
        "of earlier releases that moved still resolve, with a `DeprecationWarning` that names",
        "their new place (`jaxcomm.MOVED`).",
        "",
        "## `jaxcomm`",
        "",
        "```{eval-rst}",
        ".. automodule:: jaxcomm",
        "   :no-members:",
        "",
        *[f".. autofunction:: jaxcomm.{n}" if callable(getattr(jaxcomm, n))
          and not isinstance(getattr(jaxcomm, n), type) else f".. autoclass:: jaxcomm.{n}"
          for n in top],
        "```",
        "",
    ]  # fmt: skip
    for ns in namespaces:
        parts += [
            f"## `jaxcomm.{ns}`",
            "",
            "```{eval-rst}",
            f".. automodule:: jaxcomm.{ns}",
            "   :members:",
            "```",
            "",
        ]
    return "\n".join(parts).rstrip() + "\n"


def cli_page() -> str:
    """The command line and config reference (``docs/cli.md``), in Markdown: every
    command's ``--help`` and every config key with its default and meaning."""
    import argparse
    import io

    from train.cli import format_default
    from train.cli import parser as train_parser
    from train.config import key_docs
    from train.estimate import parser as estimate_parser
    from train.launch import parser as launch_parser

    def help_text(parser: argparse.ArgumentParser) -> str:
        out = io.StringIO()
        width = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "100"  # the same page whatever the terminal
        try:
            parser.print_help(out)
        finally:
            if width is None:
                os.environ.pop("COLUMNS")
            else:
                os.environ["COLUMNS"] = width
        return out.getvalue().rstrip()

    parts = [
        "# Command line and config reference",
        "",
        "Written from the code at every docs build (`cli_page` in `docs/conf.py`); a",
        "test checks that this page is current.",
        "",
        "## `python -m train`",
        "",
        "```text",
        help_text(train_parser()),
        "```",
        "",
        "## `python -m train.launch`",
        "",
        "```text",
        help_text(launch_parser()),
        "```",
        "",
        "## `python -m train.estimate`",
        "",
        "```text",
        help_text(estimate_parser()),
        "```",
        "",
        "## Config keys",
        "",
        "A YAML config (`--config`) sets any of these; `--set key=value` overrides one (a",
        "nested one as `--set model.width=64`).",
        "",
    ]
    for key, default, text in key_docs():
        parts += [f"`{key}` ({format_default(default, '`')})", f": {text}", ""]
    return "\n".join(parts).rstrip() + "\n"


def write_pages(folder: Path) -> None:
    """Write the generated pages (``cli.md``, ``api.md``) into ``folder`` where they changed."""
    for name, text in (("cli.md", cli_page()), ("api.md", api_page())):
        page = Path(folder) / name
        if not page.exists() or page.read_text() != text:
            page.write_text(text)


def _write_pages(app) -> None:
    if os.environ.get("JAXCOMM_DOCS_READ_ONLY"):  # the tests build a checkout as it is
        return
    write_pages(Path(app.srcdir))


def setup(app):
    app.connect("builder-inited", _write_pages)


if __name__ == "__main__":  # python docs/conf.py: the generated pages without a docs build
    write_pages(Path(__file__).parent)
