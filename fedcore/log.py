"""Structured logging: one event name per happening, key/value fields, console or JSON rendering."""

from __future__ import annotations

import logging
import sys
import typing
from typing import Any, TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


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
                        "beta_hat", "beta", "nfl_count", "central_accuracy", "seconds"),
}
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
            return {k: _short(v) for k, v in event_dict.items() if k in keep or k in _ALWAYS}
        return event_dict

    return proc


def configure_logging(json: bool = False, level: str = "info", stream: Any = None) -> None:
    """Configure structlog for a process: ``ConsoleRenderer`` for people (one short line per round, no per-update
    lines unless ``level`` is debug: :func:`console_filter`), ``JSONRenderer`` for machines (every event, whole).
    Lines go to ``stream``, by default to the process's current ``sys.stderr``."""
    renderer: Any = (structlog.processors.JSONRenderer() if json
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            *(() if json else (console_filter(level),)),
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream or typing.cast(TextIO, _Stderr())),
        cache_logger_on_first_use=False,
    )


def get_logger(component: str) -> Any:
    return structlog.get_logger(component=component)
