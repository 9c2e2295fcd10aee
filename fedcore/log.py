"""Structured logging: one event name per happening, key/value fields, console or JSON rendering.

The library logs through the standard :mod:`logging` module, structlog-wrapped: :func:`get_logger` returns a
structlog logger bound to the stdlib logger ``fedguard.<component>`` (``fedguard.server``, ``fedguard.client``, ...).
Each record's message is ``"<event> key=value ..."`` (readable by any formatter) and the whole event dict rides on
the record as ``record.fedguard`` (for structured handlers). The library itself never configures logging: it adds a
:class:`logging.NullHandler` to ``fedguard`` (the stdlib convention for libraries) and nothing else, so an app that
embeds the client (``FedClient``) or the server (``ServerThread``) controls every line through
``logging.getLogger("fedguard")``. The CLIs call :func:`configure_logging`, which attaches one handler to ``fedguard``
that renders the console lines (or JSON lines, ``--log-json``) on stderr.
"""

from __future__ import annotations

import datetime
import logging
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog

from fedcore import jsonio

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

ROOT_LOGGER = "fedguard"
# The attribute of a log record that carries the structlog event dict.
EVENT_ATTR = "fedguard"
logging.getLogger(ROOT_LOGGER).addHandler(logging.NullHandler())


class _Stderr:
    """Whatever ``sys.stderr`` is when a line is written (not when logging was configured): a process that swaps
    stderr (a test harness, a daemon) keeps its log lines instead of writing to a closed stream."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


# Per-update events, and the per-round ones that round.completed sums up: on the console only at debug level (the
# JSON log, --log-json, keeps every event).
CONSOLE_DEBUG_EVENTS = frozenset({"update.accepted", "update.sent", "round.started", "round.closed"})
# Events the console shows with these fields only, floats to 4 significant digits (the full record: the JSON log
# and rounds.jsonl); at debug level the console shows them whole.
CONSOLE_FIELDS: dict[str, tuple[str, ...]] = {
    "round.completed": ("round", "outcome", "accepted", "rejected", "mean_train_loss", "mean_test_accuracy",
                        "beta_hat", "beta", "nfl_count", "central_accuracy", "dp_epsilon", "seconds"),
}
# Fields of CONSOLE_FIELDS shown only when they have a value (a run without DP has no epsilon to show).
_IF_SET = ("dp_epsilon",)
_ALWAYS = ("event", "component", "level", "timestamp")


def _short(value: Any) -> Any:
    return float(f"{value:.4g}") if isinstance(value, float) else value


def console_filter(level: str) -> Any:
    """A structlog processor for the console: drops :data:`CONSOLE_DEBUG_EVENTS` and shortens the events of
    :data:`CONSOLE_FIELDS` unless ``level`` is debug."""

    def proc(logger: Any, name: str, event_dict: Any) -> Any:
        if level == "debug":
            return event_dict
        event = event_dict.get("event")
        if event in CONSOLE_DEBUG_EVENTS:
            raise structlog.DropEvent
        keep = CONSOLE_FIELDS.get(event)
        if keep is not None:
            return {k: _short(v) for k, v in event_dict.items() if (k in keep or k in _ALWAYS)
                    and not (k in _IF_SET and isinstance(v, float) and v != v)}
        return event_dict

    return proc


# ---- the library side: structlog over stdlib loggers ----

_METHOD_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "msg": logging.INFO, "warning": logging.WARNING,
                  "warn": logging.WARNING, "error": logging.ERROR, "exception": logging.ERROR,
                  "critical": logging.CRITICAL, "fatal": logging.CRITICAL}


def logger_name(component: str) -> str:
    """The stdlib logger of a component: ``fed<x>`` (the server and client shells) -> ``fedguard.<x>``, anything
    else -> ``fedguard.<component>``."""
    short = component[3:] if component.startswith("fed") and len(component) > 3 else component
    return f"{ROOT_LOGGER}.{short}"


def _min_level(level: str) -> Any:
    floor = _LEVELS[level]

    def proc(logger: Any, name: str, event_dict: Any) -> Any:
        if _METHOD_LEVELS.get(name, logging.INFO) < floor:
            raise structlog.DropEvent
        return event_dict

    return proc


def _text(event_dict: Mapping[str, Any]) -> str:
    fields = " ".join(f"{k}={v}" for k, v in event_dict.items() if k not in ("event", "level"))
    return f"{event_dict.get('event', '')} {fields}".rstrip()


class _Text:
    """A record's message, ``"<event> key=value ..."``, made when a formatter asks for it (``str``): the CLIs'
    handler renders the event dict instead, so a JSON log line never pays for the text."""

    __slots__ = ("_event",)

    def __init__(self, event_dict: Mapping[str, Any]) -> None:
        self._event = event_dict

    def __str__(self) -> str:
        return _text(self._event)

    def __repr__(self) -> str:
        return repr(str(self))


def _to_record(logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> tuple[
    tuple[Any, ...], dict[str, Any]
]:
    """The last processor: the stdlib call's arguments (the message text; the event dict as ``record.fedguard``)."""
    exc_info = event_dict.pop("exc_info", None)
    if name == "exception" and not exc_info:
        exc_info = True
    event = dict(event_dict)
    return (_Text(event),), {"extra": {EVENT_ATTR: event}, "exc_info": exc_info or None}


