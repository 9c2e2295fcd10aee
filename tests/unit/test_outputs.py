"""A run's models as safetensors + sidecar (fedcore.outputs) and fedguard.load_model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fedguard
from fedcore import outputs
from fedcore.jsonio import strict_loads
from fedcore.models import build_model


def _write(run: Path, model: torch.nn.Module, cluster: str | None = None) -> Path:
    return outputs.write_model(run, model.state_dict(), model_name="mlp", model_kwargs={"hidden": [8]}, round_=7,
                               config_sha="sha256:abc", cluster=cluster)


def test_round_trip_rebuilds_the_model_from_the_zoo(tmp_path: Path) -> None:
    model = build_model("mlp", {"hidden": [8]}, seed=3)
    path = _write(tmp_path, model)
    assert path == tmp_path / "final_model.safetensors"
    meta = strict_loads((tmp_path / "final_model.json").read_text())
    assert meta["model"] == "mlp" and meta["model_kwargs"] == {"hidden": [8]} and meta["round"] == 7
    assert meta["config_hash"] == "sha256:abc" and meta["fedguard_version"] == fedguard.__version__
    loaded = fedguard.load_model(tmp_path)
    assert not loaded.training
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    x = torch.randn(4, 60, generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(x), model.eval()(x))
    # the safetensors file is readable without fedguard (its own header names the model too)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["model"] == "mlp" and set(f.keys()) == set(model.state_dict())


def test_cluster_models_and_clear_errors(tmp_path: Path) -> None:
    a, b = build_model("mlp", {"hidden": [8]}, seed=1), build_model("mlp", {"hidden": [8]}, seed=2)
    _write(tmp_path, a)
    _write(tmp_path, b, cluster="c1")
    got = fedguard.load_model(tmp_path, "c1")
    assert all(torch.equal(got.state_dict()[k], v) for k, v in b.state_dict().items())
    with pytest.raises(outputs.ModelFileError, match=r"c2\.json: no such file.*clusters: c1"):
        fedguard.load_model(tmp_path, "c2")
    with pytest.raises(outputs.ModelFileError, match="not a cluster id"):
        fedguard.load_model(tmp_path, "../x")
    with pytest.raises(outputs.ModelFileError, match=r"final_model\.json: no such file"):
        fedguard.load_model(tmp_path / "nothing")
    # damaged weights: named, and nothing is changed
    w = tmp_path / "final_model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(outputs.ModelFileError, match=r"final_model\.safetensors: not a readable safetensors"):
        fedguard.load_model(tmp_path)
    assert w.read_bytes() == data[: len(data) // 2]


def test_a_factory_path_in_a_sidecar_is_never_imported(tmp_path: Path) -> None:
    model = build_model("mlp", {"hidden": [8]}, seed=0)
    outputs.write_model(tmp_path, model.state_dict(), model_name="os:system", model_kwargs={}, round_=1,
                        config_sha="x")
    with pytest.raises(outputs.ModelFileError, match="never imports"):
        fedguard.load_model(tmp_path)
    # the caller's own instance takes the weights
    mine = build_model("mlp", {"hidden": [8]}, seed=5)
    got = fedguard.load_model(tmp_path, model=mine)
    assert got is mine and all(torch.equal(mine.state_dict()[k], v) for k, v in model.state_dict().items())


def test_the_coordinator_writes_the_global_and_every_cluster_model(tmp_path: Path) -> None:
    from fedcore.config import ServerConfig, build_config
    from fedserver.coordinator import Coordinator
    from fedserver.final_models import write_final_models

    cfg = build_config(ServerConfig, None, [(["server", "run_dir"], str(tmp_path)), (["security", "insecure"], True),
                                            (["model", "kwargs"], {"hidden": [8]})])
    coord = Coordinator(cfg)
    other = build_model("mlp", {"hidden": [8]}, seed=9).state_dict()
    coord.models.put("c0", other)
    assert write_final_models(cfg, coord.models, 5, coord.log) == tmp_path / "final_model.fgt"
    glob = fedguard.load_model(tmp_path)
    assert all(torch.equal(glob.state_dict()[k], v) for k, v in coord.models.get().items())
    c0 = fedguard.load_model(tmp_path, "c0")
    assert all(torch.equal(c0.state_dict()[k], v) for k, v in other.items())
    meta = strict_loads((tmp_path / "final_clusters" / "c0.json").read_text())
    assert meta["cluster"] == "c0" and meta["round"] == 5 and meta["model_kwargs"] == {"hidden": [8]}
    assert meta["config_hash"] == strict_loads((tmp_path / "final_model.json").read_text())["config_hash"]
