"""Checks that need the data and the model, run in-process before a server listens or a launcher starts anything.

:func:`fedcore.config.ServerConfig.validate` checks fields one by one (types, ranges, names); this module checks
what only the real objects can tell: that the dataset is where the configuration says (an explicit ``data_dir``
that does not exist is an error, never replaced by another copy), that the model takes one of its samples and
answers with one score per class, that K and ``min_available`` fit the fleet, and what the aggregation rule will
cost. Every error is a :class:`fedcore.errors.ConfigError` naming the field and, where there is a choice, the
allowed values.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from fedcore.aggregation.memory import check_memory
from fedcore.config import ServerConfig, aggregation_error, check_data_config, effective_aggregation
from fedcore.data import DataError, SampleShape, load_client_data, sample_shape
from fedcore.errors import ConfigError
from fedcore.models import InputShape, available_models, build_model, model_input

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
    """Check that the model takes the dataset's samples and answers with one score per class; returns the model's
    parameter count. A model that declares what it takes (:class:`fedcore.models.ModelInput`) is judged from
    its declaration against one training sample's shape, dtype and the number of classes, without running it;
    one that declares nothing is built and run on that sample. :class:`ConfigError` on ``model.name`` naming the
    model, what it takes, what the dataset gives and the registered models that fit it."""
    x = data.x_train[:1]
    sample = SampleShape(tuple(int(d) for d in x.shape[1:]), _dtype_name(x.dtype), int(data.num_classes))
    takes = model_input(config.model.name, config.model.kwargs)
    if takes is not None and _verdict(takes, sample) is False:
        raise _misfit(config, _mismatch(config.model.name, takes, sample), _fitting_models(sample, x), takes, sample)
    try:
        model = build_model(config.model.name, config.model.kwargs, seed=config.rounds.seed)
    except (KeyError, ValueError, TypeError, ImportError, AttributeError) as e:
        raise ConfigError("model.name", f"cannot build {config.model.name!r} with kwargs {config.model.kwargs}: "
                                        f"{e}; registered models: {', '.join(available_models())}") from None
    num_params = int(sum(p.numel() for p in model.state_dict().values() if p.is_floating_point()))
    if takes is None:
        problem = _forward_problem(model, x, data.num_classes)
        if problem is not None:
            raise _misfit(config, problem, _fitting_models(sample, x), None, sample)
    return num_params


def check_declared_fit(config: ServerConfig) -> None:
    """Before any data is read or any model built: :class:`ConfigError` on ``model.name`` when the model's declared
    input (:func:`fedcore.models.model_input`) cannot take the dataset's declared sample
    (:func:`fedcore.data.sample_shape`). Where either declares nothing this says nothing
    (:func:`check_model_on_data` decides on a real sample)."""
    sample = sample_shape(config.data.dataset, config.data.options)
    if sample is None:
        return
    takes = model_input(config.model.name, config.model.kwargs)
    if takes is not None and _verdict(takes, sample) is False:
        raise _misfit(config, _mismatch(config.model.name, takes, sample), _fitting_models(sample, None), takes,
                      sample)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _verdict(takes: InputShape, sample: SampleShape) -> bool | None:
    """Whether a model declared to take ``takes`` fits ``sample``: True, False, or None when only the number of
    classes could tell and the dataset's is not known before its data is read."""
    if takes.dtype != sample.dtype:
        return False
    if (takes.size != math.prod(sample.shape)) if takes.flat else (takes.shape != sample.shape):
        return False
    if takes.num_classes is None or sample.num_classes is None:
        return None
    return takes.num_classes == sample.num_classes


def _mismatch(name: str, takes: InputShape, sample: SampleShape) -> str:
    """Why a declared model does not take ``sample`` (what follows "one sample of shape [...] (dtype)")."""
    parts = []
    if takes.dtype != sample.dtype or ((takes.size != math.prod(sample.shape)) if takes.flat
                                       else takes.shape != sample.shape):
        parts.append(f"is not what {name!r} takes, inputs of shape {takes.describe()}")
    if takes.num_classes is not None and sample.num_classes is not None and takes.num_classes != sample.num_classes:
        by = takes.declared.num_classes
        parts.append(f"it gives output [1, {takes.num_classes}], not one score for each of the dataset's "
                     f"{sample.num_classes} classes" + (f" (set by model.kwargs.{by})" if isinstance(by, str) else ""))
    return (" " if parts[0].startswith("is not") else ": ") + ", and ".join(parts)


