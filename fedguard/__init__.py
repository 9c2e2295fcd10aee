"""fedguard: the wire contract lives in ``fedguard.v1`` (generated from ``protos/``, do not edit by hand)."""

from fedcore import __version__

__all__ = ["__version__"]
