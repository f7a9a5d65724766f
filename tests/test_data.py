"""Tests for train/data.py: the embedded corpus, the datasets and the resumable Loader."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from train import data
from train.data import DigitsDataset, Loader, TextDataset, get_dataset, load_corpus, shard

CORPUS_GZ = Path(data.__file__).parent / "data" / "shakespeare.txt.gz"


def _make_corpus_module():
    """Import train/data/make_corpus.py by path (``train.data`` is the module, not the folder)."""
    path = Path(data.__file__).parent / "data" / "make_corpus.py"
    spec = importlib.util.spec_from_file_location("make_corpus", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Range:
    """A minimal dataset: sample i is the integer i."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def get(self, ids):
        return {"ids": np.asarray(ids, dtype=np.int32)}


# --- corpus -------------------------------------------------------------------------------------


def test_corpus_is_ascii_and_documented_size():
    text = load_corpus()
    assert isinstance(text, bytes)
    assert len(text) == data.CORPUS_NUM_BYTES
    assert 1_000_000 <= len(text) <= 1_500_000
    text.decode("ascii")  # raises on any non-ASCII byte
    assert b"\r" not in text
    assert CORPUS_GZ.stat().st_size < 1_000_000


def test_corpus_has_no_gutenberg_boilerplate():
    text = load_corpus().decode("ascii")
    assert not re.search(r"project\s+gutenberg", text, re.IGNORECASE)
    assert not re.search(r"gutenberg|small print|etext", text, re.IGNORECASE)
    assert text.startswith("HAMLET")
    for title in ("MACBETH", "OTHELLO", "ROMEO AND JULIET", "THE TEMPEST", "TWELFTH NIGHT"):
        assert title in text.upper()


def test_corpus_sha256_matches_docstring():
    text = load_corpus()
    digest = hashlib.sha256(text).hexdigest()
    assert digest == data.CORPUS_SHA256
    assert data.CORPUS_SHA256 in data.__doc__
    assert f"{data.CORPUS_NUM_BYTES:,}" in data.__doc__
    gz = CORPUS_GZ.read_bytes()
    assert hashlib.sha256(gz).hexdigest() in data.__doc__
    assert f"{len(gz):,}" in data.__doc__
    assert gz[4:8] == b"\0\0\0\0"  # gzip header mtime is 0: reproducible


def test_make_corpus_strips_boilerplate_and_non_ascii(tmp_path):
    mc = _make_corpus_module()
    raw = (
        "The Project Gutenberg EBook of Hamlet\r\nLicence text.\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\n"
        "HAMLET\r\nTo be, or not to be \u2014 that\u2019s the question.  \r\nCaf\u00e9\r\n\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nMore licence.\r\n"
    ).encode()
    assert mc.clean_play(raw) == "HAMLET\nTo be, or not to be -- that's the question.\nCafe\n"
    out = tmp_path / "c.gz"
    mc.write_gzip(b"abc\n", out)
    first = out.read_bytes()
    mc.write_gzip(b"abc\n", out)
    assert out.read_bytes() == first
    assert gzip.decompress(first) == b"abc\n"


# --- TextDataset ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len, valid_fraction", [(64, 0.1), (127, 0.25), (1, 0.5)])
def test_text_splits_are_disjoint_and_cover_the_expected_ranges(seq_len, valid_fraction):
    n = len(load_corpus())
    tr = TextDataset(seq_len, "train", valid_fraction)
    va = TextDataset(seq_len, "valid", valid_fraction)
    n_train = int(n * (1 - valid_fraction))
    window = seq_len + 1
    assert (tr.start, tr.stop) == (0, n_train)
    assert (va.start, va.stop) == (n_train, n)
    assert len(tr) == n_train // window
    assert len(va) == (n - n_train) // window
    # byte ranges actually used by the windows
    assert tr.start + len(tr) * window <= va.start
    assert va.start + len(va) * window <= n
    assert n_train - len(tr) * window < window  # only a partial window is unused


