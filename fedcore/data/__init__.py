"""Federated datasets: each client derives its own shard from (dataset, options, seed, client index)."""

from fedcore.data import synthetic as _synthetic  # noqa: F401  (registers "synthetic")
from fedcore.data.base import (
    ClientData,
    DataError,
    SampleShape,
    available_datasets,
    check_dataset,
    load_client_data,
    register_dataset,
    remote_options,
    sample_shape,
)

__all__ = ["ClientData", "DataError", "SampleShape", "available_datasets", "check_dataset", "load_client_data",
           "register_dataset", "remote_options", "sample_shape"]
from fedcore.data import datasets as _datasets  # noqa: F401  (registers the real datasets)
