"""fedguard: the wire contract lives in ``fedguard.v1`` (generated from ``protos/``, do not edit by hand)."""

__version__ = "0.1.0"
