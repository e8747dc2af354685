"""Opening the registry's SQLite file: private file modes, and the rules for a bad database.

A database is moved aside only when SQLite itself says it is damaged (``SQLITE_CORRUPT``,
``SQLITE_NOTADB``, or ``PRAGMA quick_check`` not ``ok``), never because it is locked, the disk is
full or the directory read-only: those fail the open with one line that names the cause, and a
database file this open created is removed again, so no empty file is left to be taken for a
fresh registry at the next start. A lock is waited for (SQLite's busy timeout) before it counts.

The database is created 0600 before SQLite opens it (SQLite gives its ``-wal`` and ``-shm`` files
the database's mode), and an existing one and its ``-wal``/``-shm`` are set to 0600 (an older
gpushare left them 0644: another user could ``grep`` submitted environments out of the WAL).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import time
from pathlib import Path

from gpushare.daemon.registry.records import RegistryError

SCHEMA_VERSION = 1

SCHEMA = """
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

# Columns added after schema 1 shipped: an older database gains them (NULL) and stays version 1
# (adopted_by: launched; inflight_from, queue: none asked).
_ADDED_COLUMNS = ("adopted_by", "inflight_from", "queue")
# Numbers added later (expected_s: submit --time, for the queue's order; restart_cost_s: submit
# --restart-cost (issue 32), what a restart costs the job; the token SLOs of an LLM server, submit
# --slo-ttft-p99 / --slo-tpot-p99). Old records read NULL: none given.
_ADDED_REAL_COLUMNS = ("expected_s", "restart_cost_s", "slo_ttft_p99_ms", "slo_tpot_p99_ms")
# Migration step 3 (issue 35): a gang's GPUs, a JSON list of UUIDs in rank order. An older
# record gains NULL, read as a gang of one: its one GPU (ClientRecord.gpus).
_GANG_COLUMNS = ("gang",)
# Migration step 4 (issue 32): a restartable offline job's start-up measured by the daemon (from a
# relaunch to its first GPU work, gpushare.daemon.startcost), its restart cost when it declared
# none. An older record gains NULL: not measured yet.
_STARTUP_COLUMNS = ("startup_s",)
_SIDE_FILES = ("-wal", "-shm")

# Primary result codes (sqlite3.h) for which a failed write is worth retrying later: the data is
# still good, the file or its file system is not writable right now.
_TRANSIENT = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PROTOCOL,
        sqlite3.SQLITE_PERM,
    }
)
_DAMAGED = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})


class DamagedError(Exception):
    """SQLite says the file is not a sound database: the one case for moving it aside."""


def primary_code(exc: sqlite3.Error) -> int:
    """The primary SQLite result code of an error (its low byte); -1 when SQLite gave none."""
    code = exc.sqlite_errorcode if isinstance(exc.sqlite_errorcode, int) else -1
    return code & 0xFF if code >= 0 else -1


def transient(exc: sqlite3.Error) -> bool:
    """Whether a failed write may succeed later unchanged (full, locked, read-only, I/O)."""
    return primary_code(exc) in _TRANSIENT | _DAMAGED


def cause(exc: BaseException, busy_timeout_s: float) -> str:
    """What a failed open or write means, in words an operator can act on."""
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    if not isinstance(exc, sqlite3.Error):
        return str(exc)
    code = primary_code(exc)
    name = exc.sqlite_errorname or "unknown"
    if code == sqlite3.SQLITE_FULL:
        return f"its file system is full ({name}); free space and start again"
    if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return (
            f"another process holds a lock on it (waited {busy_timeout_s:g}s, {name}); "
            "stop that process"
        )
    if code == sqlite3.SQLITE_READONLY:
        return f"it or its directory is read-only ({name})"
    if code == sqlite3.SQLITE_CANTOPEN:
        return f"it cannot be opened: a missing or read-only directory, or no permission ({name})"
    if code in (sqlite3.SQLITE_PERM, sqlite3.SQLITE_AUTH):
        return f"permission denied ({name})"
    return f"{exc} ({name})"


