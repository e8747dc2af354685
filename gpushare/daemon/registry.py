"""The daemon's durable state: clients and an event log in SQLite (WAL) under the state directory.

Every change is one transaction; a state change is checked against :data:`ALLOWED` inside the same
transaction that writes it and the event that records it, so a crash never leaves a client half
moved. A database that cannot be opened or fails SQLite's quick check is moved aside (never deleted)
and a fresh one records an error event naming where the old one went (docs/design.md D6).

The clients that are not in a final state are also held in memory, decoded, so the control loop
reads them every tick without a query (:meth:`Registry.clients`). SQLite stays the truth: every
write commits first and only then changes the memory copy, so a crash loses nothing a second
:class:`Registry` on the same file would not see, and a failed write changes neither. A commit by
another connection (``PRAGMA data_version`` moves) makes the next read reload the copy. That query
is asked only after a write reached the database's files (inotify,
:class:`~gpushare.node.inotify.WriteWatch`): a read with nothing written since the last costs no
SQLite call (the control loop reads every tick).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from gpushare.model import ClientClass, ClientState
from gpushare.node.inotify import WriteWatch

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 1

S = ClientState
ALLOWED: Mapping[ClientState, frozenset[ClientState]] = {
    S.QUEUED: frozenset({S.STARTING, S.EXITED, S.FAILED, S.LOST}),
    S.STARTING: frozenset({S.RUNNING, S.THROTTLED, S.FROZEN, S.EXITED, S.FAILED, S.LOST}),
    S.RUNNING: frozenset(
        {S.THROTTLED, S.FROZEN, S.RESTARTING, S.QUEUED, S.EXITED, S.FAILED, S.LOST}
    ),
    S.THROTTLED: frozenset(
        {S.RUNNING, S.FROZEN, S.RESTARTING, S.QUEUED, S.EXITED, S.FAILED, S.LOST}
    ),
    S.FROZEN: frozenset(
        {S.RUNNING, S.THROTTLED, S.RESTARTING, S.QUEUED, S.EXITED, S.FAILED, S.LOST}
    ),
    S.RESTARTING: frozenset({S.STARTING, S.RUNNING, S.QUEUED, S.EXITED, S.FAILED, S.LOST}),
    S.EXITED: frozenset(),
    S.FAILED: frozenset(),
    S.LOST: frozenset(),
}
"""Transitions the registry accepts; every other one raises :class:`TransitionError`."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS clients (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    name TEXT,
    cls TEXT NOT NULL,
    argv TEXT NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    user TEXT NOT NULL,
    gpu_request TEXT,
    gpu_uuid TEXT,
    gpu_index INTEGER,
    sm_ceiling REAL,
    sm_pct REAL,
    mem_bytes INTEGER,
    priority INTEGER NOT NULL,
    slo_p99_ms REAL,
    latency_from TEXT,
    inflight_from TEXT,
    queue TEXT,
    restartable INTEGER NOT NULL,
    checkpoint_signal INTEGER NOT NULL,
    detach INTEGER NOT NULL,
    env TEXT NOT NULL,
    cwd TEXT,
    state TEXT NOT NULL,
    reason TEXT,
    pid INTEGER,
    start_time REAL,
    exit_code INTEGER,
    pause_mechanism TEXT,
    log_path TEXT,
    held INTEGER NOT NULL DEFAULT 0,
    restarts INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    submitted_at REAL NOT NULL,
    started_at REAL,
    ended_at REAL,
    adopted_by TEXT
);
CREATE TABLE IF NOT EXISTS registrations (
    source TEXT NOT NULL,
    job TEXT NOT NULL,
    owner_uid INTEGER NOT NULL,
    params TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (source, job)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    severity TEXT NOT NULL,
    client_id TEXT,
    gpu_uuid TEXT,
    message TEXT NOT NULL,
    data TEXT
);
"""


class RegistryError(Exception):
    """The registry cannot do what was asked (unknown client, database failure)."""


class TransitionError(RegistryError):
    """A state change that :data:`ALLOWED` does not permit."""


@dataclass(frozen=True, slots=True)
class ClientRecord:
    """One client as the registry stores it. Times are wall-clock seconds since the epoch."""

    id: str
    name: str | None
    cls: ClientClass
    argv: tuple[str, ...]
    uid: int
    gid: int
    user: str
    gpu_request: str | None
    gpu_uuid: str | None
    gpu_index: int | None
    sm_ceiling: float | None
    sm_pct: float | None
    mem_bytes: int | None
    priority: int
    slo_p99_ms: float | None
    latency_from: str | None
    restartable: bool
    checkpoint_signal: int
    detach: bool
    env: Mapping[str, str]
    cwd: str | None
    state: ClientState
    reason: str | None
    pid: int | None
    start_time: float | None
    exit_code: int | None
    pause_mechanism: str | None
    log_path: str | None
    held: bool
    restarts: int
    failures: int
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    adopted_by: str | None = None
    """For a process gpushare adopted rather than launched: the rule that adopted it
    (``rule 'marker' (/etc/gpushare/gpushare.toml)``, ``slurm job 42``); ``None`` for a launched one."""
    # Request gating (docs/controller.md): an online client's --inflight-from gauge, an offline
    # client's --queue mode (None: deep).
    inflight_from: str | None = None
    queue: str | None = None
    expected_s: float | None = None
    """An offline job's declared length (``submit --time``): the queue starts shorter jobs first."""


