"""fedguard: the wire contract, below both shells. ``fedguard.v1`` is generated from ``protos/`` (do not edit by hand),
``fedguard.wire`` translates its messages to fedcore's types, ``fedguard.signing`` and ``fedguard.certs`` sign
requests and make certificates. The launcher and the run tools (status, export, plot) are :mod:`fedlaunch`.

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
