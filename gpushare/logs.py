"""Logging: structlog to stderr, a console renderer on a TTY and JSON otherwise (journald).

Event names are stable snake_case (``tick``, ``client_admitted``, ``mps_restarted``); context is
bound as keys (``gpu=``, ``client_id=``), never formatted into the message.

Under systemd, stderr goes to the journal, which stores every line at priority info unless the
line starts with a syslog priority, ``<N>`` (sd-daemon(3)). When stderr is the journal stream
(``$JOURNAL_STREAM`` names its device and inode, systemd.exec(5)), each JSON line gets that
prefix, so ``journalctl -u gpushare -p warning`` shows the warnings and errors alone.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR}  # fmt: skip


#: Syslog priorities (syslog(3)) of structlog's levels; journald reads them from a ``<N>`` prefix.
SYSLOG_PRIORITY = {"debug": 7, "info": 6, "warning": 4, "error": 3, "exception": 3,
                   "critical": 2}  # fmt: skip


def stderr_is_journal(env: Mapping[str, str] | None = None, stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (stderr) is the journal stream that ``$JOURNAL_STREAM`` names.

    systemd sets ``JOURNAL_STREAM=DEVICE:INODE`` for a service whose output goes to the journal;
    a process that redirected its stderr elsewhere still inherits the variable, so the
    descriptor itself is compared.
    """
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat((sys.stderr if stream is None else stream).fileno())
    except (OSError, ValueError, AttributeError):
        return False  # no descriptor (a test's captured stream), or closed
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class JournalPriority:
    """A renderer wrapper: the rendered line, prefixed with the event's syslog priority."""

    def __init__(self, inner: structlog.processors.JSONRenderer) -> None:
        self._inner = inner

    def __call__(self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> str:
        """Render the event, then put ``<N>`` before it (``level`` set by ``add_log_level``)."""
        priority = SYSLOG_PRIORITY.get(str(event_dict.get("level", method_name)), 6)
        line = self._inner(logger, method_name, event_dict)
        return f"<{priority}>{line if isinstance(line, str) else line.decode()}"


def configure_logging(
    level: str = "info", *, json: bool | None = None, journal: bool | None = None
) -> None:
    """Set up structlog once per entry point.

    Args:
        level: one of ``debug``, ``info``, ``warning``, ``error``.
        json: force JSON (True) or console (False) output; by default JSON unless stderr is a TTY.
        journal: prefix each line with its syslog priority (JSON only); by default when stderr is
            the journal stream (:func:`stderr_is_journal`).

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
        render: Any = structlog.processors.JSONRenderer()
        if stderr_is_journal() if journal is None else journal:
            render = JournalPriority(render)
        renderer = [traceback_processor(), render]
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
