"""Users' own data: an ``.npz`` file of arrays, or a folder of images ``root/<class>/*.png|jpg``.

- ``npz``: arrays ``x`` (features, any shape), ``y`` (integer labels) and optionally ``client`` (a natural client id
  per sample; then the default partition is ``natural``, else ``iid``). Loaded with ``allow_pickle=False``.
  ``x_dtype``: ``auto`` (floats -> float32, uint8 -> float32 scaled to [0, 1], other integers -> int64 tokens),
  ``float32`` or ``int64``. ``num_classes`` defaults to max(y) + 1.
- ``imagefolder``: class = sub-folder name, classes in alphabetical order (as torchvision's ImageFolder); images are
  decoded once with PIL (``mode`` ``RGB`` or ``L``, optional square resize ``image_size``) to float32 [N, C, H, W]
  in [0, 1], optionally normalised with ``mean``/``std``. Images of different sizes need ``image_size``.

Both take ``path`` (relative paths are resolved against ``data_dir`` when it is given) and the partition options
of :mod:`fedcore.data.loaders`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedcore.data.base import DataError, SampleShape, size_option
from fedcore.data.loaders import Pool, federated_dataset, images_to_tensor, readonly

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
X_DTYPES = ("auto", "float32", "int64")


def _resolve(path: str | None, data_dir: str | None, what: str) -> Path:
    if not path:
        raise DataError(f"{what}: give the option path=... (the file or folder with your data)")
    p = Path(path).expanduser()
    if not p.is_absolute() and data_dir:
        p = Path(data_dir).expanduser() / p
    if not p.exists():
        raise DataError(f"{what}: {p} does not exist")
    return p.resolve()


# ---- npz ----

@functools.lru_cache(maxsize=4)
def _load_npz(path: str, stamp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    try:
        with np.load(path, allow_pickle=False) as d:
            if "x" not in d.files or "y" not in d.files:
                raise DataError(f"{path}: an npz dataset needs arrays 'x' and 'y', found {d.files}")
            x, y = d["x"], d["y"]
            c = d["client"] if "client" in d.files else None
    except ValueError as e:
        raise DataError(f"{path}: cannot read as npz without pickle ({e})") from None
    if y.ndim != 1 or len(x) != len(y) or (c is not None and c.shape != y.shape):
        raise DataError(f"{path}: need x [N, ...], y [N] and client [N]; got {x.shape}, {y.shape}, "
                        f"{None if c is None else c.shape}")
    if not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise DataError(f"{path}: labels y must be non-negative integers")
    groups = None if c is None else readonly(np.asarray(c).astype(np.int64))
    return readonly(x), readonly(y.astype(np.int64)), groups


def npz_to_tensor(x: np.ndarray, x_dtype: str = "auto") -> torch.Tensor:
    """Convert features per ``x_dtype`` (see the module docstring)."""
    a = np.asarray(x)
    if x_dtype == "float32" or (x_dtype == "auto" and np.issubdtype(a.dtype, np.floating)):
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    if x_dtype == "auto" and a.dtype == np.uint8:
        return torch.from_numpy(a.astype(np.float32) / np.float32(255.0))
    if x_dtype in ("auto", "int64") and (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        return torch.from_numpy(a.astype(np.int64))
    raise DataError(f"npz: cannot convert features of dtype {a.dtype} with x_dtype={x_dtype!r}")


@federated_dataset("npz", dataset_options=("path", "data_dir", "x_dtype", "num_classes"), default_partition="auto",
                   remote_options=("x_dtype", "num_classes"))
def npz_pool(seed: int, max_samples: int | None = None, path: str | None = None, data_dir: str | None = None,
             x_dtype: str = "auto", num_classes: int | None = None) -> Pool:
    """Your arrays from an ``.npz`` (x, y, optional client); options ``path``, ``data_dir``, ``x_dtype``,
    ``num_classes``."""
    if x_dtype not in X_DTYPES:
        raise DataError(f"npz: x_dtype must be one of {', '.join(X_DTYPES)}, got {x_dtype!r}")
    p = _resolve(path, data_dir, "npz")
    x, y, groups = _load_npz(str(p), p.stat().st_mtime_ns)
    c = int(y.max()) + 1 if len(y) else 0
    if num_classes is not None:
        if num_classes < c:
            raise DataError(f"npz: num_classes={num_classes} but labels go up to {c - 1}")
        c = int(num_classes)
    return Pool("npz", y, c, lambda idx: npz_to_tensor(x[np.asarray(idx, dtype=np.int64)], x_dtype),
                groups=groups, class_names=tuple(str(i) for i in range(c)), group_kind="client")


# ---- image folder ----

def image_folder_files(root: Path) -> tuple[tuple[str, ...], list[tuple[Path, int]]]:
    """(class names in alphabetical order, [(file, label)] sorted by class then path)."""
    classes = tuple(sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")))
    if not classes:
        raise DataError(f"imagefolder: {root} has no class sub-folders (expected root/<class>/*.png|jpg)")
    files = [(f, label) for label, c in enumerate(classes) for f in sorted((root / c).rglob("*"))
             if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise DataError(f"imagefolder: no images ({', '.join(IMAGE_SUFFIXES)}) under {root}")
    return classes, files


@functools.lru_cache(maxsize=4)
def _load_images(root: str, mode: str, image_size: int | None) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    from PIL import Image  # imported here: only an image folder needs it (a process that never reads one skips it)

    classes, files = image_folder_files(Path(root))
    arrays = []
    for f, _ in files:
        with Image.open(f) as im:
            im2 = im.convert(mode)
            if image_size is not None and im2.size != (image_size, image_size):
                im2 = im2.resize((image_size, image_size), Image.Resampling.BILINEAR)
            arrays.append(np.asarray(im2, dtype=np.uint8))
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise DataError(f"imagefolder: images under {root} differ in size ({sorted(shapes)[:3]} ...); "
                        "set the option image_size")
    x = np.stack(arrays)
    y = np.array([label for _, label in files], dtype=np.int64)
    return readonly(x), readonly(y), classes


def imagefolder_sample(options: Mapping[str, Any]) -> SampleShape | None:
    """With ``image_size``: 1 (mode L) or 3 (RGB) channels of image_size x image_size; without, the images tell
    (and the classes are the folders: only the data tells)."""
    if options.get("image_size") is None or options.get("mode") not in ("RGB", "L"):
        return None
    side = size_option(options["image_size"])
    return SampleShape((1 if options["mode"] == "L" else 3, side, side), "float32", None)


@federated_dataset("imagefolder", dataset_options=("path", "data_dir", "mode", "image_size", "mean", "std"),
                   default_partition="iid", remote_options=("mode", "image_size", "mean", "std"),
                   sample=imagefolder_sample)
def imagefolder_pool(seed: int, max_samples: int | None = None, path: str | None = None,
                     data_dir: str | None = None, mode: str = "RGB", image_size: int | None = None,
                     mean: Sequence[float] | None = None, std: Sequence[float] | None = None) -> Pool:
    """Images in ``path/<class>/*``; options ``path``, ``data_dir``, ``mode``, ``image_size``, ``mean``, ``std``."""
    if mode not in ("RGB", "L"):
        raise DataError(f"imagefolder: mode must be 'RGB' or 'L', got {mode!r}")
    if image_size is not None and image_size < 1:
        raise DataError(f"imagefolder: image_size must be >= 1, got {image_size}")
    if (mean is None) != (std is None):
        raise DataError("imagefolder: give both mean and std, or neither")
    p = _resolve(path, data_dir, "imagefolder")
    x, y, classes = _load_images(str(p), mode, image_size)
    channels = 1 if mode == "L" else 3
    if mean is not None and std is not None and not len(mean) == len(std) == channels:
        raise DataError(f"imagefolder: mean and std need {channels} values for mode {mode}")

    def features(idx: np.ndarray) -> torch.Tensor:
        return images_to_tensor(x[np.asarray(idx, dtype=np.int64)], mean, std)

    return Pool("imagefolder", y, len(classes), features, class_names=classes)
