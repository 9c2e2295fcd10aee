"""fedguard: the wire contract lives in ``fedguard.v1`` (generated from ``protos/``, do not edit by hand).

``fedguard.load_model(run_dir, cluster=None)`` returns a finished run's model as an ``nn.Module``
(:func:`fedcore.outputs.load_model`; imported on first use, so ``import fedguard`` stays torch-free).
"""

from typing import Any

from fedcore import __version__

__all__ = ["__version__", "load_model"]


def __getattr__(name: str) -> Any:
    if name == "load_model":
        from fedcore.outputs import load_model

        return load_model
    raise AttributeError(f"module 'fedguard' has no attribute {name!r}")