def connect(path: Path, busy_timeout_s: float) -> sqlite3.Connection:
    """Open and check the database at ``path`` (created 0600 when missing).

    Raises:
        DamagedError: SQLite says the file is damaged (moving it aside is the caller's choice).
        RegistryError: anything else: the cause in one line; nothing is renamed, and a file this
            call created is removed again.
    """
    created = _create_private(path, busy_timeout_s)
    try:
        conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=busy_timeout_s
        )
        try:
            prepare(conn)
        except BaseException:
            conn.close()
            raise
    except sqlite3.Error as exc:
        if created:
            _remove_created(path)
        if primary_code(exc) in _DAMAGED:
            raise DamagedError(str(exc)) from exc
        if primary_code(exc) in (sqlite3.SQLITE_ERROR, -1):
            raise RegistryError(
                f"the state database {path} is not one this gpushare can use ({exc}); it was "
                "left as it is: move it away to start with a fresh one"
            ) from exc
        raise RegistryError(
            f"cannot open the state database {path}: {cause(exc, busy_timeout_s)}"
        ) from exc
    except DamagedError:
        if created:
            _remove_created(path)
        raise
    return conn


def _create_private(path: Path, busy_timeout_s: float) -> bool:
    """Create the database file 0600 if missing (True), or make it and its side files 0600."""
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as exc:
        raise RegistryError(
            f"cannot create the state database {path}: {cause(exc, busy_timeout_s)}"
        ) from exc
    else:
        os.close(fd)
        return True
    for name in (path.name, *(path.name + s for s in _SIDE_FILES)):
        try:
            fd = os.open(path.with_name(name), flags | os.O_RDONLY)
        except FileNotFoundError:
            continue
        except OSError as exc:  # ELOOP: a symlink put where the database belongs
            raise RegistryError(
                f"cannot open the state database file {path.with_name(name)}: {exc.strerror}"
            ) from exc
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != 0o600:
                os.fchmod(fd, 0o600)
        except OSError as exc:
            raise RegistryError(
                f"cannot make {path.with_name(name)} private (0600): {exc.strerror}"
            ) from exc
        finally:
            os.close(fd)
    return False


def _remove_created(path: Path) -> None:
    """Remove what a failed first open left: no empty database may pass for a fresh one."""
    for name in (path.name, *(path.name + s for s in _SIDE_FILES)):
        with contextlib.suppress(OSError):
            path.with_name(name).unlink()


def prepare(conn: sqlite3.Connection) -> None:
    """WAL mode, the quick check, the schema (created or brought up to date).

    Raises:
        DamagedError: ``quick_check`` found damage.
        RegistryError: a schema version this code does not know.
        sqlite3.Error: as SQLite raised it.
    """
    conn.row_factory = sqlite3.Row
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    row = conn.execute("PRAGMA quick_check").fetchone()
    if row is None or row[0] != "ok":
        raise DamagedError(f"quick_check failed: {row[0] if row else 'no answer'}")
    conn.executescript(SCHEMA)
    have = {row[1] for row in conn.execute("PRAGMA table_info(clients)")}
    for column in _ADDED_COLUMNS:
        if column not in have:
            conn.execute(f"ALTER TABLE clients ADD COLUMN {column} TEXT")
    for column in _ADDED_REAL_COLUMNS:
        if column not in have:
            conn.execute(f"ALTER TABLE clients ADD COLUMN {column} REAL")
    for column in _GANG_COLUMNS:
        if column not in have:
            conn.execute(f"ALTER TABLE clients ADD COLUMN {column} TEXT")
    for column in _STARTUP_COLUMNS:
        if column not in have:
            conn.execute(f"ALTER TABLE clients ADD COLUMN {column} REAL")
    conn.execute(
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('schema_version', ?)",
        (str(SCHEMA_VERSION),),
    )
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    if version[0] != str(SCHEMA_VERSION):
        raise RegistryError(
            f"the state database has schema version {version[0]}, this gpushare knows "
            f"{SCHEMA_VERSION}; it was left as it is (a newer gpushare wrote it?)"
        )
    # A read of the columns the code uses: a foreign table layout fails here, not later.
    conn.execute("SELECT id, state, pid, start_time, held FROM clients LIMIT 1").fetchall()


def move_aside(path: Path) -> Path:
    """Rename a damaged database (and its side files) to ``<name>.corrupt-<UTC time>``."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while target.exists():
        target = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    path.rename(target)
    for suffix in _SIDE_FILES:
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    return target
