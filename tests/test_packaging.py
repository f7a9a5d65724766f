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


def _python(args, *, cwd, env=None, timeout=600):
    import os
    import subprocess
    import sys

    full = dict(os.environ, **(env or {}))
    r = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout


def test_the_library_imports_without_the_trainers_dependencies(tmp_path):
    """``pip install jaxcomm`` without the ``train`` extra has none of these: importing the
    library and every public namespace must not need them."""
    code = """
import sys
TRAINER_ONLY = {"matplotlib", "sklearn", "yaml", "tqdm", "pydantic", "orbax"}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in TRAINER_ONLY:
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, Refuse())
import jaxcomm
for name in jaxcomm.__all__:
    getattr(jaxcomm, name)
import jaxcomm.pipeline, jaxcomm.compute
print(sorted(m for m in sys.modules if m.split(".")[0] in TRAINER_ONLY))
"""
    out = _python(["-c", code], cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    assert out.strip() == "[]", out


def test_the_wheel_puts_no_generic_name_in_site_packages_and_runs_outside_a_checkout(tmp_path):
    """The built wheel holds ``jaxcomm`` and ``jaxcomm_train`` (with its models, configs and
    corpus) and nothing named ``train`` or ``models``; its base requirements are the library's,
    the trainer's sit in the ``train`` extra; installed into a folder away from any checkout,
    the trainer finds its shipped configs and corpus and imports no top-level ``train`` or
    ``models``."""
    import email
    import shutil
    import zipfile

    src = tmp_path / "src"
    for name in ("jaxcomm", "train", "models", "configs"):
        shutil.copytree(
            ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    _python(
        ["-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", "dist"],
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("jaxcomm-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(meta_name))
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"jaxcomm", "jaxcomm_train"}, tops
    assert "jaxcomm_train/models/gpt.py" in names
    assert "jaxcomm_train/configs/dp_default.yaml" in names
    assert "jaxcomm_train/data/shakespeare.txt.gz" in names
    base = [r.split(";")[0] for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    trainer = [r for r in meta.get_all("Requires-Dist") if 'extra == "train"' in r]
    for dep in ("matplotlib", "scikit-learn", "pyyaml", "tqdm", "pydantic", "orbax"):
        assert not any(dep in r.lower() for r in base), (dep, base)
        assert any(dep in r.lower() for r in trainer), (dep, trainer)

    site = tmp_path / "site"
    _python(
        ["-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], cwd=tmp_path
    )
    away = tmp_path / "elsewhere"
    away.mkdir()
    code = """
import sys
import jaxcomm, jaxcomm_train
from jaxcomm_train import cli, config, data, trainer
assert jaxcomm_train.__file__.startswith(sys.argv[1]), jaxcomm_train.__file__
cfg = config.load_config(cli.resolve_config("dp_default.yaml"))
assert len(data.load_corpus()) > 100_000
assert "aggregator" in cli.list_keys()
assert cli.parser().format_usage().startswith("usage: python -m jaxcomm_train ")
print(sorted(m for m in sys.modules if m.split(".")[0] in {"train", "models"}), cfg.model.key)
"""
    out = _python(["-c", code, str(site)], cwd=away, env={"PYTHONPATH": str(site)})
    assert out.split() == ["[]", "gpt"], out
