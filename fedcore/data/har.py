"""Smartphone human-activity recognition (UCI HAPT), one client per volunteer.

Reads ``hapt_windows.npz`` (``x`` float16 [N, 128, 6]: accelerometer xyz and gyroscope xyz at 50 Hz in
128-sample windows; ``y`` activity 0-5; ``client`` volunteer id 1-30). Registered as dataset ``har``: x float32
[N, 6, 128] (channels first, for 1-D convolutions), y int64 0-5. Default partition ``natural``: client index i
is the i-th volunteer in id order (index 0 = volunteer 1). Own option: ``data_dir``.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch

from fedcore.data.base import DataError, SampleShape
from fedcore.data.loaders import Pool, federated_dataset, readonly
from fedcore.data.paths import find_dataset_dir

HAR_FILE = "hapt_windows.npz"
HAR_CLASSES = ("walking", "walking_upstairs", "walking_downstairs", "sitting", "standing", "laying")


@functools.lru_cache(maxsize=2)
def _load(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as d:
        missing = {"x", "y", "client"} - set(d.files)
        if missing:
            raise DataError(f"{path}: missing arrays {sorted(missing)}")
        x, y, c = d["x"], d["y"].astype(np.int64), d["client"].astype(np.int64)
    if x.ndim != 3 or x.shape[2] != 6 or not len(x) == len(y) == len(c):
        raise DataError(f"{path}: expected x [N, T, 6], y [N], client [N]; got {x.shape}, {y.shape}, {c.shape}")
    if y.min() < 0 or y.max() >= len(HAR_CLASSES):
        raise DataError(f"{path}: activity labels must be in 0..{len(HAR_CLASSES) - 1}")
    return readonly(x), readonly(y), readonly(c)


def load_har(data_dir: str | os.PathLike[str] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x float16 [N, 128, 6], y int64, volunteer int64), cached in-process."""
    d = find_dataset_dir(data_dir, ("har",), (HAR_FILE,), "HAR")
    return _load(str((Path(d) / HAR_FILE).resolve()))


def har_to_tensor(x: np.ndarray) -> torch.Tensor:
    """float16 [N, T, 6] -> float32 [N, 6, T]."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(x, dtype=np.float32).transpose(0, 2, 1)))


HAR_SAMPLE = SampleShape((6, 128), "float32", len(HAR_CLASSES))  # the windows of hapt_windows.npz, channels first


@federated_dataset("har", dataset_options=("data_dir",), default_partition="natural", sample=HAR_SAMPLE)
def har_pool(seed: int, max_samples: int | None = None, data_dir: str | None = None) -> Pool:
    """HAR by volunteer (6 classes, x float32 [N, 6, 128]); option ``data_dir``."""
    x, y, volunteer = load_har(data_dir)
    return Pool("har", y, len(HAR_CLASSES), lambda idx: har_to_tensor(x[np.asarray(idx, dtype=np.int64)]),
                groups=volunteer, class_names=HAR_CLASSES, group_kind="volunteer",
                group_names={int(v): f"volunteer{int(v)}" for v in np.unique(volunteer)})
