"""Bounded resources per session and in total: one upload and one pull in flight per session, and a ceiling on
the bytes reserved for partial updates across all clients (beyond it, admission answers RESOURCE_EXHAUSTED and
the client retries later). The idle timeout of a stream is the servicer's (it owns the stream)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from fedserver.errors import ProtocolError


class StreamLimits:
    def __init__(self, max_buffered_bytes: int) -> None:
        self.max_buffered_bytes = max_buffered_bytes
        self.buffered = 0
        self._uploads: set[str] = set()
        self._pulls: set[str] = set()

    @contextmanager
    def upload(self, session: str, nbytes: int) -> Iterator[None]:
        """Reserve ``nbytes`` for one upload of ``session`` while the block runs."""
        if session in self._uploads:
            raise ProtocolError("RESOURCE_EXHAUSTED", "an upload is already in flight for this session")
        if self.buffered + nbytes > self.max_buffered_bytes:
            raise ProtocolError("RESOURCE_EXHAUSTED", f"the server is buffering {self.buffered} bytes of partial "
                                                      f"updates (ceiling {self.max_buffered_bytes}); retry later")
        self._uploads.add(session)
        self.buffered += nbytes
        try:
            yield
        finally:
            self._uploads.discard(session)
            self.buffered -= nbytes

    @contextmanager
    def pull(self, session: str) -> Iterator[None]:
        if session in self._pulls:
            raise ProtocolError("RESOURCE_EXHAUSTED", "a pull is already in flight for this session")
        self._pulls.add(session)
        try:
            yield
        finally:
            self._pulls.discard(session)

    @property
    def uploads_in_flight(self) -> int:
        return len(self._uploads)


def _malloc_trim() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, "malloc_trim", None)
    except OSError:
        return None


_TRIM = _malloc_trim()


def return_freed_memory() -> None:
    """Hand the allocator's free pages back to the operating system (glibc ``malloc_trim``; a no-op elsewhere).

    A refused or stalled upload leaves its chunk messages' memory free but inside the heap, where the server's
    resident size keeps counting it; after a large one, trimming returns it (a few milliseconds).
    """
    if _TRIM is not None:
        _TRIM(0)  # type: ignore[operator]