def test_text_get_returns_exact_corpus_bytes():
    text = load_corpus()
    for split in ("train", "valid"):
        ds = TextDataset(seq_len=32, split=split)
        ids = np.array([0, 1, len(ds) // 2, len(ds) - 1])
        out = ds.get(ids)
        assert out["ids"].dtype == np.int32 and out["tokens"].dtype == np.int32
        assert out["tokens"].shape == (4, 33)
        np.testing.assert_array_equal(out["ids"], ids)
        for i, row in zip(ids, out["tokens"], strict=True):
            lo = ds.start + int(i) * 33
            assert bytes(row.astype(np.uint8)) == text[lo : lo + 33]
    assert TextDataset.vocab_size == 256


def test_text_tokens_in_vocab():
    ds = TextDataset(seq_len=255, split="valid")
    tokens = ds.get(np.arange(len(ds)))["tokens"]
    assert tokens.min() >= 0 and tokens.max() < ds.vocab_size


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seq_len": 0}, r"seq_len must be an integer >= 1, got 0"),
        ({"seq_len": -3}, r"seq_len .* got -3"),
        ({"seq_len": 2.5}, r"seq_len .* got 2\.5"),
        ({"seq_len": 10**7}, r"seq_len=10000000 leaves no sample"),
        ({"split": "test"}, r"split must be one of \('train', 'valid'\), got 'test'"),
        ({"valid_fraction": 0.0}, r"valid_fraction must be .*\(0, 1\), got 0\.0"),
        ({"valid_fraction": 1.0}, r"valid_fraction .* got 1\.0"),
        ({"valid_fraction": float("nan")}, r"valid_fraction .* got nan"),
    ],
)
def test_text_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TextDataset(**kwargs)


def test_get_rejects_out_of_range_ids():
    ds = TextDataset(seq_len=64, split="valid")
    n = len(ds)
    with pytest.raises(ValueError, match=rf"ids must lie in \[0, {n}\), got id {n} "):
        ds.get(np.array([0, n]))
    with pytest.raises(ValueError, match=rf"ids must lie in \[0, {n}\), got id -1 "):
        ds.get(np.array([-1]))
    with pytest.raises(ValueError, match=r"ids must be integers, got dtype float64"):
        ds.get(np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"ids must be a 1-D array"):
        ds.get(np.zeros((2, 2), dtype=np.int64))
    d = DigitsDataset(split="valid")
    with pytest.raises(ValueError, match=rf"\[0, {len(d)}\), got id {len(d) + 5} "):
        d.get(np.array([len(d) + 5]))


# --- DigitsDataset -------------------------------------------------------------------------------


def test_digits_split_is_a_fixed_partition():
    tr, va = DigitsDataset("train"), DigitsDataset("valid")
    assert len(tr) + len(va) == 1797
    assert len(tr) == int(1797 * 0.8)
    both = np.concatenate([tr.indices, va.indices])
    np.testing.assert_array_equal(np.sort(both), np.arange(1797))
    np.testing.assert_array_equal(tr.indices, DigitsDataset("train").indices)
    assert not np.array_equal(tr.indices, DigitsDataset("train", seed=1).indices)


def test_digits_get_shapes_and_values():
    from sklearn.datasets import load_digits

    ds = DigitsDataset("valid", valid_fraction=0.3, seed=3)
    ids = np.array([0, 5, len(ds) - 1])
    out = ds.get(ids)
    assert out["image"].shape == (3, 8, 8, 1) and out["image"].dtype == np.float32
    assert out["label"].dtype == np.int32 and out["ids"].dtype == np.int32
    assert 0.0 <= out["image"].min() and out["image"].max() <= 1.0
    ref = load_digits()
    rows = ds.indices[ids]
    np.testing.assert_allclose(out["image"][..., 0], ref.images[rows] / 16.0, rtol=1e-6)
    np.testing.assert_array_equal(out["label"], ref.target[rows])


