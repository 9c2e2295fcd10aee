"""Federated datasets: each client derives its own shard from (dataset, options, seed, client index)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedcore.lazy import exported_names, lazy_exports

if TYPE_CHECKING:
    from fedcore.data.base import (
        ClientData as ClientData,
    )
    from fedcore.data.base import (
        DataError as DataError,
    )
    from fedcore.data.base import (
        SampleShape as SampleShape,
    )
    from fedcore.data.base import (
        available_datasets as available_datasets,
    )
    from fedcore.data.base import (
        check_dataset as check_dataset,
    )
    from fedcore.data.base import (
        load_client_data as load_client_data,
    )
    from fedcore.data.base import (
        register_dataset as register_dataset,
    )
    from fedcore.data.base import (
        remote_options as remote_options,
    )
    from fedcore.data.base import (
        sample_shape as sample_shape,
    )

# What each submodule gives the package, imported on first use (fedcore.lazy): importing one submodule
# loads no other.
_EXPORTS = {
    "fedcore.data.base": (
        "ClientData", "DataError", "SampleShape", "available_datasets", "check_dataset", "load_client_data",
        "register_dataset", "remote_options", "sample_shape"
    ),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = exported_names(_EXPORTS)