def _kwargs_to_fit(takes: InputShape, sample: SampleShape) -> dict[str, int] | None:
    """The keyword arguments that would make the declared model take ``sample`` (only those that change), or
    None when no keyword can (another dtype, another number of dimensions, a fixed size)."""
    if takes.dtype != sample.dtype:
        return None
    dims = takes.declared.shape
    wanted: dict[str, int] = {}
    if len(dims) == len(sample.shape):
        for dim, size in zip(dims, sample.shape, strict=True):
            if isinstance(dim, int):
                if dim != size:
                    return None
            elif wanted.setdefault(dim, size) != size:
                return None
    else:
        names = [d for d in dims if isinstance(d, str)]
        fixed = math.prod(d for d in dims if isinstance(d, int))
        total = math.prod(sample.shape)
        if not (takes.flat and len(names) == 1 and total % fixed == 0):
            return None
        wanted[names[0]] = total // fixed
    classes = takes.declared.num_classes
    if sample.num_classes is not None and takes.num_classes != sample.num_classes:
        if not isinstance(classes, str):
            return None
        wanted[classes] = sample.num_classes
    changed = {k: v for k, v in wanted.items() if takes.arguments.get(k) != v}
    return changed or None


def _misfit(config: ServerConfig, why: str, fits: list[str], takes: InputShape | None,
            sample: SampleShape) -> ConfigError:
    """The :class:`ConfigError` on ``model.name``: the model, one sample's shape and dtype, why the model does not
    take it (``why``, which follows them), the keyword arguments that would make it fit (a declared model), and the
    registered models that fit the dataset as they are."""
    name = config.model.name
    hint = ""
    change = _kwargs_to_fit(takes, sample) if takes is not None else None
    if change:
        hint = f"; to keep {name!r}, set " + ", ".join(f"model.kwargs.{k} = {v}" for k, v in change.items())
    return ConfigError("model.name", f"{name!r} does not fit dataset {config.data.dataset!r}: one sample of shape "
                                     f"{list(sample.shape)} ({sample.dtype}){why}{hint}; registered models that fit "
                                     f"it: {', '.join(fits) or 'none'}")


def _fitting_models(sample: SampleShape, x: Any) -> list[str]:
    """The registered models that take ``sample`` with their default keyword arguments: from their declarations,
    else (a model that declares nothing) by running it on ``x`` (one real sample; None: zeros of the sample's
    shape and dtype)."""
    fits = []
    for name in available_models():
        takes = model_input(name, {})
        if takes is not None:  # None: the dataset's classes are not known before its data is read; the input fits
            fit = _verdict(takes, sample) is not False
        else:
            fit = _fits(name, x if x is not None else _zeros(sample), sample.num_classes)
        if fit:
            fits.append(name)
    return fits


def _zeros(sample: SampleShape) -> torch.Tensor:
    return torch.zeros((1, *sample.shape), dtype=getattr(torch, sample.dtype, torch.float32))


def _forward_problem(model: Any, x: Any, num_classes: int | None) -> str | None:
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(x)
    except Exception as e:  # any failure of the model on the data is the mismatch we report
        return f" fails in the forward pass: {type(e).__name__}: {e}"
    finally:
        model.train(was_training)
    if not isinstance(out, torch.Tensor) or out.dim() < 2 or (num_classes is not None
                                                               and out.shape[-1] != num_classes):
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return (f": it gives output {shape}, not one score for each of the dataset's {num_classes} classes"
                if num_classes is not None else f": it gives output {shape}, not a batch of scores")
    return None


def _fits(name: str, x: Any, num_classes: int | None) -> bool:
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
    against the data (:func:`fedcore.config.check_data_config`), the model's declared input against the dataset's
    declared sample (:func:`check_declared_fit`, before any data is read), the data present, the model on one
    sample, the aggregation's memory, and (with ``num_clients``) the fleet. Returns the model's parameter count."""
    check_data_config(config)
    if num_clients is not None:
        check_fleet(config, num_clients)
    check_data_dir(config.data.options)
    check_declared_fit(config)  # from the declarations: before the data is read and any model built
    data = sample_data(config)
    num_params = check_model_on_data(config, data)
    check_aggregation_memory(config, num_params)
    return num_params


def check_aggregation_memory(c: ServerConfig, num_params: int) -> None:
    """Refuse a rule/K/P combination that would not fit ``aggregation.memory_budget_bytes`` (0 = unchecked)."""
    budget = c.aggregation.memory_budget_bytes
    if budget:
        try:
            check_memory(effective_aggregation(c), c.rounds.clients_per_round, num_params, budget)
        except ValueError as e:
            raise aggregation_error(e) from None
