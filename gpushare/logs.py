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
        renderer = [traceback_processor(), structlog.processors.JSONRenderer()]
    else:
        renderer = [
            structlog.dev.ConsoleRenderer(
                colors=sys.stderr.isatty(), exception_formatter=console_exception_formatter()
            )
        ]
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def traceback_processor() -> structlog.processors.ExceptionRenderer:
    """Tracebacks as JSON dicts, without the frames' local variables.

    structlog's ``dict_tracebacks`` shows locals by default; a handler's locals hold what a user
    submitted (a job's environment, with its passwords), and the daemon's log is kept.
    """
    return structlog.processors.ExceptionRenderer(
        structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
    )


def console_exception_formatter() -> structlog.typing.ExceptionRenderer:
    """Tracebacks on a TTY: rich's where installed, without local variables (as above)."""
    try:
        import rich  # noqa: F401 - only whether it is installed
    except ImportError:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)
