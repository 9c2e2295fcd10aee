"""Partitions and models own their options (issue 27 item 2): each partition kind registers a frozen options
dataclass, checked in ``data.options`` beside the dataset's own options; each registered model's options dataclass
is generated from its factory's keyword arguments and checks ``model.kwargs`` before the model is built."""

from __future__ import annotations

import dataclasses
import glob
import inspect
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from fedcore.config import ConfigError, ServerConfig, build_config, check_data_config, from_dict, load_toml
from fedcore.data import DataError, check_dataset
from fedcore.data.loaders import SHARD_OPTION_NAMES, ShardOptions, split_options
from fedcore.data.partition import (
    PARTITION_KINDS,
    PARTITION_OPTION_NAMES,
    DirichletOptions,
    PartitionOptionError,
    parse_partition_options,
)
from fedcore.models import MODELS, ModelError, build_model, check_model_kwargs, register_model
from fedlaunch.options import split_experiment

ROOT = Path(__file__).resolve().parents[2]


def _server(data: dict[str, Any] | None = None, model: dict[str, Any] | None = None) -> ServerConfig:
    overrides: list[tuple[list[str], Any]] = [(["security", "insecure"], True), (["rounds", "clients_per_round"], 2)]
    if data is not None:
        overrides += [(["data", "dataset"], "mnist"), (["data", "options"], data)]
    if model is not None:
        overrides += [(["model", key], value) for key, value in model.items()]
    return build_config(ServerConfig, None, overrides)


# ---- partitions ----

@pytest.mark.parametrize(("options", "field", "message"), [
    ({"partition": "dirichlet", "alpha": 0.0}, "data.options.alpha", "must be > 0"),
    ({"partition": "dirichlet", "alpha": "x"}, "data.options.alpha", "expected a number"),
    ({"partition": "noniid-mixed", "sigma": -1.0}, "data.options.sigma", "must be >= 0"),
    ({"partition": "noniid", "classes_per_client": 0}, "data.options.classes_per_client", "positive integer"),
    ({"partition": "types", "num_types": 0}, "data.options.num_types", "positive integer"),
    ({"partition": "natural", "min_size": 0}, "data.options.min_size", "positive integer"),
])
def test_a_bad_partition_option_names_its_field(options: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        check_data_config(_server(options))
    assert e.value.field == field


@pytest.mark.parametrize(("options", "field", "theirs"), [
    ({"partition": "iid", "alpha": 0.5}, "data.options.alpha", "it takes none"),
    ({"partition": "dirichlet", "num_types": 3}, "data.options.num_types", "its options: alpha, min_size"),
    ({"partition": "dirichlet-0.5", "sigma": 1.0}, "data.options.sigma", "its options: alpha, min_size"),
    ({"partition": "types", "alpha": 0.5}, "data.options.alpha", "num_types, classes_per_type, samples_per_client"),
    ({"partition": "noniid-2", "mixed_groups": [[1.0, 2]]}, "data.options.mixed_groups", "classes_per_client"),
])
def test_an_option_the_chosen_partition_lacks_is_refused_naming_it(options: dict[str, Any], field: str,
                                                                    theirs: str) -> None:
    with pytest.raises(ConfigError, match="has no option") as e:
        check_data_config(_server(options))
    assert e.value.field == field and theirs in str(e.value)


def test_the_load_path_raises_a_data_error_that_names_the_field() -> None:
    with pytest.raises(DataError, match=r"data\.options\.alpha: partition 'iid' has no option 'alpha'"):
        split_options("mnist", {"partition": "iid", "alpha": 0.5})
    with pytest.raises(PartitionOptionError) as e:
        check_dataset("mnist", {"partition": "dirichlet", "alpha": -1.0})
    assert isinstance(e.value, DataError) and e.value.field == "data.options.alpha"


def test_the_datasets_own_options_stay_the_datasets() -> None:
    shared = {"num_clients": 10, "pool": "all", "test_fraction": 0.2, "split": "random", "max_samples": 500,
              "max_client_samples": 40}
    for partition in ("iid", "dirichlet", "noniid-3", "noniid-mixed", "types", "natural", "auto"):
        assert parse_partition_options(partition, {"partition": partition, **shared}) is not False
        own, opts = split_options("mnist", {"partition": partition, **shared})
        assert own == {"pool": "all"} and opts.num_clients == 10
    assert check_dataset("mnist", {"partition": "dirichlet", "alpha": 0.1, "pool": "all", "num_clients": 10}) == 10


def test_parsed_partition_options_are_typed_with_the_kinds_defaults() -> None:
    assert parse_partition_options("dirichlet", {"partition": "dirichlet", "num_clients": 5}) == DirichletOptions()
    assert parse_partition_options("dirichlet-0.3", {"alpha": 1}) == DirichletOptions(alpha=1.0)
    assert parse_partition_options("iid", {"num_clients": 5}) is None
    assert parse_partition_options("auto", {"min_size": 10000}).min_size == 10000  # natural's, e.g. Shakespeare


def test_each_partition_kinds_options_are_frozen_and_match_the_shared_shard_defaults() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(ShardOptions)}
    declared: set[str] = set()
    for kind in PARTITION_KINDS.names():
        options = PARTITION_KINDS.plugin(kind).options_type()
        if options is None:
            continue
        assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen  # type: ignore[attr-defined]
        for f in dataclasses.fields(options):
            assert f.default == defaults[f.name], (kind, f.name)
            declared.add(f.name)
    assert declared == set(PARTITION_OPTION_NAMES) and PARTITION_OPTION_NAMES <= SHARD_OPTION_NAMES


