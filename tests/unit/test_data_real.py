"""Loaders on the real datasets in ../shared/data (skipped with a reason when that folder is absent).

A full decode of the 60,000 CIFAR-10 JPEGs (~10 s) runs only with FEDGUARD_FULL_DATA_TESTS=1.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedcore.data import DataError, load_client_data
from fedcore.data.cifar10 import CIFAR10_CLASSES, _decode_members, _scan, _stamp, load_cifar10
from fedcore.data.har import load_har
from fedcore.data.loaders import describe_partition, num_clients_of
from fedcore.data.mnist import load_mnist
from fedcore.data.shakespeare import LEAF_VOCAB, UNKNOWN_INDEX, VOCAB_SIZE, decode, encode, shakespeare_roles
from fedcore.data.summary import main as summary_main

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def need(sub: str) -> Path:
    path = SHARED / sub
    if not path.exists():
        pytest.skip(f"real dataset not available: {path} is absent (the shared data folder lives at "
                    f"<repo>/../shared/data)")
    return path


def test_mnist_arrays_and_a_mixed_noniid_client() -> None:
    need("mnist")
    arrays = load_mnist(SHARED)
    assert arrays.x_train.shape == (60000, 28, 28) and arrays.x_train.dtype == np.uint8
    assert arrays.x_test.shape == (10000, 28, 28)
    assert sorted(np.unique(arrays.y_train).tolist()) == list(range(10))
    assert load_mnist(SHARED) is arrays  # cached in-process
    assert not arrays.x_train.flags.writeable
    opts = {"data_dir": str(SHARED), "num_clients": 100, "partition": "noniid-mixed"}
    cd = load_client_data("mnist", 3, 0, opts)
    assert cd.x_train.dtype == torch.float32 and cd.x_train.shape[1:] == (1, 28, 28)
    assert float(cd.x_train.min()) >= 0.0 and float(cd.x_train.max()) <= 1.0
    assert cd.num_classes == 10 and int(cd.y_train.max()) < 10
    again = load_client_data("mnist", 3, 0, opts)
    assert torch.equal(cd.x_train, again.x_train) and torch.equal(cd.y_test, again.y_test)
    summary = describe_partition("mnist", 0, opts)
    held = [c.num_classes_held for c in summary.clients]
    assert sorted(np.bincount(held, minlength=11)[[2, 5, 10]].tolist()) == [20, 30, 50]


def test_har_thirty_volunteers_channels_first() -> None:
    need("har")
    x, _, volunteer = load_har(SHARED)
    assert x.shape == (10411, 128, 6) and x.dtype == np.float16
    assert sorted(np.unique(volunteer).tolist()) == list(range(1, 31))
    opts = {"data_dir": str(SHARED)}
    assert num_clients_of("har", 0, opts) == 30
    cd = load_client_data("har", 0, 0, opts)
    assert cd.x_train.shape[1:] == (6, 128) and cd.x_train.dtype == torch.float32
    assert set(torch.cat([cd.y_train, cd.y_test]).tolist()) <= set(range(6))
    assert cd.num_train + len(cd.y_test) == int((volunteer == 1).sum())
    summary = describe_partition("har", 0, opts)
    sizes = [c.num_samples for c in summary.clients]
    assert min(sizes) >= 284 and max(sizes) <= 413 and summary.clients[0].tag == "volunteer1"


def test_shakespeare_189_roles_and_leaf_windows() -> None:
    need("shakespeare")
    roles = shakespeare_roles(SHARED)
    assert len(roles) == 189
    assert all(not r.character.startswith("[") for r in roles)
    assert VOCAB_SIZE == 80 and encode("\t").tolist() == [UNKNOWN_INDEX]
    assert decode(encode("To be, or not")) == "To be, or not"
    opts = {"data_dir": str(SHARED)}
    eligible = sum(1 for r in roles if r.num_samples() >= 2)
    assert num_clients_of("shakespeare", 0, opts) == eligible
    big = {**opts, "min_size": 10000}
    assert num_clients_of("shakespeare", 0, big) == sum(1 for r in roles if r.num_samples() >= 10000)
    cd = load_client_data("shakespeare", 0, 0, big)
    assert cd.x_train.dtype == torch.int64 and cd.x_train.shape[1] == 80 and cd.num_classes == 80
    assert int(cd.x_train.max()) < 80 and int(cd.y_train.max()) < 80
    # a window's label is the next character: it is the last symbol of the following window
    text = decode(cd.x_train[0])
    assert len(text) == 80 and set(text) <= set(LEAF_VOCAB)
    summary = describe_partition("shakespeare", 0, big)
    c0 = summary.clients[0]
    assert c0.tag and c0.num_test >= 1 and c0.num_train >= 9 * c0.num_test - 100


def test_cifar10_tarball_index_and_a_few_members() -> None:
    tar = need("cifar10") / "cifar10-jpeg.tar.gz"
    names, labels, is_test, classes = _scan(str(tar), _stamp(tar))
    assert classes == tuple(sorted(CIFAR10_CLASSES)) == CIFAR10_CLASSES
    assert len(names) == 60000 and int(is_test.sum()) == 10000
    assert np.bincount(labels[~is_test]).tolist() == [5000] * 10
    assert np.bincount(labels[is_test]).tolist() == [1000] * 10
    # test members come first in the tarball: decoding a few of them stops early
    first = _decode_members(str(tar), names[50000:50003])
    assert first.shape == (3, 32, 32, 3) and first.dtype == np.uint8 and labels[50000] == 0


def test_cifar10_client_from_a_subsample(tmp_path: Path) -> None:
    need("cifar10")
    opts = {"data_dir": str(SHARED), "max_samples": 300, "num_clients": 3, "partition": "iid"}
    cd = load_client_data("cifar10", 1, 0, opts)
    assert cd.x_train.shape[1:] == (3, 32, 32) and cd.x_train.dtype == torch.float32
    assert len(cd.y_train) + len(cd.y_test) == 100
    assert abs(float(cd.x_train.mean())) < 0.5  # normalised with the CIFAR mean/std
    with pytest.raises(DataError, match="shared data folder"):
        load_client_data("cifar10", 0, 0, {**opts, "cache_dir": str(SHARED / "cache")})


@pytest.mark.skipif(os.environ.get("FEDGUARD_FULL_DATA_TESTS") != "1",
                    reason="full CIFAR-10 JPEG decode (~10 s); set FEDGUARD_FULL_DATA_TESTS=1")
def test_cifar10_full_decode_and_npy_cache(tmp_path: Path) -> None:
    need("cifar10")
    t0 = time.perf_counter()
    arrays = load_cifar10(SHARED, cache_dir=tmp_path)
    first = time.perf_counter() - t0
    assert arrays.x_train.shape == (50000, 32, 32, 3) and arrays.x_test.shape == (10000, 32, 32, 3)
    assert len(list(tmp_path.glob("*.npy"))) == 4
    t0 = time.perf_counter()
    assert load_cifar10(SHARED, cache_dir=tmp_path) is arrays
    assert time.perf_counter() - t0 < first


def test_summary_cli_prints_clients_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    need("har")
    assert summary_main(["--dataset", "har", "--data-dir", str(SHARED), "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "partition=natural clients=30" in out and "volunteer30" in out
    assert "total: 30 clients, 10411 samples" in out
