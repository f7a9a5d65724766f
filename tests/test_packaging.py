"""What the installed library depends on."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_library_uses_only_public_jax():
    """``jax._src`` changes without notice between releases: the library probes features
    through the public API instead (the trainer's multi-process setup is the one place
    that reaches inside, in ``train/distributed.py``)."""
    inside = [p.name for p in (ROOT / "jaxcomm").rglob("*.py") if "jax._src" in p.read_text()]
    assert not inside, inside
