"""Loaders on small files made by the tests themselves: IDX (MNIST layout), CIFAR-10 JPEG tarball and pickled
batches, npz, image folders; data-dir resolution, error messages and the summary CLI. No network, no shared data."""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedcore.data import DataError, available_datasets, load_client_data
from fedcore.data.cifar10 import CIFAR10_CLASSES, load_cifar10
from fedcore.data.loaders import client_types, describe_partition, num_clients_of
from fedcore.data.mnist import load_mnist, read_idx
from fedcore.data.paths import ENV_VAR
from fedcore.data.summary import main as summary_main


def test_every_dataset_is_registered() -> None:
    assert {"mnist", "cifar10", "shakespeare", "har", "npz", "imagefolder", "synthetic"} <= set(available_datasets())


# ---- MNIST layout ----

def _idx_bytes(a: np.ndarray) -> bytes:
    code = {np.dtype(np.uint8): 0x08}[a.dtype]
    return bytes([0, 0, code, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()


def _fake_mnist(d: Path, n_train: int = 40, n_test: int = 20, gz: bool = True) -> None:
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for name, a in arrays.items():
        raw = _idx_bytes(a)
        if gz:
            (d / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (d / name).write_bytes(raw)


def test_idx_reader_and_mnist_from_env_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_mnist(tmp_path / "mnist")
    a = read_idx(tmp_path / "mnist" / "train-images-idx3-ubyte.gz")
    assert a.shape == (40, 28, 28) and a.dtype == np.uint8
    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    arrays = load_mnist()
    assert arrays.x_train.shape == (40, 28, 28) and arrays.y_test.tolist() == [i % 10 for i in range(20)]
    cd = load_client_data("mnist", 1, 0, {"num_clients": 3})
    assert cd.x_train.shape[1:] == (1, 28, 28) and cd.x_train.dtype == torch.float32
    assert len(cd.y_train) + len(cd.y_test) == 20  # 60 pooled samples / 3 clients
    train_only = load_client_data("mnist", 1, 0, {"num_clients": 4, "pool": "train"})
    assert len(train_only.y_train) + len(train_only.y_test) == 10


def test_uncompressed_idx_files_work_too(tmp_path: Path) -> None:
    _fake_mnist(tmp_path, gz=False)
    assert load_mnist(tmp_path).x_test.shape == (20, 28, 28)


def test_missing_data_says_where_it_looked_and_how_to_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError) as e:
        load_client_data("mnist", 0, 0, {"data_dir": str(missing)})
    msg = str(e.value)
    assert str(missing) in msg and "data_dir" in msg and ENV_VAR in msg and "download=True" in msg
    with pytest.raises(DataError, match="download=True"):
        load_cifar10(missing)
    with pytest.raises(DataError, match="HAR"):
        load_client_data("har", 0, 0, {"data_dir": str(missing)})
    with pytest.raises(DataError, match="Shakespeare"):
        load_client_data("shakespeare", 0, 0, {"data_dir": str(missing)})


def test_unknown_option_and_bad_client_index_are_data_errors(tmp_path: Path) -> None:
    _fake_mnist(tmp_path)
    with pytest.raises(DataError, match="unknown option 'colour'"):
        load_client_data("mnist", 0, 0, {"data_dir": str(tmp_path), "colour": "red"})
    with pytest.raises(DataError, match="out of range"):
        load_client_data("mnist", 5, 0, {"data_dir": str(tmp_path), "num_clients": 3})
    with pytest.raises(DataError, match="test_fraction"):
        load_client_data("mnist", 0, 0, {"data_dir": str(tmp_path), "test_fraction": 1.5})


# ---- CIFAR-10 ----

def _jpeg(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _fake_cifar_tar(path: Path, per_class: int = 2) -> None:
    with tarfile.open(path, "w:gz") as tf:
        for split in ("test", "train"):  # test first, as in the real tarball
            for label, cls in enumerate(reversed(CIFAR10_CLASSES)):  # member order must not matter
                for n in range(per_class):
                    data = _jpeg((25 * (9 - label), n * 40, 128))
                    info = tarfile.TarInfo(f"cifar10-jpeg/{split}/{cls}/{n:04d}.jpg")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))


def test_cifar10_jpeg_tarball_labels_follow_class_folder_order(tmp_path: Path) -> None:
    _fake_cifar_tar(tmp_path / "cifar10-jpeg.tar.gz")
    arrays = load_cifar10(tmp_path, source="jpeg")
    assert arrays.x_train.shape == (20, 32, 32, 3) and arrays.x_test.shape == (20, 32, 32, 3)
    assert arrays.y_train.tolist() == [i // 2 for i in range(20)]
    # the red channel encodes the class: airplane (0) was written with red 0, truck (9) with 225
    reds = arrays.x_train[:, 16, 16, 0].astype(int)
    assert abs(reds[0] - 0) <= 3 and abs(reds[-1] - 225) <= 3


def test_cifar10_npy_cache_and_subsample_agree(tmp_path: Path) -> None:
    _fake_cifar_tar(tmp_path / "cifar10-jpeg.tar.gz", per_class=3)
    cache = tmp_path / "cache"
    base = {"data_dir": str(tmp_path), "num_clients": 2, "partition": "iid", "max_samples": 30}
    lazy = load_client_data("cifar10", 0, 7, base)  # decodes only the 30 chosen images
    full = load_cifar10(tmp_path, cache_dir=cache)
    assert len(list(cache.glob("*.npy"))) == 4 and full.x_train.shape == (30, 32, 32, 3)
    cached = load_client_data("cifar10", 0, 7, {**base, "cache_dir": str(cache)})
    assert torch.equal(lazy.y_train, cached.y_train) and torch.allclose(lazy.x_train, cached.x_train)
    # without max_samples: labels from the member names, images decoded on first use; same as from the cache
    whole = {"data_dir": str(tmp_path), "num_clients": 2, "partition": "noniid-2", "min_size": 4}
    assert describe_partition("cifar10", 1, whole).pool_size == 60
    lazy_all = load_client_data("cifar10", 1, 1, whole)
    cached_all = load_client_data("cifar10", 1, 1, {**whole, "cache_dir": str(cache)})
    assert torch.equal(lazy_all.y_test, cached_all.y_test) and torch.allclose(lazy_all.x_train, cached_all.x_train)
    raw = load_client_data("cifar10", 0, 7, {**base, "normalize": False})
    assert float(raw.x_train.min()) >= 0.0 and float(raw.x_train.max()) <= 1.0


def test_cifar10_pickled_batches(tmp_path: Path) -> None:
    d = tmp_path / "cifar-10-batches-py"
    d.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (10, 3072), dtype=np.uint8), b"labels": list(range(10))}
        (d / name).write_bytes(pickle.dumps(batch))
    arrays = load_cifar10(tmp_path, source="pickle")
    assert arrays.x_train.shape == (50, 32, 32, 3) and arrays.y_test.tolist() == list(range(10))
    first = pickle.loads((d / "data_batch_1").read_bytes())[b"data"][0]
    # channel-major rows -> HWC: pixel (0, 0) of the red plane is element 0, green element 1024
    assert arrays.x_train[0, 0, 0, 0] == first[0] and arrays.x_train[0, 0, 0, 1] == first[1024]
    cd = load_client_data("cifar10", 0, 0, {"data_dir": str(tmp_path), "num_clients": 2, "source": "pickle"})
    assert cd.x_train.shape[1:] == (3, 32, 32)