@dataclass(frozen=True, slots=True)
class Registration:
    """A scheduler job registered by an ``adopt`` request, kept until its ``release``."""

    source: str
    job: str
    owner_uid: int
    """Who registered it (the caller's uid): 0 may adopt anyone's processes in any class."""
    params: Mapping[str, Any]
    """The request's parameters (:class:`gpushare.protocol.AdoptRequest`)."""
    at: float


@dataclass(frozen=True, slots=True)
class Event:
    """One entry of the event log."""

    id: int
    at: float
    kind: str
    severity: str
    client_id: str | None
    gpu_uuid: str | None
    message: str
    data: Mapping[str, Any] | None


_JSON_FIELDS = {"argv", "env"}
_BOOL_FIELDS = {"restartable", "detach", "held"}
_UPDATABLE = {f.name for f in dataclasses.fields(ClientRecord)} - {"id", "state", "submitted_at"}


class Registry:
    """Clients and events in one SQLite database; safe to share between threads.

    Use :meth:`open`, which deals with a corrupted file.
    """

    def __init__(self, conn: sqlite3.Connection, path: Path) -> None:
        self._conn = conn
        self._lock = threading.RLock()
        self.path = path
        # Events written since this process opened the registry, by (kind, severity, GPU):
        # the exporter's gpushare_events_total. Kinds are fixed strings of the code: bounded.
        self._event_counts: Counter[tuple[str, str, str]] = Counter()
        # The live (not final) clients in submission order, as committed; see the module doc.
        self._live: dict[str, ClientRecord] = {}
        self._data_version = -1
        # No other connection can reach a private in-memory database: nothing to look for.
        self._private = str(path) == ":memory:"
        self._watch = None if self._private else WriteWatch((path, Path(f"{path}-wal")))
        if self._watch is not None:
            self._watch.written()  # watching from here on: what was written before is read now
        self._data_version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        self._reload()

    @classmethod
    def open(cls, path: Path) -> Registry:
        """Open (or create) the database at ``path``, moving a corrupted one aside.

        Raises:
            RegistryError: the directory is unusable, or a fresh database cannot be created.
        """
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise RegistryError(f"cannot create the state directory {path.parent}: {exc}") from exc
        moved_to: Path | None = None
        problem = ""
        try:
            conn = _connect(path)
        except sqlite3.DatabaseError as exc:
            problem = str(exc)
            moved_to = _move_aside(path)
            try:
                conn = _connect(path)
            except sqlite3.DatabaseError as exc2:
                raise RegistryError(f"cannot create a fresh database at {path}: {exc2}") from exc2
        registry = cls(conn, path)
        if moved_to is not None:
            log.error("registry_corrupt", path=str(path), moved_to=str(moved_to), error=problem)
            registry.add_event(
                "registry_corrupt",
                f"the state database was unreadable ({problem}); moved aside to {moved_to} and "
                "a fresh one started; clients recorded only there are not supervised",
                severity="error",
                data={"moved_to": str(moved_to), "error": problem},
            )
        return registry

    @classmethod
    def in_memory(cls) -> Registry:
        """A registry that lives only as long as this object (the simulator's, and tests')."""
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        _prepare(conn)
        return cls(conn, Path(":memory:"))

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._conn.close()
            if self._watch is not None:
                self._watch.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

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

        The id is ``c<number>`` unless ``client_id`` names it (the simulator keeps its scenario's
        names); a taken id raises :class:`RegistryError`.
        """
        at = time.time() if now is None else now
        with self._lock, self._tx() as conn:
            cur = conn.execute(
                "INSERT INTO clients (id, name, cls, argv, uid, gid, user, gpu_request, gpu_uuid,"
                " gpu_index, sm_ceiling, sm_pct, mem_bytes, priority, slo_p99_ms, restartable,"
                " checkpoint_signal, detach, env, cwd, state, pause_mechanism, submitted_at,"
                f" adopted_by) VALUES ('', {', '.join('?' * 23)})",
                (
                    name, cls.value, json.dumps(list(argv)), uid, gid, user, gpu_request, gpu_uuid,
                    gpu_index, sm_ceiling, sm_pct, mem_bytes, priority, slo_p99_ms,
                    int(restartable), checkpoint_signal, int(detach), json.dumps(dict(env or {})),
                    cwd, state.value, pause_mechanism, at, adopted_by,
                ),
            )  # fmt: skip
            seq = cur.lastrowid
            if client_id is None:
                client_id = f"c{seq}"
            elif conn.execute("SELECT 1 FROM clients WHERE id = ?", (client_id,)).fetchone():
                raise RegistryError(f"client id {client_id!r} is taken")
            conn.execute("UPDATE clients SET id = ? WHERE seq = ?", (client_id, seq))
            if adopted_by is None:
                kind, text = "client_submitted", f"submitted by {user} in state {state.value}"
            else:
                kind, text = "client_adopted", f"of {user} adopted by {adopted_by}"
            self._event(
                conn, at, kind, "info", client_id, gpu_uuid, f"{cls.value} client {client_id} {text}",
                None,
            )  # fmt: skip
            rec = self._get(conn, client_id)
        return self._committed(rec)

    def register(
        self,
        source: str,
        job: str,
        owner_uid: int,
        params: Mapping[str, Any],
        now: float | None = None,
    ) -> Registration:
        """Keep (or replace) a job's ``adopt`` registration, so that it outlives a daemon restart."""
        at = time.time() if now is None else now
        with self._tx() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO registrations (source, job, owner_uid, params, at)"
                " VALUES (?, ?, ?, ?, ?)",
                (source, job, owner_uid, json.dumps(dict(params)), at),
            )
        return Registration(source, job, owner_uid, dict(params), at)

    def unregister(self, source: str, job: str) -> bool:
        """Drop a registration; False when there was none."""
        with self._tx() as conn:
            cur = conn.execute(
                "DELETE FROM registrations WHERE source = ? AND job = ?", (source, job)
            )
        return cur.rowcount > 0

    def registrations(self) -> list[Registration]:
        """Every registration, oldest first."""
        with self._lock:
            rows = self._conn.execute("SELECT * FROM registrations ORDER BY at").fetchall()
        return [
            Registration(r["source"], r["job"], r["owner_uid"], json.loads(r["params"]), r["at"])
            for r in rows
        ]

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
            RegistryError: no such client.
            TransitionError: the move is not in :data:`ALLOWED`, or ``expect`` does not match.
        """
        at = time.time() if now is None else now
        with self._lock, self._tx() as conn:
            current = self._get(conn, client_id)
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
            self._update(conn, client_id, fields, state=to)
            if to is not current.state:
                msg = f"client {client_id}: {current.state.value} -> {to.value}"
                self._event(
                    conn, at, f"client_{to.value}", _TRANSITION_SEVERITY.get(to, "info"),
                    client_id, current.gpu_uuid,
                    msg + (f" ({reason})" if reason else ""),
                    {"from": current.state.value, "to": to.value, "reason": reason},
                )  # fmt: skip
            rec = self._get(conn, client_id)
        return self._committed(rec)

    def update(self, client_id: str, **updates: Any) -> ClientRecord:
        """Change fields other than the state, in one transaction.

        Raises:
            RegistryError: no such client or an unknown field.
        """
        with self._lock, self._tx() as conn:
            self._get(conn, client_id)
            self._update(conn, client_id, updates)
            rec = self._get(conn, client_id)
        return self._committed(rec)

    def get(self, client_id: str) -> ClientRecord:
        """One client.

        Raises:
            RegistryError: no such client.
        """
        with self._lock:
            self._sync()
            live = self._live.get(client_id)
            return live if live is not None else self._get(self._conn, client_id)

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
        lands just after the look is.
        """
        with self._lock:
            if include_final:
                rows = self._conn.execute("SELECT * FROM clients ORDER BY seq").fetchall()
                return [_record(row) for row in rows]
            if check:
                self._sync()
            return list(self._live.values())

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
        """Append an event; returns its id."""
        at = time.time() if now is None else now
        with self._tx() as conn:
            return self._event(conn, at, kind, severity, client_id, gpu_uuid, message, data)

    def events(self, since_id: int = 0, limit: int = 100) -> list[Event]:
        """Events with id above ``since_id``, oldest first, at most ``limit``."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM events WHERE id > ? ORDER BY id LIMIT ?", (since_id, limit)
            ).fetchall()
        return [
            Event(
                id=row["id"], at=row["at"], kind=row["kind"], severity=row["severity"],
                client_id=row["client_id"], gpu_uuid=row["gpu_uuid"], message=row["message"],
                data=json.loads(row["data"]) if row["data"] else None,
            )
            for row in rows
        ]  # fmt: skip

    def last_event_id(self) -> int:
        """The id of the newest event, 0 when there is none."""
        with self._lock:
            row = self._conn.execute("SELECT MAX(id) AS m FROM events").fetchone()
        return int(row["m"] or 0)

    def _committed(self, rec: ClientRecord) -> ClientRecord:
        """Bring the memory copy in line with ``rec``, a row just committed by this connection."""
        with self._lock:
            if rec.state.is_final:
                self._live.pop(rec.id, None)
            else:
                # A new client has the highest seq: appending keeps submission order.
                self._live[rec.id] = rec
            # Our own commit moved nothing for data_version (it counts other connections'
            # commits); read it anyway so a commit of another connection just before ours is
            # not mistaken as seen.
            self._sync()
        return rec

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
        self._live = {row["id"]: _record(row) for row in rows}

    @staticmethod
    def _get(conn: sqlite3.Connection, client_id: str) -> ClientRecord:
        row = conn.execute("SELECT * FROM clients WHERE id = ?", (client_id,)).fetchone()
        if row is None:
            raise RegistryError(f"no client {client_id!r}; see `gpushare list --all`")
        return _record(row)

    @staticmethod
    def _update(
        conn: sqlite3.Connection,
        client_id: str,
        updates: Mapping[str, Any],
        state: ClientState | None = None,
    ) -> None:
        bad = set(updates) - _UPDATABLE
        if bad:
            raise RegistryError(f"unknown client field(s): {', '.join(sorted(bad))}")
        columns: list[str] = []
        values: list[Any] = []
        if state is not None:
            columns.append("state = ?")
            values.append(state.value)
        for key, value in updates.items():
            if key in _JSON_FIELDS:
                value = json.dumps(list(value) if key == "argv" else dict(value))
            elif key in _BOOL_FIELDS:
                value = int(bool(value))
            elif key == "cls":
                value = ClientClass(value).value
            columns.append(f"{key} = ?")
            values.append(value)
        if columns:
            conn.execute(
                f"UPDATE clients SET {', '.join(columns)} WHERE id = ?",  # column names are fixed
                (*values, client_id),
            )

    def event_counts(self) -> dict[tuple[str, str, str], int]:
        """Events written since the registry was opened, by ``(kind, severity, gpu_uuid or "")``."""
        with self._lock:
            return dict(self._event_counts)

    def _event(
        self,
        conn: sqlite3.Connection,
        at: float,
        kind: str,
        severity: str,
        client_id: str | None,
        gpu_uuid: str | None,
        message: str,
        data: Mapping[str, Any] | None,
    ) -> int:
        cur = conn.execute(
            "INSERT INTO events (at, kind, severity, client_id, gpu_uuid, message, data)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (at, kind, severity, client_id, gpu_uuid, message, json.dumps(data) if data else None),
        )
        self._event_counts[(kind, severity, gpu_uuid or "")] += 1
        return int(cur.lastrowid or 0)


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
    try:
        _prepare(conn)
    except BaseException:
        conn.close()
        raise
    path.chmod(0o600)
    return conn


def _prepare(conn: sqlite3.Connection) -> None:
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    row = conn.execute("PRAGMA quick_check").fetchone()
    if row is None or row[0] != "ok":
        raise sqlite3.DatabaseError(f"quick_check failed: {row[0] if row else 'no answer'}")
    conn.executescript(_SCHEMA)
    # Columns added after schema 1 shipped: an older database gains them (NULL) and stays
    # version 1 (adopted_by: launched; inflight_from, queue: none asked).
    have = {row[1] for row in conn.execute("PRAGMA table_info(clients)")}
    for column in ("adopted_by", *_ADDED_COLUMNS):
        if column not in have:
            conn.execute(f"ALTER TABLE clients ADD COLUMN {column} TEXT")
    for column in _ADDED_REAL_COLUMNS:
        if column not in have:
            conn.execute(f"ALTER TABLE clients ADD COLUMN {column} REAL")
    conn.execute(
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
        (str(SCHEMA_VERSION),),
    )
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if version[0] != str(SCHEMA_VERSION):
        raise sqlite3.DatabaseError(f"unsupported schema version {version[0]}")
    # A read of the columns the code uses: a foreign table layout counts as unreadable.
    conn.execute("SELECT id, state, pid, start_time, held FROM clients LIMIT 1").fetchall()


_ADDED_COLUMNS = ("inflight_from", "queue")
# A client that failed or was lost is a warning in the event log, not news (issue 29).
_TRANSITION_SEVERITY = {ClientState.FAILED: "warning", ClientState.LOST: "warning"}
# Numbers added later (expected_s: submit --time, for the queue's order).
_ADDED_REAL_COLUMNS = ("expected_s",)


def _move_aside(path: Path) -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    path.rename(target)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    return target


def _record(row: sqlite3.Row) -> ClientRecord:
    return ClientRecord(
        id=row["id"], name=row["name"], cls=ClientClass(row["cls"]),
        argv=tuple(json.loads(row["argv"])), uid=row["uid"], gid=row["gid"], user=row["user"],
        gpu_request=row["gpu_request"], gpu_uuid=row["gpu_uuid"], gpu_index=row["gpu_index"],
        sm_ceiling=row["sm_ceiling"], sm_pct=row["sm_pct"],
        mem_bytes=row["mem_bytes"], priority=row["priority"], slo_p99_ms=row["slo_p99_ms"],
        latency_from=row["latency_from"],
        inflight_from=row["inflight_from"], queue=row["queue"], expected_s=row["expected_s"],
        restartable=bool(row["restartable"]), checkpoint_signal=row["checkpoint_signal"],
        detach=bool(row["detach"]), env=json.loads(row["env"]), cwd=row["cwd"],
        state=ClientState(row["state"]), reason=row["reason"], pid=row["pid"],
        start_time=row["start_time"], exit_code=row["exit_code"],
        pause_mechanism=row["pause_mechanism"], log_path=row["log_path"], held=bool(row["held"]),
        restarts=row["restarts"], failures=row["failures"], submitted_at=row["submitted_at"],
        started_at=row["started_at"], ended_at=row["ended_at"], adopted_by=row["adopted_by"],
    )  # fmt: skip
