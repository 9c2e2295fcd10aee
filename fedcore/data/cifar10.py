"""CIFAR-10 from a local JPEG tarball or from the official pickled python batches.

Two on-disk forms are read (``source`` option; ``auto`` tries them in this order):

- ``jpeg``: ``cifar10-jpeg.tar.gz`` holding ``cifar10-jpeg/{train,test}/<class>/<n>.jpg``. Members are read
  straight from the tar with :mod:`tarfile` and decoded with PIL; class folder names in alphabetical order are
  the official label order (airplane=0 ... truck=9). Decoding all 60,000 images takes ~10 s, so the decoded
  uint8 arrays are cached in-process and, when the ``cache_dir`` option is given, as ``.npy`` files there (never
  inside the shared data folder). With ``max_samples`` and no cache only the chosen images are decoded.
- ``pickle``: ``cifar-10-batches-py/{data_batch_1..5,test_batch}``, the official "python version". These files
  are Python pickles: they are loaded with :mod:`pickle` **only** because they are the user's own local copy of
  the official dataset (or what ``download=True`` fetched from the official site); never point this loader at
  files from an untrusted party — unpickling can execute code.

Registered as dataset ``cifar10``: float32 [N, 3, 32, 32] normalised with the CIFAR-10 channel mean/std (option
``normalize``, default true; false gives [0, 1]), labels 0-9. Own options: ``data_dir``, ``source``,
``cache_dir``, ``download`` (torchvision fetches the pickled batches on a machine with internet), ``pool``
(``all`` pools the 50,000 train and 10,000 test images before partitioning, as LINDT/FL-GUARD allocate all
60,000; ``train`` uses the training images only), ``normalize``, plus the partition options of
:mod:`fedcore.data.loaders`.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import tarfile
import threading
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from fedcore.data.base import DataError, SampleShape
from fedcore.data.loaders import (
    Pool,
    SplitArrays,
    federated_dataset,
    images_to_tensor,
    pool_features,
    pool_labels,
    readonly,
    subsample_positions,
)
from fedcore.data.paths import SHARED_DATA_DIR, download_root, find_dataset_dir, is_inside, missing_message
from fedcore.serialization import atomic_write

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
TARBALL = "cifar10-jpeg.tar.gz"
BATCH_DIR = "cifar-10-batches-py"
BATCH_FILES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5", "test_batch")
SOURCES = ("auto", "jpeg", "pickle")
_HINT = "or pass download=True to fetch CIFAR-10 with torchvision on a machine with internet"
_DECODE_LOCK = threading.Lock()


# ---- JPEG tarball ----

def _member_key(name: str) -> tuple[str, str, str] | None:
    """(split, class, file) of an image member ``.../{train,test}/<class>/<file>.jpg``, else None."""
    parts = PurePosixPath(name).parts
    if len(parts) < 3 or parts[-3] not in ("train", "test"):
        return None
    if not parts[-1].lower().endswith((".jpg", ".jpeg", ".png")):
        return None
    return parts[-3], parts[-2], parts[-1]


@functools.lru_cache(maxsize=4)
def _scan(tar_path: str, stamp: tuple[int, int]) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, tuple[str, ...]]:
    """Member names in canonical order (train then test; by class, then file name), labels, is-test flags."""
    found: list[tuple[int, str, str, str]] = []
    with tarfile.open(tar_path, "r|gz") as tf:
        for m in tf:
            key = _member_key(m.name) if m.isfile() else None
            if key is not None:
                found.append((0 if key[0] == "train" else 1, key[1], key[2], m.name))
    classes = tuple(sorted({f[1] for f in found}))
    if not found:
        raise DataError(f"{tar_path}: no train/<class>/*.jpg or test/<class>/*.jpg members")
    index = {c: i for i, c in enumerate(classes)}
    found.sort(key=lambda f: (f[0], index[f[1]], f[2]))
    names = tuple(f[3] for f in found)
    labels = readonly(np.array([index[f[1]] for f in found], dtype=np.int64))
    is_test = readonly(np.array([f[0] == 1 for f in found], dtype=bool))
    return names, labels, is_test, classes


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def _decode(data: bytes, name: str) -> np.ndarray:
    from PIL import Image  # imported here: only an image archive needs it (a process that never reads one skips it)

    with Image.open(io.BytesIO(data)) as im:
        a = np.asarray(im.convert("RGB"), dtype=np.uint8)
    if a.shape != (32, 32, 3):
        raise DataError(f"{name}: CIFAR-10 images must be 32x32 RGB, got {a.shape}")
    return a


def _decode_members(tar_path: str, names: Iterable[str]) -> np.ndarray:
    """Decode the named members in one streaming pass; returns uint8 [len(names), 32, 32, 3] in that order."""
    order = {n: i for i, n in enumerate(names)}
    out = np.empty((len(order), 32, 32, 3), dtype=np.uint8)
    seen = 0
    with tarfile.open(tar_path, "r|gz") as tf:
        for m in tf:
            i = order.get(m.name)
            if i is None or not m.isfile():
                continue
            f = tf.extractfile(m)
            if f is None:
                raise DataError(f"{tar_path}: cannot read member {m.name}")
            out[i] = _decode(f.read(), m.name)
            seen += 1
            if seen == len(order):
                break
    if seen != len(order):
        raise DataError(f"{tar_path}: {len(order) - seen} members vanished while reading")
    return out


def _check_classes(classes: tuple[str, ...], where: str) -> None:
    if classes != tuple(sorted(CIFAR10_CLASSES)):
        raise DataError(f"{where}: class folders {list(classes)} are not the ten CIFAR-10 classes")


def _cache_files(cache_dir: Path, stamp: tuple[int, int]) -> dict[str, Path]:
    tag = f"cifar10-jpeg-{stamp[0]}"
    return {k: cache_dir / f"{tag}-{k}.npy" for k in ("x_train", "y_train", "x_test", "y_test")}


def _check_cache_dir(cache_dir: Path) -> None:
    if is_inside(cache_dir, SHARED_DATA_DIR.parent):
        raise DataError(f"cache_dir {cache_dir} is inside the shared data folder {SHARED_DATA_DIR.parent}; "
                        "choose a folder of your own")


@functools.lru_cache(maxsize=2)
def _load_jpeg(tar_path: str, stamp: tuple[int, int], cache_dir: str | None) -> SplitArrays:
    files = _cache_files(Path(cache_dir), stamp) if cache_dir else {}
    if files and all(p.exists() for p in files.values()):
        a = {k: np.load(p, allow_pickle=False) for k, p in files.items()}
        return SplitArrays(a["x_train"], a["y_train"], a["x_test"], a["y_test"], CIFAR10_CLASSES)
    names, labels, is_test, classes = _scan(tar_path, stamp)
    _check_classes(classes, tar_path)
    x = _decode_members(tar_path, names)
    arrays = SplitArrays(x[~is_test], labels[~is_test].copy(), x[is_test], labels[is_test].copy(),
                         CIFAR10_CLASSES)
    if files:
        Path(cache_dir or ".").mkdir(parents=True, exist_ok=True)
        for k, p in files.items():
            with atomic_write(p) as f:
                np.save(f, getattr(arrays, k), allow_pickle=False)
    return arrays


@functools.lru_cache(maxsize=4)
def _jpeg_subset(tar_path: str, stamp: tuple[int, int], which: str, max_samples: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The pool subset that :func:`fedcore.data.loaders.subsample_pool` would pick, decoding only it."""
    names, labels, is_test, classes = _scan(tar_path, stamp)
    _check_classes(classes, tar_path)
    positions = np.flatnonzero(~is_test) if which == "train" else np.arange(len(names))
    keep = positions[subsample_positions(len(positions), max_samples, seed)]
    x = _decode_members(tar_path, [names[i] for i in keep])
    return readonly(x), readonly(labels[keep].copy())


