"""The server's asyncio event loop (``server.event_loop``): uvloop (libuv's loop, written in Cython) where it is
installed, else the standard library's.

Every server message passes through the event loop several times (gRPC's completion queue wakes it, the handler's
coroutine is resumed, its futures resolved and its callbacks scheduled); on uvloop that costs less: a bare grpc.aio
stream's round (no fedguard code, ``tools/bench/bench_grpc_floor.py --event-loop``) took 137–147 µs of server CPU
on uvloop against 150–163 µs on the standard loop, and a unary call 217–230 against 250–283 µs, interleaved in the same
minutes (docs/results/benchmark_history.md, "The event loop"). Nothing the federation computes depends on the loop:
arrival order never changes a result (the aggregator orders by client id), so the models are bit-identical on either.

``auto`` (the default) takes uvloop when it can be imported and the standard loop otherwise (uvloop has no Windows
build); ``uvloop`` insists on it (a clear :class:`ConfigError` naming the field when it is missing); ``asyncio``
never uses it. The loop that runs is logged with ``server.listening`` (``event_loop``).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from fedcore.config import EVENT_LOOPS
from fedcore.errors import ConfigError

T = TypeVar("T")


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory of uvloop's event loops for ``choice``, or None for the standard library's loop. Raises
    :class:`ConfigError` (``server.event_loop``) for an unknown choice or ``uvloop`` when it cannot be imported."""
    if choice not in EVENT_LOOPS:
        raise ConfigError("server.event_loop", f"one of {list(EVENT_LOOPS)}, got {choice!r}")
    if choice == "asyncio":
        return None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError as e:
        if choice == "auto":
            return None
        raise ConfigError("server.event_loop", f"'uvloop' asks for uvloop, which cannot be imported ({e}): "
                                               "pip install uvloop (not available on Windows), or set "
                                               "server.event_loop = \"auto\" or \"asyncio\"") from None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Callable[[], Coroutine[Any, Any, T]], choice: str) -> T:
    """``asyncio.run(main())`` on the loop ``choice`` names (see :func:`loop_factory`; a refused choice raises
    before ``main`` is called)."""
    factory = loop_factory(choice)
    if factory is None:
        return asyncio.run(main())
    with asyncio.Runner(loop_factory=factory) as r:
        result: T = r.run(main())
        return result


def running_loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the loop the caller runs on."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
