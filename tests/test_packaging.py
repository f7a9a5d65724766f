"""What the installed library depends on."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_library_uses_only_public_jax():
    """``jax._src`` changes without notice between releases: the library probes features
    through the public API instead (the trainer's multi-process setup is the one place
    that reaches inside, in ``train/distributed.py``)."""
    inside = [p.name for p in (ROOT / "jaxcomm").rglob("*.py") if "jax._src" in p.read_text()]
    assert not inside, inside


def test_every_public_name_resolves_and_moved_names_warn_with_their_new_place():
    import importlib
    import warnings

    import pytest

    import jaxcomm

    for name in jaxcomm.__all__:
        assert getattr(jaxcomm, name) is not None, name
    namespaces = [n for n in jaxcomm.__all__ if isinstance(getattr(jaxcomm, n), type(jaxcomm))]
    assert len(namespaces) >= 10
    for ns in namespaces:
        module = getattr(jaxcomm, ns)
        assert module.__doc__ and len(module.__all__) == len(set(module.__all__)), ns
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{ns}.{name}"
    for old, (where, new) in jaxcomm.MOVED.items():
        with pytest.warns(DeprecationWarning, match=f"jaxcomm.{old} is now {where}.{new}"):
            got = getattr(jaxcomm, old)
        assert got is getattr(importlib.import_module(where), new), old
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new names say nothing
        assert callable(jaxcomm.dense_all_reduce) and callable(jaxcomm.codecs.quantize)
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        jaxcomm.nonesuch  # noqa: B018
