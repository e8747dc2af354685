"""The daemon's durable state: clients and an event log in SQLite (WAL) under the state directory.

Every change is one transaction; a state change is checked against :data:`ALLOWED` inside the same
transaction that writes it and the event that records it, so a crash never leaves a client half
moved. A database is moved aside (never deleted) only when SQLite says it is damaged; a fresh one
records an error event naming where the old one went (docs/design.md D6). A lock, a full disk or a
read-only directory never count as damage (:mod:`gpushare.daemon.registry.store`). Client ids are
never reused, across databases too (:mod:`gpushare.daemon.registry.ids`).

The clients that are not in a final state are also held in memory, decoded, so the control loop
reads them every tick without a query (:meth:`Registry.clients`). SQLite stays the truth: every
write commits first and only then changes the memory copy, so a crash loses nothing a second
:class:`Registry` on the same file would not see, and a refused write changes neither. A commit by
another connection (``PRAGMA data_version`` moves) makes the next read reload the copy. That query
is asked only after a write reached the database's files (inotify,
:class:`~gpushare.node.inotify.WriteWatch`): a read with nothing written since the last costs no
SQLite call (the control loop reads every tick).

One exception keeps the daemon in control when the database cannot be written (a full disk, a
read-only file system, a lock held past the busy timeout): a change to a known client or an event
is then applied to the memory copy and kept in a backlog (:mod:`gpushare.daemon.registry.backlog`)
that every later write and every ``clients()`` read (at most once a second) tries to write, in
order. Meanwhile what would add work is refused (:class:`RegistryUnavailableError`: new clients,
adoption registrations), and a crash loses only the backlog (the processes are re-adopted from
what was written, as after any crash).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from gpushare.daemon.registry import ids, store
from gpushare.daemon.registry.records import (
    ALLOWED,
    ClientRecord,
    Event,
    EventRow,
    Registration,
    RegistryError,
    RegistryUnavailableError,
    TransitionError,
    check_fields,
    record,
)
from gpushare.daemon.registry.records import event as event_of
from gpushare.daemon.registry.writer import WRITE_BUSY_TIMEOUT_MS, EventRetention, Writer
from gpushare.model import ClientClass, ClientState

__all__ = [
    "ALLOWED",
    "ClientRecord",
    "Event",
    "EventRetention",
    "Registration",
    "Registry",
    "RegistryError",
    "RegistryUnavailableError",
    "TransitionError",
]

log = structlog.get_logger(__name__)

S = ClientState
SCHEMA_VERSION = store.SCHEMA_VERSION
OPEN_BUSY_TIMEOUT_S = 10.0
"""How long opening waits for another process's lock before it fails (one line, nothing moved)."""


# A client that failed or was lost is a warning in the event log, not news (issue 29).
_TRANSITION_SEVERITY = {ClientState.FAILED: "warning", ClientState.LOST: "warning"}


