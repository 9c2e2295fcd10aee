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


def configure_logging(json: bool = False, level: str = "info", stream: Any = None) -> None:
    """Configure structlog for a process: ``ConsoleRenderer`` for people, ``JSONRenderer`` for machines.
    Lines go to ``stream``, by default to the process's current ``sys.stderr``."""
    renderer: Any = (structlog.processors.JSONRenderer() if json
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
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
