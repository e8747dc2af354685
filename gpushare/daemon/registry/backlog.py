"""Writes the database could not take yet, kept in memory until it can (see the package docstring).

Client changes are kept as whole records, the newest per client (writing it again is the same as
writing each change in turn); events in order, at most :data:`MAX_EVENTS` (the oldest beyond are
dropped and counted: a disk that stays full for a day must not fill the daemon's memory instead).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from gpushare.daemon.registry.records import UPDATABLE, ClientRecord, EventRow

MAX_EVENTS = 10_000


class Backlog:
    """What waits for the database, and since when and why."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        #: The newest unwritten record of each client changed since the database failed.
        self.rows: dict[str, ClientRecord] = {}
        #: Settings kept across restarts (``Registry.keep_setting``), the newest value of each.
        self.settings: dict[str, Any] = {}
        self._events: deque[EventRow] = deque(maxlen=max_events)
        self.dropped = 0
        self.cause = ""
        self.since = 0.0

    def __bool__(self) -> bool:
        return bool(self.rows or self.settings or self._events or self.cause)

    def started(self, cause: str) -> None:
        """The first write that failed: remember why and when."""
        self.cause = cause
        self.since = time.time()

    def add_row(self, rec: ClientRecord) -> None:
        """Keep a client's newest record."""
        self.rows[rec.id] = rec

    def add_event(self, row: EventRow) -> None:
        """Keep an event (dropping the oldest kept one when full)."""
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(row)

    def pending_events(self) -> list[EventRow]:
        """The kept events, oldest first."""
        return list(self._events)

    @staticmethod
    def fields(rec: ClientRecord) -> dict[str, Any]:
        """Every changeable field of a kept record but the state (written beside it)."""
        return {key: getattr(rec, key) for key in sorted(UPDATABLE)}

    def resumed_event(self) -> EventRow:
        """The event that records the outage once it is written."""
        now = time.time()
        lost = f"; {self.dropped} older events were dropped" if self.dropped else ""
        return EventRow(
            now, "registry_write_resumed", "warning", None, None,
            f"the state database could not be written for {now - self.since:.0f}s "
            f"({self.cause}); {len(self.rows)} client changes and {len(self._events)} events "
            f"kept in memory are written now{lost}",
            self.summary(),
        )  # fmt: skip

    def summary(self) -> dict[str, Any]:
        """Counts for logs and status."""
        return {
            "cause": self.cause,
            "since": self.since,
            "clients": len(self.rows),
            "events": len(self._events),
            "dropped_events": self.dropped,
        }

    def clear(self) -> None:
        """Everything was written."""
        self.rows.clear()
        self.settings.clear()
        self._events.clear()
        self.dropped = 0
        self.cause = ""
        self.since = 0.0