# ---- models ----

def test_every_registered_models_options_are_its_factorys_keywords_and_defaults() -> None:
    for name in MODELS.names():
        options = MODELS.plugin(name).options_type()
        assert options is not None, name
        assert options.__dataclass_params__.frozen  # type: ignore[attr-defined]
        params = inspect.signature(MODELS.get(name)).parameters
        fields = dataclasses.fields(options)
        assert [f.name for f in fields] == list(params), name
        for f in fields:
            assert f.default == params[f.name].default, (name, f.name)
        assert options() == from_dict(options, {}), name


@pytest.mark.parametrize(("kwargs", "field", "message"), [
    ({"wings": 2}, "model.kwargs.wings", "model 'mlp' has no option 'wings'; its options: in_features, num_classes"),
    ({"in_features": 2.5}, "model.kwargs.in_features", "expected an integer"),
    ({"hidden": "wide"}, "model.kwargs.hidden", "expected"),
])
def test_model_kwargs_are_checked_by_the_models_options(kwargs: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        _server(model={"name": "mlp", "kwargs": kwargs})
    assert e.value.field == field
    with pytest.raises(ModelError, match=message):
        build_model("mlp", kwargs, seed=0)


def test_good_model_kwargs_build_the_same_model() -> None:
    cfg = _server(model={"name": "mnist_cnn_bn", "kwargs": {"in_channels": 3, "image_size": 32}})
    assert cfg.model.kwargs == {"in_channels": 3, "image_size": 32}
    check_model_kwargs("mlp", {"hidden": [8, 4], "num_classes": 3})
    a, b = build_model("mlp", {"hidden": [8]}, seed=1), build_model("mlp", {"hidden": (8,)}, seed=1)
    assert all((x == y).all() for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_an_import_path_model_keeps_its_factorys_own_checks() -> None:
    model = build_model("torch.nn:Linear", {"in_features": 2, "out_features": 3}, seed=0)
    assert isinstance(model, nn.Linear)
    check_model_kwargs("torch.nn:Linear", {"anything": 1})  # not ours to check
    with pytest.raises(ModelError, match="rejected its arguments"):
        build_model("torch.nn:Linear", {"wings": 1}, seed=0)


def test_a_model_with_open_keywords_gets_no_options_and_its_kwargs_as_given() -> None:
    def open_model(**kwargs: Any) -> nn.Module:
        return nn.Linear(int(kwargs.get("width", 2)), 2)

    register_model("test_open_model")(open_model)
    try:
        assert MODELS.plugin("test_open_model").options_type() is None
        assert isinstance(build_model("test_open_model", {"width": 4}), nn.Linear)
    finally:
        MODELS.remove("test_open_model")


# ---- existing configurations ----

@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "configs" / "*.toml"))))
def test_every_shipped_config_loads_with_the_same_meaning(path: str) -> None:
    raw = load_toml(path)
    _, data = split_experiment(path)
    cfg = from_dict(ServerConfig, data)
    check_model_kwargs(cfg.model.name, cfg.model.kwargs)
    check_data_config(cfg)
    assert cfg.data.options == raw["data"].get("options", {})
    assert cfg.model.kwargs == raw["model"].get("kwargs", {})
