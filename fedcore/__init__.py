"""fedguard's functional core: pure algorithms and state machines, no network (never imports grpc)."""

__version__ = "0.2.0"