def test_digits_and_get_dataset_bad_arguments():
    with pytest.raises(ValueError, match=r"split must be one of .* got 'eval'"):
        DigitsDataset("eval")
    with pytest.raises(ValueError, match=r"valid_fraction .* got 1\.5"):
        DigitsDataset(valid_fraction=1.5)
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got -1"):
        DigitsDataset(seed=-1)
    with pytest.raises(
        ValueError,
        match=r"name must be one of \('shakespeare', 'shakespeare_complete', 'digits', "
        r"'synthetic_imagenet'\)",
    ):
        get_dataset("x", "train")
    assert isinstance(get_dataset("digits", "valid"), DigitsDataset)
    ds = get_dataset("shakespeare", "train", seq_len=16)
    assert isinstance(ds, TextDataset) and ds.seq_len == 16


# --- Loader --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_loader_visits_every_sample_once_per_epoch(shuffle):
    ds = _Range(103)
    loader = Loader(ds, 10, seed=7, shuffle=shuffle)
    assert loader.batches_per_epoch == 10
    epochs = []
    for _ in range(3):
        ids = np.concatenate([loader.next()["ids"] for _ in range(loader.batches_per_epoch)])
        assert len(ids) == 100 and len(np.unique(ids)) == 100  # 3 dropped, none repeated
        epochs.append(ids)
    assert loader.position == 30 and loader.epoch == 3
    if shuffle:
        assert not np.array_equal(epochs[0], epochs[1])
        expected = np.random.default_rng([7, 1]).permutation(103)[:100]
        np.testing.assert_array_equal(epochs[1], expected)
    else:
        for ids in epochs:
            np.testing.assert_array_equal(ids, np.arange(100))


def test_loader_full_epoch_on_real_dataset():
    ds = DigitsDataset("train")
    loader = Loader(ds, 64, seed=0, num_shards=8)
    seen = np.concatenate([next(loader)["ids"] for _ in range(loader.batches_per_epoch)])
    assert len(seen) == len(np.unique(seen)) == loader.batches_per_epoch * 64
    assert set(seen.tolist()) <= set(range(len(ds)))


def test_same_seed_same_batches_different_seed_different():
    ds = TextDataset(seq_len=32, split="valid")
    a, b, c = Loader(ds, 16, seed=3), Loader(ds, 16, seed=3), Loader(ds, 16, seed=4)
    for _ in range(5):
        ba, bb = a.next(), b.next()
        for key in ba:
            np.testing.assert_array_equal(ba[key], bb[key])
    assert not np.array_equal(a.next()["ids"], c.next()["ids"])


def test_iter_yields_next_batches():
    ref, it = Loader(_Range(20), 4, seed=1), Loader(_Range(20), 4, seed=1)
    for _, batch in zip(range(12), it, strict=False):  # range first: zip stops before pulling
        np.testing.assert_array_equal(batch["ids"], ref.next()["ids"])
    assert it.position == 12


def _assert_resume_matches(dataset, global_batch: int, seed: int, p: int, k: int = 4):
    ran = Loader(dataset, global_batch, seed=seed)
    for _ in range(p):
        ran.next()
    state = ran.state()
    assert state == {"position": p, "seed": seed}
    restored = Loader(dataset, global_batch, seed=seed)
    restored.restore(state)
    constructed = Loader(dataset, global_batch, seed=seed, position=p)
    for _ in range(k):
        expected = ran.next()
        for other in (restored.next(), constructed.next()):
            assert other.keys() == expected.keys()
            for key in expected:
                np.testing.assert_array_equal(other[key], expected[key])


@pytest.mark.parametrize("p", [0, 1, 6, 7, 22])
def test_restore_gives_same_following_batches(p):
    _assert_resume_matches(DigitsDataset("train"), 192, seed=5, p=p)  # 7 batches per epoch


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    batch=st.integers(1, 60),
    seed=st.integers(0, 2**32),
    frac=st.floats(0, 1, exclude_max=True),
)
def test_resume_at_any_position_in_three_epochs(n, batch, seed, frac):
    batch = min(batch, n)
    bpe = n // batch
    p = int(frac * 3 * bpe)
    _assert_resume_matches(_Range(n), batch, seed=seed, p=p, k=bpe + 1)