# ---- npz and image folders ----

def test_npz_with_client_ids_is_partitioned_naturally(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (60, 4, 4), dtype=np.uint8)
    y = np.arange(60) % 3
    client = np.repeat([10, 20, 30], 20)
    np.savez(tmp_path / "mine.npz", x=x, y=y, client=client)
    opts = {"path": "mine.npz", "data_dir": str(tmp_path)}
    assert num_clients_of("npz", 0, opts) == 3
    cd = load_client_data("npz", 2, 0, opts)
    assert cd.x_train.dtype == torch.float32 and float(cd.x_train.max()) <= 1.0
    assert len(cd.y_train) + len(cd.y_test) == 20 and cd.num_classes == 3
    summary = describe_partition("npz", 0, opts)
    assert [c.tag for c in summary.clients] == ["10", "20", "30"]
    iid = load_client_data("npz", 0, 0, {**opts, "partition": "iid", "num_clients": 6})
    assert len(iid.y_train) + len(iid.y_test) == 10
    tokens = load_client_data("npz", 0, 0, {**opts, "x_dtype": "int64"})
    assert tokens.x_train.dtype == torch.int64


def test_npz_without_client_ids_defaults_to_iid_and_types_partition(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.random.default_rng(0).normal(size=(400, 5)).astype(np.float64),
             y=np.arange(400) % 4)
    opts = {"path": str(tmp_path / "d.npz"), "partition": "types", "num_types": 2, "num_clients": 4}
    types = client_types("npz", 0, opts)
    assert types is not None and types.tolist() == [0, 0, 1, 1]
    cd = load_client_data("npz", 3, 0, opts)
    assert set(torch.cat([cd.y_train, cd.y_test]).tolist()) == {2, 3}
    assert cd.x_train.dtype == torch.float32
    assert num_clients_of("npz", 0, {"path": str(tmp_path / "d.npz")}) == 100


def test_imagefolder(tmp_path: Path) -> None:
    for cls, color in (("cat", (255, 0, 0)), ("ant", (0, 255, 0))):
        (tmp_path / cls).mkdir()
        for n in range(6):
            Image.new("RGB", (8, 8), color).save(tmp_path / cls / f"{n}.png")
    cd = load_client_data("imagefolder", 0, 0, {"path": str(tmp_path), "num_clients": 2, "partition": "iid"})
    assert cd.x_train.shape[1:] == (3, 8, 8) and cd.num_classes == 2
    x = torch.cat([cd.x_train, cd.x_test])
    y = torch.cat([cd.y_train, cd.y_test])
    # "ant" (green) is class 0, "cat" (red) class 1: alphabetical order
    assert torch.all(x[y == 0][:, 1] > 0.9) and torch.all(x[y == 1][:, 0] > 0.9)
    small = load_client_data("imagefolder", 0, 0, {"path": str(tmp_path), "num_clients": 2, "image_size": 4,
                                                   "mode": "L"})
    assert small.x_train.shape[1:] == (1, 4, 4)


def test_summary_cli_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros((300, 2), np.float32), y=np.arange(300) % 5)
    argv = ["--dataset", "npz", "--option", f"path={tmp_path / 'd.npz'}", "--num-clients", "6",
            "--partition", "dirichlet", "--option", "alpha=0.3", "--option", "min_size=5", "--seed", "1"]
    assert summary_main(argv) == 0
    out = capsys.readouterr().out
    assert "dataset=npz partition=dirichlet clients=6 classes=5 pool=300" in out
    assert "total: 6 clients, 300 samples of 300" in out
    assert summary_main(["--dataset", "npz", "--option", "path=/does/not/exist.npz"]) == 2
    assert "does not exist" in capsys.readouterr().err
