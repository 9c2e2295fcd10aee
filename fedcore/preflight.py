"""Checks that need the data and the model, run in-process before a server listens or a launcher starts anything.

:func:`fedcore.config.ServerConfig.validate` checks fields one by one (types, ranges, names); this module checks
what only the real objects can tell: that the dataset is where the configuration says (an explicit ``data_dir``
that does not exist is an error, never replaced by another copy), that the model takes one of its samples and
answers with one score per class, that K and ``min_available`` fit the fleet, and what the aggregation rule will
cost. Every error is a :class:`fedcore.errors.ConfigError` naming the field and, where there is a choice, the
allowed values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedcore.config import ServerConfig, check_aggregation_memory, check_data_config
from fedcore.data import DataError, load_client_data
from fedcore.errors import ConfigError
from fedcore.models import available_models, build_model

# How to get a dataset that is not on this machine (the loaders' own hints say where they looked).
GET_DATA = {
    "mnist": "set data.options.download = true on a machine with internet (torchvision fetches the IDX files), "
             "or copy the four IDX files into the folder data_dir names",
    "cifar10": "set data.options.download = true on a machine with internet (torchvision fetches the pickled "
               "batches), or copy them into the folder data_dir names",
    "har": "copy the UCI HAR file into DATA_DIR/har/ (see fedcore/data/har.py)",
    "shakespeare": "copy the plays (<play>.csv with columns character,dialogue) into DATA_DIR/shakespeare/",
}


def check_data_dir(options: dict[str, Any], field_path: str = "data.options") -> None:
    """An explicit ``data_dir`` (or ``path``, ``cache_dir``) must exist: a launcher never falls back to another copy
    of the data."""
    for key in ("data_dir", "path"):
        value = options.get(key)
        if value not in (None, "") and not options.get("download") and not Path(str(value)).expanduser().exists():
            raise ConfigError(f"{field_path}.{key}", f"{value} does not exist (an explicit {key} is used as given, "
                                                     "never replaced by another copy of the data)")


def sample_data(config: ServerConfig) -> Any:
    """Client 0's shard under the configuration (:class:`fedcore.data.ClientData`); :class:`ConfigError` naming
    ``data.options.data_dir`` (or ``data.dataset``) and how to get the data when it is not there."""
    check_data_dir(config.data.options)
    try:
        return load_client_data(config.data.dataset, 0, config.rounds.seed, config.data.options)
    except DataError as e:
        field_path = "data.options.data_dir" if config.data.options.get("data_dir") else "data.dataset"
        how = GET_DATA.get(config.data.dataset)
        raise ConfigError(field_path, f"{e}" + (f". To get it: {how}" if how else "")) from None


def check_model_on_data(config: ServerConfig, data: Any) -> int:
    """Build the model and run one forward pass on one training sample; returns the model's parameter count.
    :class:`ConfigError` on ``model.name`` when the model does not take the dataset's samples or does not answer
    with one score per class (naming the registered models that do)."""
    try:
        model = build_model(config.model.name, config.model.kwargs, seed=config.rounds.seed)
    except (KeyError, ValueError, TypeError, ImportError, AttributeError) as e:
        raise ConfigError("model.name", f"cannot build {config.model.name!r} with kwargs {config.model.kwargs}: "
                                        f"{e}; registered models: {', '.join(available_models())}") from None
    num_params = int(sum(p.numel() for p in model.state_dict().values() if p.is_floating_point()))
    x = data.x_train[:1]
    problem = _forward_problem(model, x, data.num_classes)
    if problem is not None:
        fits = [name for name in available_models() if _fits(name, x, data.num_classes)]
        raise ConfigError("model.name", f"{config.model.name!r} does not fit dataset {config.data.dataset!r}: one "
                                        f"sample of shape {list(x.shape)[1:]} ({x.dtype}) {problem}; registered "
                                        f"models that fit it: {', '.join(fits) or 'none'}")
    return num_params


def _forward_problem(model: Any, x: Any, num_classes: int) -> str | None:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as e:  # any failure of the model on the data is the mismatch we report
        return f"fails in the forward pass: {type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or out.shape[-1] != num_classes:
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return f"gives output {shape}, not one score for each of the dataset's {num_classes} classes"
    return None


def _fits(name: str, x: Any, num_classes: int) -> bool:
    try:
        return _forward_problem(build_model(name, {}, seed=0), x, num_classes) is None
    except Exception:  # a model that cannot be built with its defaults does not fit
        return False


def check_fleet(config: ServerConfig, num_clients: int) -> None:
    """K, ``min_updates`` and ``min_available`` against the fleet the launcher starts (N clients)."""
    r = config.rounds
    if r.clients_per_round > num_clients:
        raise ConfigError("rounds.clients_per_round", f"K = {r.clients_per_round} is more than the {num_clients} "
                                                      f"clients launched (-k must be in [1, {num_clients}])")
    if r.min_available > num_clients:
        raise ConfigError("rounds.min_available", f"{r.min_available} is more than the {num_clients} clients "
                                                  f"launched (must be in [0, {num_clients}])")


def check_server_config(config: ServerConfig, num_clients: int | None = None) -> int:
    """Everything a server checks before it listens, with the data and the model: the dataset and its options
    against the data (:func:`fedcore.config.check_data_config`), the data present, the model on one sample, the
    aggregation's memory, and (with ``num_clients``) the fleet. Returns the model's parameter count."""
    check_data_config(config)
    if num_clients is not None:
        check_fleet(config, num_clients)
    data = sample_data(config)
    num_params = check_model_on_data(config, data)
    check_aggregation_memory(config, num_params)
    return num_params