# ---- pickled python batches ----

def _unpickle(path: Path) -> dict[bytes, object]:
    # The official CIFAR-10 "python version" is a pickle; see the module docstring for why this is acceptable.
    with open(path, "rb") as f:
        obj = pickle.load(f, encoding="bytes")
    if not isinstance(obj, dict):
        raise DataError(f"{path}: not a CIFAR-10 batch")
    return obj


def _batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    d = _unpickle(path)
    try:
        data = np.asarray(d[b"data"], dtype=np.uint8)
        labels = np.asarray(d[b"labels"], dtype=np.int64)
    except KeyError as e:
        raise DataError(f"{path}: missing key {e}") from None
    if data.ndim != 2 or data.shape[1] != 3072 or len(labels) != len(data):
        raise DataError(f"{path}: expected data [N, 3072] and N labels, got {data.shape} and {labels.shape}")
    return data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1), labels


@functools.lru_cache(maxsize=2)
def _load_pickle(directory: str) -> SplitArrays:
    d = Path(directory)
    train = [_batch(d / f) for f in BATCH_FILES[:5]]
    xte, yte = _batch(d / "test_batch")
    xtr = np.ascontiguousarray(np.concatenate([b[0] for b in train]))
    ytr = np.concatenate([b[1] for b in train])
    return SplitArrays(xtr, ytr, np.ascontiguousarray(xte), yte, CIFAR10_CLASSES)


# ---- locating ----

def _find_tar(data_dir: str | os.PathLike[str] | None) -> Path:
    return find_dataset_dir(data_dir, ("cifar10",), (TARBALL,), "CIFAR-10 (JPEG)", _HINT) / TARBALL


def _find_batches(data_dir: str | os.PathLike[str] | None) -> Path:
    subdirs = (BATCH_DIR, "cifar10", f"cifar10/{BATCH_DIR}")
    return find_dataset_dir(data_dir, subdirs, BATCH_FILES, "CIFAR-10 (pickled batches)", _HINT)