def test_restore_rejects_other_seed_and_bad_state():
    loader = Loader(_Range(10), 2, seed=1)
    with pytest.raises(ValueError, match=r"state\['seed'\]=2 differs from this loader's seed=1"):
        loader.restore({"position": 3, "seed": 2})
    with pytest.raises(ValueError, match=r"missing \['position'\]"):
        loader.restore({"seed": 1})
    with pytest.raises(ValueError, match=r"state\['position'\] must be an integer >= 0, got -1"):
        loader.restore({"position": -1, "seed": 1})
    assert loader.position == 0
    loader.restore({"position": np.int64(4), "seed": np.asarray(1)})
    assert loader.position == 4


@pytest.mark.parametrize(
    "global_batch, num_shards, match",
    [
        (0, 1, r"global_batch must be a positive multiple of num_shards=1 .* got 0"),
        (-4, 2, r"global_batch .* got -4"),
        (12, 8, r"global_batch must be a positive multiple of num_shards=8 .* got 12"),
        (11, 1, r"at most len\(dataset\)=10, got 11"),
        (2.0, 1, r"global_batch .* got 2\.0"),
        (4, 0, r"num_shards must be an integer >= 1, got 0"),
    ],
)
def test_loader_bad_batch_arguments(global_batch, num_shards, match):
    with pytest.raises(ValueError, match=match):
        Loader(_Range(10), global_batch, num_shards=num_shards)


def test_loader_bad_seed_and_position():
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got -1"):
        Loader(_Range(10), 2, seed=-1)
    with pytest.raises(ValueError, match=r"position must be an integer >= 0, got -2"):
        Loader(_Range(10), 2, position=-2)


def test_shard_splits_leading_axis_in_order():
    loader = Loader(DigitsDataset("train"), 64, num_shards=8)
    batch = loader.next()
    sharded = Loader.shard(batch, 8)
    assert sharded["image"].shape == (8, 8, 8, 8, 1)
    assert sharded["label"].shape == (8, 8)
    np.testing.assert_array_equal(sharded["ids"][3], batch["ids"][24:32])
    assert shard is Loader.shard
    with pytest.raises(ValueError, match=r"leading dimension must be a multiple of num_shards=5"):
        shard(batch, 5)
    with pytest.raises(ValueError, match=r"num_shards must be an integer >= 1, got 0"):
        shard(batch, 0)


def test_synthetic_imagenet_is_deterministic_and_imagenet_shaped():
    from train.data import SyntheticImages

    train = get_dataset("synthetic_imagenet", "train")
    assert len(train) == 1_281_167 and len(get_dataset("synthetic_imagenet", "valid")) == 50_000
    a = train.get(np.array([0, 7]))
    b = SyntheticImages("train").get(np.array([7]))
    assert a["image"].shape == (2, 224, 224, 3) and a["image"].dtype == np.float32
    np.testing.assert_array_equal(a["image"][1], b["image"][0])
    assert 0 <= a["label"].min() and a["label"].max() < 1000
    assert not np.array_equal(a["image"][0], a["image"][1])
    with pytest.raises(ValueError):
        train.get(np.array([len(train)]))


def test_the_complete_works_are_the_documented_text_in_three_splits():
    """The complete works decompress to the recorded size and sha256 (the docstring states
    both), ``make_corpus.py --complete``'s output; its splits cover the text once; a test
    split is refused on the datasets that have none, naming the one that does."""
    text = load_corpus(complete=True)
    assert len(text) == data.COMPLETE_NUM_BYTES and f"{data.COMPLETE_NUM_BYTES:,}" in data.__doc__
    assert hashlib.sha256(text).hexdigest() == data.COMPLETE_SHA256 in data.__doc__
    assert len(text) > 3.5 * len(load_corpus())
    splits = {s: get_dataset("shakespeare_complete", s, seq_len=64) for s in data.HELD_OUT_SPLITS}
    blocks = sorted(b for d in splits.values() for b in d.blocks)
    assert blocks == list(range(-(-len(text) // 65_536)))
    window = splits["test"].get(np.array([0]))["tokens"][0].astype(np.uint8).tobytes()
    first = splits["test"].blocks[0] * 65_536
    assert text[first : first + 65] == window  # sample 0 of a split: its first block's start
    with pytest.raises(ValueError, match="only shakespeare_complete has a test split"):
        get_dataset("shakespeare", "test", seq_len=64)