class _BoundLogger(structlog.stdlib.BoundLogger):
    """structlog's stdlib-bound logger whose ``debug`` and ``info`` return at once when the stdlib logger would drop
    them: the decision :func:`structlog.stdlib.filter_by_level` (the first processor) makes later, before the event
    dict is built and the processors run (a dropped debug line cost ~12 µs in the server's update path, three per
    client-round: ``tools/bench/bench_rounds.py --cpu-breakdown``)."""

    def debug(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if not self._logger.isEnabledFor(logging.DEBUG):
            return None
        return super().debug(event, *args, **kw)

    def info(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        if not self._logger.isEnabledFor(logging.INFO):
            return None
        return super().info(event, *args, **kw)


def get_logger(component: str, level: str = "debug") -> Any:
    """A structlog logger writing to the stdlib logger :func:`logger_name` (``component`` is bound as a field).
    ``level``: this logger drops events below it whatever the stdlib levels say (a client's ``log_level``); the
    stdlib logger's effective level (the app's, or :func:`configure_logging`'s) filters on top."""
    stdlib = logging.getLogger(logger_name(component))
    processors: list[Any] = [structlog.stdlib.filter_by_level]
    if level != "debug":
        processors.append(_min_level(level))
    processors += [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level, _to_record]
    return structlog.wrap_logger(stdlib, processors=processors, wrapper_class=_BoundLogger,
                                 context_class=dict).bind(component=component)


# ---- the process side: what the CLIs configure ----

def _event_of(record: logging.LogRecord) -> dict[str, Any]:
    ev = getattr(record, EVENT_ATTR, None)
    if isinstance(ev, dict):
        return dict(ev)
    # A plain logging call under fedguard.* (not through get_logger): its message is the event.
    return {"event": record.getMessage(), "logger": record.name, "level": record.levelname.lower()}


class _ConsoleFilter(logging.Filter):
    """:func:`console_filter` on the console handler: drops :data:`CONSOLE_DEBUG_EVENTS`, shortens
    :data:`CONSOLE_FIELDS`; the shortened event dict is kept on the record for :class:`_EventFormatter`."""

    def __init__(self, level: str) -> None:
        super().__init__()
        self._proc = console_filter(level)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.fedguard_console = self._proc(None, "", _event_of(record))
        except structlog.DropEvent:
            return False
        return True


class _EventFormatter(logging.Formatter):
    """Renders a record's event dict as the CLIs always did: structlog's ``ConsoleRenderer`` (people) or
    ``JSONRenderer`` (machines), with an ISO UTC timestamp and the exception's traceback."""

    def __init__(self, json: bool) -> None:
        super().__init__()
        # JSON lines are strict JSON: a NaN or infinite number is written as null (fedcore.jsonio)
        self._renderer: Any = (structlog.processors.JSONRenderer(serializer=jsonio.dumps) if json
                               else structlog.dev.ConsoleRenderer(colors=False))

    def format(self, record: logging.LogRecord) -> str:
        shortened = getattr(record, "fedguard_console", None)
        ev = dict(shortened) if isinstance(shortened, dict) else _event_of(record)
        stamp = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        ev["timestamp"] = stamp.isoformat().replace("+00:00", "Z")
        if record.exc_info:
            ev["exc_info"] = record.exc_info
            ev = dict(structlog.processors.format_exc_info(None, "", ev))
        return str(self._renderer(None, "", ev))


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler :func:`configure_logging` installs (the next call replaces it: never two)."""


def configure_logging(json: bool = False, level: str = "info", stream: Any = None) -> None:
    """Configure logging for a fedguard *process* (the CLIs, tools, tests): one handler on the ``fedguard`` logger
    rendering ``ConsoleRenderer`` lines for people (one short line per round, no per-update lines unless ``level``
    is debug: :func:`console_filter`) or ``JSONRenderer`` lines for machines (every event, whole), to ``stream``,
    by default the process's current ``sys.stderr``. The ``fedguard`` logger's level becomes ``level`` and it stops
    propagating to the root logger (each line is written once). A second call replaces the first one's handler.
    An app embedding fedguard does not call this: it configures ``logging.getLogger("fedguard")`` itself."""
    root = logging.getLogger(ROOT_LOGGER)
    for old in [h for h in root.handlers if isinstance(h, _CliHandler)]:
        root.removeHandler(old)
    handler = _CliHandler(stream or _Stderr())
    if not json:
        handler.addFilter(_ConsoleFilter(level))
    handler.setFormatter(_EventFormatter(json))
    root.addHandler(handler)
    root.setLevel(_LEVELS[level])
    root.propagate = False
