"""MNIST from the four official IDX files (gzipped or not), read from a local directory.

Registered as dataset ``mnist``: images float32 in [0, 1], shape [N, 1, 28, 28], labels 0-9. Own options:
``data_dir`` (folder holding the IDX files, or a folder with an ``mnist/`` or ``MNIST/raw/`` subfolder),
``download`` (fetch with torchvision on a machine with internet), ``pool`` (``all``: the 70,000 train and test
images are pooled before partitioning, as HYDRA-FL does; ``train``: the 60,000 training images only), plus
the partition options of :mod:`fedcore.data.loaders`.
"""

from __future__ import annotations

import functools
import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch

from fedcore.data.base import DataError, SampleShape
from fedcore.data.loaders import Pool, SplitArrays, federated_dataset, images_to_tensor, pool_features, pool_labels
from fedcore.data.paths import download_root, find_dataset_dir

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
               "t10k-labels-idx1-ubyte")
MNIST_CLASSES = tuple(str(d) for d in range(10))
_SUBDIRS = ("mnist", "MNIST/raw", "MNIST")
_IDX_DTYPES: dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_HINT = "or pass download=True to fetch MNIST with torchvision on a machine with internet"


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """An IDX file (LeCun's format; ``.gz`` is decompressed) as a numpy array in native byte order."""
    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{p}: not an IDX file")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    count = int(np.prod(dims)) if dims else 1
    body = raw[4 + 4 * ndim :]
    if len(body) != count * dtype.itemsize:
        raise DataError(f"{p}: header announces {dims} but the file holds {len(body)} data bytes")
    return np.frombuffer(body, dtype=dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _file(d: Path, name: str) -> Path:
    plain = d / name
    return plain if plain.exists() else d / f"{name}.gz"


@functools.lru_cache(maxsize=4)
def _load_dir(directory: str) -> SplitArrays:
    d = Path(directory)
    xtr, ytr, xte, yte = (read_idx(_file(d, f)) for f in MNIST_FILES)
    if xtr.shape[1:] != (28, 28) or xte.shape[1:] != (28, 28):
        raise DataError(f"{d}: MNIST images must be 28x28, got {xtr.shape[1:]} and {xte.shape[1:]}")
    return SplitArrays(xtr, ytr.astype(np.int64), xte, yte.astype(np.int64), MNIST_CLASSES)


def mnist_dir(data_dir: str | os.PathLike[str] | None = None, download: bool = False) -> Path:
    """The folder holding the IDX files; with ``download`` fetch them first if they are nowhere to be found."""
    try:
        return find_dataset_dir(data_dir, _SUBDIRS, MNIST_FILES, "MNIST", _HINT)
    except DataError:
        if not download:
            raise
    root = download_root(data_dir)
    # imported here: only a download needs torchvision's datasets
    from torchvision.datasets import MNIST  # type: ignore[import-untyped]

    root.mkdir(parents=True, exist_ok=True)
    MNIST(str(root), train=True, download=True)
    return find_dataset_dir(root, _SUBDIRS, MNIST_FILES, "MNIST", _HINT)


def load_mnist(data_dir: str | os.PathLike[str] | None = None, download: bool = False) -> SplitArrays:
    """MNIST as uint8 images [N, 28, 28] and int64 labels, cached in-process per directory."""
    return _load_dir(str(mnist_dir(data_dir, download).resolve()))


def mnist_to_tensor(x: np.ndarray) -> torch.Tensor:
    """uint8 [N, 28, 28] -> float32 [N, 1, 28, 28] in [0, 1]."""
    return images_to_tensor(x)


MNIST_SAMPLE = SampleShape((1, 28, 28), "float32", 10)


@federated_dataset("mnist", dataset_options=("data_dir", "download", "pool"), default_partition="iid",
                   remote_options=("pool",), sample=MNIST_SAMPLE)
def mnist_pool(seed: int, max_samples: int | None = None, data_dir: str | None = None, download: bool = False,
               pool: str = "all") -> Pool:
    """MNIST (10 classes, [N, 1, 28, 28] float32 in [0, 1]); options ``data_dir``, ``download``, ``pool``."""
    arrays = load_mnist(data_dir, download)
    return Pool("mnist", pool_labels(arrays.y_train, arrays.y_test, pool), 10,
                pool_features(arrays.x_train, arrays.x_test, pool, mnist_to_tensor), class_names=MNIST_CLASSES)