def locate_cifar10(data_dir: str | os.PathLike[str] | None = None, source: str = "auto",
                   download: bool = False) -> tuple[str, Path]:
    """("jpeg", tarball) or ("pickle", batch folder); with ``download`` fetch the batches if nothing is found."""
    if source not in SOURCES:
        raise DataError(f"cifar10: source must be one of {', '.join(SOURCES)}, got {source!r}")
    errors: list[str] = []
    for kind, find in (("jpeg", _find_tar), ("pickle", _find_batches)):
        if source in ("auto", kind):
            try:
                return kind, find(data_dir)
            except DataError as e:
                errors.append(str(e))
    if not download:
        raise DataError(" | ".join(errors))
    if source == "jpeg":
        raise DataError(f"{errors[0]} (download=True fetches the pickled batches: use source='auto' or 'pickle')")
    root = download_root(data_dir)
    # imported here: only a download needs torchvision's datasets
    from torchvision.datasets import CIFAR10  # type: ignore[import-untyped]

    root.mkdir(parents=True, exist_ok=True)
    CIFAR10(str(root), train=True, download=True)
    batches = root / BATCH_DIR
    if not all((batches / f).exists() for f in BATCH_FILES):
        raise DataError(missing_message("CIFAR-10", [batches], BATCH_FILES, "the download did not produce them"))
    return "pickle", batches


def load_cifar10(data_dir: str | os.PathLike[str] | None = None, source: str = "auto",
                 cache_dir: str | os.PathLike[str] | None = None, download: bool = False) -> SplitArrays:
    """All of CIFAR-10 as uint8 images [N, 32, 32, 3] and int64 labels (cached in-process)."""
    kind, path = locate_cifar10(data_dir, source, download)
    if kind == "pickle":
        return _load_pickle(str(path.resolve()))
    cache = _cache_arg(cache_dir)
    return _load_jpeg(str(path.resolve()), _stamp(path), cache)


def _cache_arg(cache_dir: str | os.PathLike[str] | None) -> str | None:
    if cache_dir is None or str(cache_dir) == "":
        return None
    p = Path(cache_dir).expanduser()
    _check_cache_dir(p)
    return str(p.resolve())


def cifar10_to_tensor(x: np.ndarray, normalize: bool = True) -> torch.Tensor:
    """uint8 [N, 32, 32, 3] -> float32 [N, 3, 32, 32], normalised with the CIFAR-10 mean/std by default."""
    return images_to_tensor(x, CIFAR10_MEAN, CIFAR10_STD) if normalize else images_to_tensor(x)


CIFAR10_SAMPLE = SampleShape((3, 32, 32), "float32", 10)


@federated_dataset("cifar10", dataset_options=("data_dir", "source", "cache_dir", "download", "pool", "normalize"),
                   default_partition="iid", remote_options=("pool", "normalize"), sample=CIFAR10_SAMPLE)
def cifar10_pool(seed: int, max_samples: int | None = None, data_dir: str | None = None, source: str = "auto",
                 cache_dir: str | None = None, download: bool = False, pool: str = "all",
                 normalize: bool = True) -> Pool:
    """CIFAR-10 (10 classes, [N, 3, 32, 32] float32); options ``data_dir``, ``source``, ``cache_dir``,
    ``download``, ``pool``, ``normalize``."""

    def convert(x: np.ndarray) -> torch.Tensor:
        return cifar10_to_tensor(x, normalize)

    kind, path = locate_cifar10(data_dir, source, download)
    if pool not in ("all", "train"):
        raise DataError(f"option pool must be 'all' or 'train', got {pool!r}")
    if kind == "jpeg":
        cache = _cache_arg(cache_dir)
        stamp = _stamp(path)
        tar = str(path.resolve())
        if cache is None or not all(p.exists() for p in _cache_files(Path(cache), stamp).values()):
            if max_samples is not None:
                x, y = _jpeg_subset(tar, stamp, pool, max_samples, seed)
                return Pool("cifar10", y, 10, lambda idx: convert(x[np.asarray(idx, dtype=np.int64)]),
                            class_names=CIFAR10_CLASSES)
            # Labels come from the member names; the images are decoded on the first request for features,
            # so that a summary of the partition never decodes them.
            _, labels, is_test, classes = _scan(tar, stamp)
            _check_classes(classes, tar)
            y_pool = readonly(labels.copy() if pool == "all" else labels[~is_test].copy())

            def lazy_features(idx: np.ndarray) -> torch.Tensor:
                with _DECODE_LOCK:
                    arrays = _load_jpeg(tar, stamp, cache)
                return pool_features(arrays.x_train, arrays.x_test, pool, convert)(idx)

            return Pool("cifar10", y_pool, 10, lazy_features, class_names=CIFAR10_CLASSES)
    arrays = load_cifar10(data_dir, source, cache_dir, download)
    return Pool("cifar10", pool_labels(arrays.y_train, arrays.y_test, pool), 10,
                pool_features(arrays.x_train, arrays.x_test, pool, convert), class_names=CIFAR10_CLASSES)
