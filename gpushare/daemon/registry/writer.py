"""The registry's write path: transactions, the memory copy of the live clients, the backlog.

:class:`Writer` is the base of :class:`~gpushare.daemon.registry.Registry` (see the package
docstring for the rules): every write commits first and then updates the memory copy; a write the
database refuses for a cause that passes (full, read-only, locked: :func:`store.transient`) is
applied to the memory copy and kept in the backlog, retried at most once a second by later writes
and reads, and written in one transaction when the database takes it again.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from gpushare.daemon.registry import ids, store
from gpushare.daemon.registry.backlog import Backlog
from gpushare.daemon.registry.records import (
    ClientRecord,
    EventRow,
    RegistryError,
    RegistryUnavailableError,
    applied,
    check_fields,
    column_value,
    record,
)
from gpushare.model import ClientState
from gpushare.node.inotify import WriteWatch

log = structlog.get_logger(__name__)

WRITE_BUSY_TIMEOUT_MS = 100
"""How long a write waits for a lock while running: the daemon's lock is held meanwhile, so
longer would stall the control loop; a write that waits longer goes to the backlog."""
RETRY_INTERVAL_S = 1.0
_PRUNE_EVERY = 256  # events written between two prunes


@dataclass(frozen=True, slots=True)
class EventRetention:
    """How long events are kept: by age and by count (``daemon.events_max_*``)."""

    max_age_s: float = 30 * 86400.0
    max_rows: int = 100_000


class Writer:
    """One SQLite connection, its transactions, the live clients in memory and the backlog."""

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: Path,
        *,
        id_mark: ids.IdMark | None = None,
        retention: EventRetention | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._conn = conn
        # What stamps a record or an event the caller gives no time for: the wall clock, or
        # the simulator's virtual seconds (its events read on the run's own time line).
        self._clock = clock
        self._lock = threading.RLock()
        self.path = path
        self._ids = id_mark
        self._floor_checked = id_mark is None
        self.retention = retention or EventRetention()
        self._since_prune = 0
        # Events written since this process opened the registry, by (kind, severity, GPU):
        # the exporter's gpushare_events_total. Kinds are fixed strings of the code: bounded.
        self._event_counts: Counter[tuple[str, str, str]] = Counter()
        # The live (not final) clients in submission order, as committed; see the module doc.
        self._live: dict[str, ClientRecord] = {}
        self._backlog = Backlog()
        self._retry_at = 0.0
        self._data_version = -1
        # No other connection can reach a private in-memory database: nothing to look for.
        self._private = str(path) == ":memory:"
        self._watch = None if self._private else WriteWatch((path, Path(f"{path}-wal")))
        if self._watch is not None:
            self._watch.written()  # watching from here on: what was written before is read now
        self._data_version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        self._reload()

    def unwritten(self) -> dict[str, Any]:
        """What waits in memory for the database (empty when nothing does): for status and logs."""
        with self._lock:
            return self._backlog.summary() if self._backlog else {}

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException:
                # SQLite rolls back by itself after some errors (a full disk): no second rollback.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                raise

    def prune_events(self, now: float | None = None) -> int:
        """Delete events older than the retention's age and the oldest beyond its count.

        Returns:
            How many were deleted (0 when the database cannot be written now: tried again later).
        """
        at = self._clock() if now is None else now
        keep = self.retention
        with self._lock:
            self._since_prune = 0
            try:
                with self._tx() as conn:
                    n = conn.execute("DELETE FROM events WHERE at < ?", (at - keep.max_age_s,))
                    deleted = n.rowcount
                    n = conn.execute(
                        "DELETE FROM events WHERE id <= (SELECT id FROM events ORDER BY id DESC"
                        " LIMIT 1 OFFSET ?)",
                        (keep.max_rows,),
                    )
                    deleted += n.rowcount
            except sqlite3.Error as exc:
                if not store.transient(exc):
                    raise
                return 0
        if deleted:
            log.info("events_pruned", deleted=deleted)
        return deleted

    def _change(
        self,
        current: ClientRecord,
        fields: Mapping[str, Any],
        to: ClientState,
        row: EventRow | None,
    ) -> ClientRecord:
        """Write a checked change of ``current`` (and its event); to the backlog if need be."""
        if not self._backlog:
            try:
                with self._tx() as conn:
                    self._update(conn, current.id, fields, to)
                    if row is not None:
                        self._event(conn, row)
                    rec = self._get(conn, current.id)
            except sqlite3.Error as exc:
                self._defer(exc)
            else:
                if row is not None:
                    self._after_events(1)
                return self._committed(rec)
        rec = applied(current, fields, to)
        self._backlog.add_row(rec)
        if row is not None:
            self._count_event(row)
            self._backlog.add_event(row)
        self._in_memory(rec)
        self._retry()
        return rec

    def _defer(self, exc: sqlite3.Error) -> None:
        """Start (or go on) keeping writes in memory; re-raise what retrying cannot cure."""
        if not store.transient(exc):
            raise RegistryError(f"the state database refused a write: {exc}") from exc
        if not self._backlog:
            self._backlog.started(store.cause(exc, WRITE_BUSY_TIMEOUT_MS / 1000))
            log.error("registry_write_deferred", path=str(self.path), **self._backlog.summary())
        self._retry_at = time.monotonic() + RETRY_INTERVAL_S

    def _retry(self) -> None:
        if self._backlog and time.monotonic() >= self._retry_at:
            self._flush()

    def _flush(self) -> None:
        """Write the backlog in one transaction; on failure it stays for the next try."""
        self._retry_at = time.monotonic() + RETRY_INTERVAL_S
        summary = self._backlog.summary()
        try:
            with self._tx() as conn:
                for rec in self._backlog.rows.values():
                    self._update(conn, rec.id, self._backlog.fields(rec), rec.state)
                for key, value in self._backlog.settings.items():
                    self._setting(conn, key, value)
                for row in self._backlog.pending_events():
                    self._event(conn, row, count=False)
                self._event(conn, self._backlog.resumed_event(), count=True)
        except sqlite3.Error as exc:
            if not store.transient(exc):
                log.exception("registry_backlog_write_failed")
            return
        written = len(self._backlog.rows)
        self._after_events(summary["events"])
        self._backlog.clear()
        log.warning("registry_write_resumed", path=str(self.path), **summary)
        if written:
            self._sync()

    def _refuse_new_work(self, what: str) -> None:
        if self._backlog:
            self._flush()
        if self._backlog:
            raise RegistryUnavailableError(
                f"the state database {self.path} cannot be written "
                f"({self._backlog.summary()['cause']}); {what} are refused until it can"
            )

    def _unavailable(self, exc: sqlite3.Error, what: str) -> RegistryError:
        if store.transient(exc):
            why = store.cause(exc, WRITE_BUSY_TIMEOUT_MS / 1000)
            return RegistryUnavailableError(
                f"the state database {self.path} cannot be written ({why}); {what} are refused "
                "until it can"
            )
        return RegistryError(f"the state database refused a write: {exc}")

    def _cover(self, seq: int) -> None:
        """Reserve ``seq`` in the id mark before the id is committed (ids.IdMark.cover)."""
        if self._ids is None:
            return
        try:
            self._ids.cover(seq)
        except OSError as exc:
            raise RegistryUnavailableError(
                f"the client id mark in {self._ids.state_dir} cannot be written "
                f"({exc.strerror or exc}); new clients are refused until it can"
            ) from exc

    def _keep_above_floor(self, conn: sqlite3.Connection) -> None:
        """A database younger than the id mark continues its numbers after the mark's floor."""
        if self._floor_checked or self._ids is None:
            return
        floor = self._ids.floor
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'clients'").fetchone()
        if row is None:
            conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('clients', ?)", (floor,))
        elif row[0] < floor:
            conn.execute("UPDATE sqlite_sequence SET seq = ? WHERE name = 'clients'", (floor,))
        self._floor_checked = True

    def _current(self, client_id: str) -> ClientRecord:
        """The client as the registry knows it: memory first (it holds the backlog), then the file."""
        rec = self._live.get(client_id) or self._backlog.rows.get(client_id)
        return rec if rec is not None else self._get(self._conn, client_id)

    def _committed(self, rec: ClientRecord) -> ClientRecord:
        """Bring the memory copy in line with ``rec``, a row just committed by this connection."""
        with self._lock:
            self._in_memory(rec)
            # Our own commit moved nothing for data_version (it counts other connections'
            # commits); read it anyway so a commit of another connection just before ours is
            # not mistaken as seen.
            self._sync()
        return rec

    def _in_memory(self, rec: ClientRecord) -> None:
        if rec.state.is_final:
            self._live.pop(rec.id, None)
        else:
            # A new client has the highest seq: appending keeps submission order.
            self._live[rec.id] = rec

    def _sync(self) -> None:
        """Reload the live clients when another connection committed since the last look."""
        if self._private or (self._watch is not None and not self._watch.written()):
            return  # nothing written since the last look (which read data_version after it)
        version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        if version == self._data_version:
            return
        self._data_version = version
        self._reload()

    def _reload(self) -> None:
        rows = self._conn.execute(
            "SELECT * FROM clients WHERE state NOT IN ('exited', 'failed', 'lost') ORDER BY seq"
        ).fetchall()
        self._live = {row["id"]: record(row) for row in rows}
        for rec in self._backlog.rows.values():  # newer than the file
            self._in_memory(rec)

    @staticmethod
    def _get(conn: sqlite3.Connection, client_id: str) -> ClientRecord:
        row = conn.execute("SELECT * FROM clients WHERE id = ?", (client_id,)).fetchone()
        if row is None:
            raise RegistryError(f"no client {client_id!r}; see `gpushare list --all`")
        return record(row)

    @staticmethod
    def _update(
        conn: sqlite3.Connection,
        client_id: str,
        updates: Mapping[str, Any],
        state: ClientState | None = None,
    ) -> None:
        check_fields(updates)
        columns: list[str] = []
        values: list[Any] = []
        if state is not None:
            columns.append("state = ?")
            values.append(state.value)
        for key, value in updates.items():
            columns.append(f"{key} = ?")
            values.append(column_value(key, value))
        if columns:
            conn.execute(
                f"UPDATE clients SET {', '.join(columns)} WHERE id = ?",  # column names are fixed
                (*values, client_id),
            )

    def _event(self, conn: sqlite3.Connection, row: EventRow, *, count: bool = True) -> int:
        cur = conn.execute(
            "INSERT INTO events (at, kind, severity, client_id, gpu_uuid, message, data)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                row.at, row.kind, row.severity, row.client_id, row.gpu_uuid, row.message,
                json.dumps(row.data) if row.data else None,
            ),
        )  # fmt: skip
        if count:
            self._count_event(row)
        return int(cur.lastrowid or 0)

    @staticmethod
    def _setting(conn: sqlite3.Connection, key: str, value: Any) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
            (f"setting.{key}", json.dumps(value)),
        )

    def _count_event(self, row: EventRow) -> None:
        self._event_counts[(row.kind, row.severity, row.gpu_uuid or "")] += 1

    def _after_events(self, n: int) -> None:
        self._since_prune += n
        if self._since_prune >= _PRUNE_EVERY:
            self.prune_events()
