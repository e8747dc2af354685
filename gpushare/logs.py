"""Logging: structlog to stderr, a console renderer on a TTY and JSON otherwise (journald).

Event names are stable snake_case (``tick``, ``client_admitted``, ``mps_restarted``); context is
bound as keys (``gpu=``, ``client_id=``), never formatted into the message.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}  # fmt: skip


def configure_logging(level: str = "info", *, json: bool | None = None) -> None:
    """Set up structlog once per entry point.

    Args:
        level: one of ``debug``, ``info``, ``warning``, ``error``.
        json: force JSON (True) or console (False) output; by default JSON unless stderr is a TTY.

    Raises:
        ValueError: ``level`` is not a known level.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown log level {level!r}; expected one of {', '.join(LEVELS)}")
    use_json = not sys.stderr.isatty() if json is None else json
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[Any]
    if use_json:
        renderer = [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
