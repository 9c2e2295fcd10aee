"""The client's trust boundary: what a server's announcement may and may not make the client do."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any

import pytest

from fedcore.config import FederationInfo, TrainingConfig
from fedcore.data import remote_options
from fedcore.models import build_model, is_registered_model, model_manifest
from fedcore.nfl import NflSettings
from fedcore.trust import (
    TrustError,
    announced_data,
    announced_model,
    build_announced_model,
    check_announcement,
    check_json,
)


def _fed(**changes: Any) -> FederationInfo:
    model = build_model("mlp", {"hidden": [8]})
    base = FederationInfo(federation_id="f", model_name="mlp", model_kwargs={"hidden": [8]}, model_fingerprint="",
                          model_spec=tuple(model_manifest(model)), training=TrainingConfig(), dataset="synthetic",
                          data_options={"alpha": 0.5}, num_rounds=3, seed=1)
    return dataclasses.replace(base, **changes)


def test_an_import_path_is_never_resolved_from_an_announcement() -> None:
    assert not is_registered_model("os:system") and is_registered_model("mlp")
    for name in ("os:system", "tests.unit._never_imported:factory", "subprocess:run", "no_such_model"):
        with pytest.raises(TrustError) as e:
            announced_model(_fed(model_name=name, model_kwargs={"command": "touch /tmp/pwned"}), 1 << 30)
        assert e.value.field == "model_name"
    assert "tests.unit._never_imported" not in sys.modules


def test_a_built_in_model_is_checked_on_the_meta_device_before_it_is_allocated() -> None:
    model = build_announced_model(_fed(), 1 << 30)
    assert model_manifest(model) == list(_fed().model_spec)
    # Arguments that would build a different (here: huge) model than the announced spec: refused unallocated.
    with pytest.raises(TrustError, match="does not build the announced tensors") as e:
        build_announced_model(_fed(model_kwargs={"hidden": [1 << 20, 1 << 20]}), 1 << 40)
    assert e.value.field == "model_spec"
    with pytest.raises(TrustError, match="max_model_bytes") as e:
        announced_model(_fed(), 100)
    with pytest.raises(TrustError) as e:
        build_announced_model(_fed(model_kwargs={"no_such_argument": 1}), 1 << 30)
    assert e.value.field == "model_kwargs_json"


def test_a_host_checks_one_announcement_on_the_meta_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many virtual clients of one federation: the meta check runs for the first; a changed spec, arguments or
    registered factory is checked again, and a failed check is never remembered."""
    import fedcore.trust as trust

    checks: list[Any] = []
    real = trust._check_on_meta
    monkeypatch.setattr(trust, "_VERIFIED", set())
    monkeypatch.setattr(trust, "_check_on_meta", lambda *a: (checks.append(a[2]), real(*a))[1])
    fed = _fed(model_kwargs={"hidden": [7]}, model_spec=tuple(model_manifest(build_model("mlp", {"hidden": [7]}))))
    for _ in range(3):
        assert model_manifest(build_announced_model(fed, 1 << 30)) == list(fed.model_spec)
    assert len(checks) == 1
    lying = dataclasses.replace(fed, model_kwargs={"hidden": [1 << 20, 1 << 20]})  # same spec, other arguments
    for _ in range(2):
        with pytest.raises(TrustError, match="does not build the announced tensors"):
            build_announced_model(lying, 1 << 40)
    other_spec = dataclasses.replace(fed, model_spec=_fed().model_spec)  # same arguments, another spec
    with pytest.raises(TrustError, match="does not build the announced tensors"):
        build_announced_model(other_spec, 1 << 30)
    assert len(checks) == 4


@pytest.mark.parametrize(("dataset", "options", "field"), [
    ("npz", {"path": "/etc/passwd"}, "data_options_json.path"),
    ("cifar10", {"source": "pickle"}, "data_options_json.source"),
    ("cifar10", {"data_dir": "/tmp/evil"}, "data_options_json.data_dir"),
    ("cifar10", {"cache_dir": "/tmp/evil"}, "data_options_json.cache_dir"),
    ("mnist", {"download": True}, "data_options_json.download"),
    ("imagefolder", {"path": "/"}, "data_options_json.path"),
    ("no_such_dataset", {}, "dataset"),
])
def test_paths_downloads_and_file_formats_are_not_the_servers_to_choose(dataset: str, options: dict[str, Any],
                                                                         field: str) -> None:
    with pytest.raises(TrustError) as e:
        announced_data(_fed(dataset=dataset, data_options=options))
    assert e.value.field == field
    assert not any(k in remote_options(dataset) for k in ("path", "data_dir", "cache_dir", "download", "source")
                   ) if dataset != "no_such_dataset" else True


def test_partition_options_pass_and_the_clients_own_options_win() -> None:
    name, opts = announced_data(_fed(dataset="mnist", data_options={"partition": "noniid", "num_clients": 10}),
                                own_options={"data_dir": "/data/mine"})
    assert name == "mnist" and opts == {"partition": "noniid", "num_clients": 10, "data_dir": "/data/mine"}
    # A client that names its own dataset ignores the announced one and its options.
    name, opts = announced_data(_fed(dataset="cifar10", data_options={"pool": "train"}), "npz", {"path": "x.npz"})
    assert name == "npz" and opts == {"path": "x.npz"}


def test_json_values_are_plain_and_bounded() -> None:
    check_json({"hidden": [64, 32], "act": "relu", "p": 0.5, "x": None}, "f")
    deep: Any = 1
    for _ in range(10):
        deep = [deep]
    bad = [{"a": math.nan}, {"a": "x" * 10_000}, {"a": "\x00"}, {"a b": 1}, deep, {"a": list(range(10_000))},
           {"a": 2**80}]
    for value in bad:
        with pytest.raises(TrustError):
            check_json(value, "f")


def test_announced_numbers_must_be_in_range() -> None:
    check_announcement(_fed())
    for fed in (_fed(training=TrainingConfig(learning_rate=math.nan)), _fed(training=TrainingConfig(batch_size=0)),
                _fed(training=TrainingConfig(local_epochs=10**9)), _fed(chunk_bytes=1 << 40),
                _fed(nfl=NflSettings("off", -1, 5)), _fed(nfl=NflSettings("off\x1b[2J", 5, 5)),
                _fed(federation_id="x\x1b[2J")):
        with pytest.raises(TrustError):
            check_announcement(fed)