class Registry(Writer):
    """Clients and events in one SQLite database; safe to share between threads.

    Use :meth:`open`, which deals with a damaged file, or :meth:`in_memory`.
    """

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        busy_timeout_s: float = OPEN_BUSY_TIMEOUT_S,
        id_floor: int = 0,
        retention: EventRetention | None = None,
    ) -> Registry:
        """Open (or create) the database at ``path``, moving it aside only if SQLite says damaged.

        Args:
            path: the database file; its directory is created 0700 when missing.
            busy_timeout_s: how long to wait for another process's lock.
            id_floor: the highest client id number still visible on the host (logs, cgroups):
                no new id is at or below it, should the id mark be lost.
            retention: how events are pruned.

        Raises:
            RegistryError: the cause in one line (locked, full, read-only, not a gpushare
                database, a bad id mark); nothing was renamed and no empty file is left.
        """
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise RegistryError(
                f"cannot create the state directory {path.parent}: {exc.strerror or exc}"
            ) from exc
        mark = ids.read(path.parent)
        moved_to: Path | None = None
        problem = ""
        try:
            conn = store.connect(path, busy_timeout_s)
        except store.DamagedError as exc:
            problem = str(exc)
            try:
                moved_to = store.move_aside(path)
            except OSError as exc2:
                raise RegistryError(
                    f"the state database {path} is damaged ({problem}) and cannot be moved "
                    f"aside: {exc2.strerror or exc2}"
                ) from exc2
            conn = store.connect(path, busy_timeout_s)
        conn.execute(f"PRAGMA busy_timeout = {WRITE_BUSY_TIMEOUT_MS}")
        id_mark = ids.for_database(conn, path.parent, mark, id_floor)
        registry = cls(conn, path, id_mark=id_mark, retention=retention)
        if moved_to is not None:
            log.error("registry_corrupt", path=str(path), moved_to=str(moved_to), error=problem)
            registry.add_event(
                "registry_corrupt",
                f"the state database was damaged ({problem}); moved aside to {moved_to} and "
                f"a fresh one started; clients recorded only there are not supervised; new "
                f"client ids continue after c{id_mark.floor}",
                severity="error",
                data={"moved_to": str(moved_to), "error": problem, "epoch": id_mark.epoch},
            )
        registry.prune_events()
        return registry

    @classmethod
    def in_memory(cls, clock: Callable[[], float] = time.time) -> Registry:
        """A registry that lives only as long as this object (the simulator's, and tests').

        ``clock`` stamps what is recorded without an explicit time (the simulator's virtual
        seconds, so that its events line up with the run).
        """
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        store.prepare(conn)
        return cls(conn, Path(":memory:"), clock=clock)

    def close(self) -> None:
        """Write what waits in the backlog if possible, then close the database."""
        with self._lock:
            if self._backlog:
                self._flush()
            if self._backlog:
                log.error("registry_closed_unwritten", **self._backlog.summary())
            self._conn.close()
            if self._watch is not None:
                self._watch.close()

    @property
    def epoch(self) -> int:
        """Which database of this host's life this is (1 for the first; 0 in memory)."""
        return self._ids.epoch if self._ids is not None else 0

    # ----------------------------------------------------------------------------- clients

    def add_client(
        self,
        *,
        cls: ClientClass,
        argv: Sequence[str],
        uid: int,
        gid: int,
        user: str,
        state: ClientState,
        priority: int,
        name: str | None = None,
        gpu_request: str | None = None,
        gpu_uuid: str | None = None,
        gpu_index: int | None = None,
        sm_ceiling: float | None = None,
        sm_pct: float | None = None,
        mem_bytes: int | None = None,
        slo_p99_ms: float | None = None,
        restartable: bool = False,
        checkpoint_signal: int = 10,
        detach: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        pause_mechanism: str | None = None,
        adopted_by: str | None = None,
        now: float | None = None,
        client_id: str | None = None,
    ) -> ClientRecord:
        """Record a new client and a ``client_submitted`` (or ``client_adopted``) event.

        The id is ``c<number>``, never one used before on this host, unless ``client_id`` names
        it (the simulator keeps its scenario's names); a taken id raises :class:`RegistryError`.

        Raises:
            RegistryUnavailableError: the database cannot be written now; nothing was recorded.
        """
        at = self._clock() if now is None else now
        values = (
            name, cls.value, json.dumps(list(argv)), uid, gid, user, gpu_request, gpu_uuid,
            gpu_index, sm_ceiling, sm_pct, mem_bytes, priority, slo_p99_ms, int(restartable),
            checkpoint_signal, int(detach), json.dumps(dict(env or {})), cwd, state.value,
            pause_mechanism, at, adopted_by,
        )  # fmt: skip
        with self._lock:
            self._refuse_new_work("new clients")
            try:
                with self._tx() as conn:
                    self._keep_above_floor(conn)
                    cur = conn.execute(
                        "INSERT INTO clients (id, name, cls, argv, uid, gid, user, gpu_request,"
                        " gpu_uuid, gpu_index, sm_ceiling, sm_pct, mem_bytes, priority,"
                        " slo_p99_ms, restartable, checkpoint_signal, detach, env, cwd, state,"
                        f" pause_mechanism, submitted_at, adopted_by) VALUES ('', {', '.join('?' * 23)})",
                        values,
                    )  # fmt: skip
                    seq = int(cur.lastrowid or 0)
                    self._cover(seq)
                    if client_id is None:
                        client_id = f"c{seq}"
                    elif conn.execute(
                        "SELECT 1 FROM clients WHERE id = ?", (client_id,)
                    ).fetchone():
                        raise RegistryError(f"client id {client_id!r} is taken")
                    conn.execute("UPDATE clients SET id = ? WHERE seq = ?", (client_id, seq))
                    if adopted_by is None:
                        kind, text = (
                            "client_submitted",
                            f"submitted by {user} in state {state.value}",
                        )
                    else:
                        kind, text = "client_adopted", f"of {user} adopted by {adopted_by}"
                    self._event(conn, EventRow(
                        at, kind, "info", client_id, gpu_uuid,
                        f"{cls.value} client {client_id} {text}", None,
                    ))  # fmt: skip
                    rec = self._get(conn, client_id)
            except sqlite3.Error as exc:
                raise self._unavailable(exc, "new clients") from exc
        return self._committed(rec)

    def transition(
        self,
        client_id: str,
        to: ClientState,
        *,
        reason: str | None = None,
        expect: ClientState | None = None,
        now: float | None = None,
        **updates: Any,
    ) -> ClientRecord:
        """Move a client to state ``to`` (plus field ``updates``) and log it, in one transaction.

        Raises:
            RegistryError: no such client, or an unknown field.
            TransitionError: the move is not in :data:`ALLOWED`, or ``expect`` does not match.
        """
        at = self._clock() if now is None else now
        check_fields(updates)
        with self._lock:
            current = self._current(client_id)
            if expect is not None and current.state is not expect:
                raise TransitionError(
                    f"client {client_id} is {current.state.value}, expected {expect.value}"
                )
            if to is not current.state and to not in ALLOWED[current.state]:
                raise TransitionError(
                    f"client {client_id} cannot go from {current.state.value} to {to.value}"
                )
            fields = dict(updates)
            fields["reason"] = reason
            if to.is_final and "ended_at" not in fields:
                fields["ended_at"] = at
            row = None
            if to is not current.state:
                msg = f"client {client_id}: {current.state.value} -> {to.value}"
                row = EventRow(
                    at, f"client_{to.value}", _TRANSITION_SEVERITY.get(to, "info"),
                    client_id, current.gpu_uuid,
                    msg + (f" ({reason})" if reason else ""),
                    {"from": current.state.value, "to": to.value, "reason": reason},
                )  # fmt: skip
            return self._change(current, fields, to, row)

    def update(self, client_id: str, **updates: Any) -> ClientRecord:
        """Change fields other than the state, in one transaction.

        Raises:
            RegistryError: no such client or an unknown field.
        """
        check_fields(updates)
        with self._lock:
            current = self._current(client_id)
            return self._change(current, updates, current.state, None)

    def get(self, client_id: str) -> ClientRecord:
        """One client.

        Raises:
            RegistryError: no such client.
        """
        with self._lock:
            self._sync()
            return self._current(client_id)

    def find(self, client_id: str) -> ClientRecord | None:
        """One client, or None."""
        try:
            return self.get(client_id)
        except RegistryError:
            return None

    def clients(self, *, include_final: bool = False, check: bool = True) -> list[ClientRecord]:
        """Clients in submission order; by default only those not in a final state.

        The live ones come from memory (no query, nothing decoded); ``include_final`` reads the
        whole table, as ``gpushare list --all`` does. ``check=False`` skips the look for other
        connections' commits (``PRAGMA data_version``): the copy as of the last look, with every
        write of this registry since. The control loop reads the clients twice a tick and looks
        once: a commit that lands between the two reads is seen at the next tick, as one that
        lands just after the look is. A look also retries the backlog, at most once a second.
        """
        with self._lock:
            if include_final:
                rows = self._conn.execute("SELECT * FROM clients ORDER BY seq").fetchall()
                return [self._backlog.rows.get(row["id"]) or record(row) for row in rows]
            if check:
                self._retry()
                self._sync()
            return list(self._live.values())

    # ----------------------------------------------------------------------------- registrations

    def register(
        self,
        source: str,
        job: str,
        owner_uid: int,
        params: Mapping[str, Any],
        now: float | None = None,
    ) -> Registration:
        """Keep (or replace) a job's ``adopt`` registration, so that it outlives a daemon restart.

        Raises:
            RegistryUnavailableError: the database cannot be written now.
        """
        at = self._clock() if now is None else now
        with self._lock:
            self._refuse_new_work("adoption registrations")
            try:
                with self._tx() as conn:
                    conn.execute(
                        "INSERT OR REPLACE INTO registrations (source, job, owner_uid, params, at)"
                        " VALUES (?, ?, ?, ?, ?)",
                        (source, job, owner_uid, json.dumps(dict(params)), at),
                    )
            except sqlite3.Error as exc:
                raise self._unavailable(exc, "adoption registrations") from exc
        return Registration(source, job, owner_uid, dict(params), at)

    def unregister(self, source: str, job: str) -> bool:
        """Drop a registration; False when there was none.

        Raises:
            RegistryUnavailableError: the database cannot be written now.
        """
        with self._lock:
            try:
                with self._tx() as conn:
                    cur = conn.execute(
                        "DELETE FROM registrations WHERE source = ? AND job = ?", (source, job)
                    )
            except sqlite3.Error as exc:
                raise self._unavailable(exc, "releases") from exc
        return cur.rowcount > 0

    def registrations(self) -> list[Registration]:
        """Every registration, oldest first."""
        with self._lock:
            rows = self._conn.execute("SELECT * FROM registrations ORDER BY at").fetchall()
        return [
            Registration(r["source"], r["job"], r["owner_uid"], json.loads(r["params"]), r["at"])
            for r in rows
        ]

    # ----------------------------------------------------------------------------- settings

    def setting(self, key: str) -> Any:
        """A value the daemon keeps across restarts (``meta`` table), or ``None``."""
        with self._lock:
            if key in self._backlog.settings:
                return self._backlog.settings[key]
            row = self._conn.execute(
                "SELECT value FROM meta WHERE key = ?", (f"setting.{key}",)
            ).fetchone()
        return json.loads(row[0]) if row is not None else None

    def keep_setting(self, key: str, value: Any) -> None:
        """Keep a JSON value across restarts (in the backlog while the database refuses it)."""
        with self._lock:
            if not self._backlog:
                try:
                    with self._tx() as conn:
                        self._setting(conn, key, value)
                except sqlite3.Error as exc:
                    self._defer(exc)
                else:
                    return
            self._backlog.settings[key] = value
            self._retry()

    # ----------------------------------------------------------------------------- events

    def add_event(
        self,
        kind: str,
        message: str,
        *,
        severity: str = "info",
        client_id: str | None = None,
        gpu_uuid: str | None = None,
        data: Mapping[str, Any] | None = None,
        now: float | None = None,
    ) -> int:
        """Append an event; returns its id (0 while it waits in the backlog)."""
        at = self._clock() if now is None else now
        row = EventRow(at, kind, severity, client_id, gpu_uuid, message, data)
        with self._lock:
            if not self._backlog:
                try:
                    with self._tx() as conn:
                        event_id = self._event(conn, row)
                except sqlite3.Error as exc:
                    self._defer(exc)
                else:
                    self._after_events(1)
                    return event_id
            self._count_event(row)
            self._backlog.add_event(row)
            self._retry()
            return 0

    def events(self, since_id: int = 0, limit: int = 100) -> list[Event]:
        """Events with id above ``since_id``, oldest first, at most ``limit``."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM events WHERE id > ? ORDER BY id LIMIT ?", (since_id, limit)
            ).fetchall()
        return [event_of(row) for row in rows]

    def last_event_id(self) -> int:
        """The id of the newest event, 0 when there is none."""
        with self._lock:
            row = self._conn.execute("SELECT MAX(id) AS m FROM events").fetchone()
        return int(row["m"] or 0)

    def event_counts(self) -> dict[tuple[str, str, str], int]:
        """Events written since the registry was opened, by ``(kind, severity, gpu_uuid or "")``."""
        with self._lock:
            return dict(self._event_counts)
