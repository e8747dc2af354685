"""The registry fails safe (issue 27): faults injected for real on the SQLite file.

A lock held by another process, a full disk (a small tmpfs filled to the last byte), a read-only
file system: none of them renames a good database or leaves an empty one, and a running registry
keeps every change in memory until the file takes it. Client ids continue across a reset. The
database and its WAL are private. Events are pruned.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.faults import (
    fill,
    free,
    release_lock,
    remount,
    small_tmpfs,
    sqlite_locked,
    tmpfs_skip_reason,
)
from gpushare import config
from gpushare.daemon.registry import (
    EventRetention,
    Registry,
    RegistryError,
    RegistryUnavailableError,
)
from gpushare.daemon.registry.ids import MARK_NAME
from gpushare.model import ClientClass, ClientState

S = ClientState
SECRET = "ROOT_DB_PASSWORD=hunter2-7f3a"


def _add(reg: Registry, **kw: object) -> str:
    rec = reg.add_client(
        cls=ClientClass.OFFLINE, argv=["sleep", "1"], uid=0, gid=0, user="root",
        state=S.STARTING, priority=1, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return rec.id


def _moved_aside(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if ".corrupt-" in p.name]


def _rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db)
    try:
        return list(conn.execute(sql))
    finally:
        conn.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    if (reason := tmpfs_skip_reason()) is not None:
        pytest.skip(reason)
    with small_tmpfs(tmp_path / "fs", "2m") as mnt:
        yield mnt


# ----------------------------------------------------------------------------- identities


@pytest.mark.parametrize("reset", ["damaged", "removed"])
def test_client_ids_are_never_reused_after_a_registry_reset(tmp_path: Path, reset: str) -> None:
    db = tmp_path / "gpushare.db"
    reg = Registry.open(db)
    old = [_add(reg) for _ in range(3)]
    reg.close()
    if reset == "damaged":
        db.write_bytes(b"garbage " * 512)
    else:
        for name in ("gpushare.db", "gpushare.db-wal", "gpushare.db-shm"):
            (tmp_path / name).unlink(missing_ok=True)
    reg = Registry.open(db)
    new = _add(reg)
    assert new not in old and int(new[1:]) > max(int(c[1:]) for c in old)
    assert reg.epoch == 2
    reg.close()
    # Reopening the new database keeps counting from where it is, in the same epoch.
    reg = Registry.open(db)
    assert int(_add(reg)[1:]) > int(new[1:]) and reg.epoch == 2
    reg.close()


def test_ids_stay_above_the_client_logs_left_when_the_mark_is_lost_too(tmp_path: Path) -> None:
    db = tmp_path / "gpushare.db"
    reg = Registry.open(db, id_floor=41)  # c41.log is still in the client log directory
    assert _add(reg) == "c42"
    reg.close()
    (tmp_path / MARK_NAME).unlink()
    db.unlink()
    reg = Registry.open(db, id_floor=42)
    assert int(_add(reg)[1:]) > 42
    reg.close()


def test_a_garbled_id_mark_is_refused_not_guessed(tmp_path: Path) -> None:
    (tmp_path / MARK_NAME).write_text("reserved: lots\n")
    with pytest.raises(RegistryError, match="client id mark"):
        Registry.open(tmp_path / "gpushare.db")
    assert not (tmp_path / "gpushare.db").exists()


# ----------------------------------------------------------------------------- locks


def test_a_locked_database_is_waited_for_then_refused_never_moved_aside(tmp_path: Path) -> None:
    db = tmp_path / "gpushare.db"
    reg = Registry.open(db)
    cid = _add(reg)
    reg.close()
    with sqlite_locked(db):
        t0 = time.monotonic()
        with pytest.raises(RegistryError, match="lock") as err:
            Registry.open(db, busy_timeout_s=0.5)
        assert time.monotonic() - t0 >= 0.5
        assert "\n" not in str(err.value)
    assert _moved_aside(tmp_path) == []
    # A lock released within the wait is simply waited for.
    with sqlite_locked(db) as locker:
        threading.Timer(0.3, release_lock, [locker]).start()
        reg = Registry.open(db, busy_timeout_s=5.0)
    assert reg.get(cid).state is S.STARTING and reg.events()[0].kind == "client_submitted"
    reg.close()


def test_a_lock_held_while_running_delays_writes_but_loses_none(tmp_path: Path) -> None:
    db = tmp_path / "gpushare.db"
    reg = Registry.open(db)
    cid = _add(reg)
    with sqlite_locked(db):
        t0 = time.monotonic()
        rec = reg.transition(cid, S.RUNNING, pid=4242, start_time=1.5)
        reg.add_event("alert", "kept in memory", severity="warning")
        assert time.monotonic() - t0 < 2.0, "a write waited as if the lock were its to wait out"
        assert rec.state is S.RUNNING and reg.get(cid) == rec and reg.clients() == [rec]
        assert reg.unwritten()["clients"] == 1
        with pytest.raises(RegistryUnavailableError, match="lock"):
            _add(reg)
        # held: the file still says STARTING
    assert _rows(db, f"SELECT state FROM clients WHERE id = '{cid}'") == [("starting",)]
    time.sleep(1.1)
    reg.clients()  # the loop's read retries the backlog
    assert reg.unwritten() == {}
    assert _rows(db, f"SELECT state, pid FROM clients WHERE id = '{cid}'") == [("running", 4242)]
    kinds = [e.kind for e in reg.events()]
    assert kinds[-3:] == ["client_running", "alert", "registry_write_resumed"]
    reg.close()


# ----------------------------------------------------------------------------- full disk


def test_a_full_disk_at_start_fails_in_one_line_and_leaves_no_empty_database(tmpfs: Path) -> None:
    fill(tmpfs)
    with pytest.raises(RegistryError, match="full") as err:
        Registry.open(tmpfs / "gpushare.db")
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmpfs.iterdir()) == ["filler"]  # no 0-byte database


def test_a_full_disk_never_renames_a_good_database(tmpfs: Path) -> None:
    db = tmpfs / "gpushare.db"
    reg = Registry.open(db)
    cid = _add(reg)
    reg.close()
    fill(tmpfs)
    # Whether opening fails (in one line) depends on what SQLite must write to open: either will do.
    with contextlib.suppress(RegistryError):
        Registry.open(db).close()
    assert _moved_aside(tmpfs) == []
    free(tmpfs)
    reg = Registry.open(db)
    assert reg.get(cid).state is S.STARTING
    reg.close()


def test_a_disk_filling_while_running_keeps_every_change_in_memory_then_writes_it(
    tmpfs: Path,
) -> None:
    db = tmpfs / "gpushare.db"
    reg = Registry.open(db)
    a, b = _add(reg), _add(reg)
    reg.transition(a, S.RUNNING, pid=100)
    fill(tmpfs)
    # A burst: many duty changes, a client restarting, one ending. None may raise.
    for i in range(300):
        reg.add_event("offline_duty", f"duty step {i} " + "x" * 200, gpu_uuid="GPU-0")
    reg.transition(a, S.RESTARTING, reason="share changed")
    reg.transition(a, S.STARTING, pid=None)
    reg.update(a, pid=101, start_time=2.0)
    reg.transition(a, S.RUNNING)
    reg.transition(b, S.EXITED, exit_code=0)
    reg.keep_setting("offline_share", {"GPU-0": 70.0})
    assert reg.setting("offline_share") == {"GPU-0": 70.0}
    assert reg.unwritten()["cause"].startswith("its file system is full")
    assert [(r.id, r.state, r.pid) for r in reg.clients()] == [(a, S.RUNNING, 101)]
    assert reg.get(b).state is S.EXITED
    with pytest.raises(RegistryUnavailableError, match="full"):
        _add(reg)
    free(tmpfs)
    time.sleep(1.1)
    reg.clients()
    assert reg.unwritten() == {}
    reg.close()
    # What a restarted daemon reads: every change, every event, in order.
    reg = Registry.open(db)
    assert [(r.id, r.state, r.pid) for r in reg.clients()] == [(a, S.RUNNING, 101)]
    assert reg.get(b).state is S.EXITED and reg.get(a).restarts == 0
    assert reg.setting("offline_share") == {"GPU-0": 70.0}
    kinds = [e.kind for e in reg.events(limit=10_000)]
    assert kinds.count("offline_duty") == 300
    assert kinds[-1] == "registry_write_resumed"
    assert kinds.index("client_restarting") > kinds.index("offline_duty")
    reg.close()


def test_a_read_only_state_directory_fails_in_one_line(tmpfs: Path) -> None:
    remount(tmpfs, "ro")
    try:
        with pytest.raises(RegistryError) as err:
            Registry.open(tmpfs / "gpushare.db")
        assert "read-only" in str(err.value).lower() and "\n" not in str(err.value)
    finally:
        remount(tmpfs, "rw")
    assert list(tmpfs.iterdir()) == []
    # A good database on a file system that went read-only: refused in one line, not moved.
    reg = Registry.open(tmpfs / "gpushare.db")
    cid = _add(reg)
    reg.close()
    remount(tmpfs, "ro")
    try:
        with pytest.raises(RegistryError) as err:
            Registry.open(tmpfs / "gpushare.db")
        assert "read-only" in str(err.value).lower() and "\n" not in str(err.value)
    finally:
        remount(tmpfs, "rw")
    assert _moved_aside(tmpfs) == []
    reg = Registry.open(tmpfs / "gpushare.db")
    assert reg.get(cid).state is S.STARTING
    reg.close()


# ----------------------------------------------------------------------------- privacy


def test_database_wal_and_shm_are_private(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)  # as the shipped StateDirectoryMode=0755 left it
    db = tmp_path / "gpushare.db"
    reg = Registry.open(db)
    _add(reg, env={"ROOT_DB_PASSWORD": SECRET})
    modes = {n: stat.S_IMODE(os.stat(tmp_path / n).st_mode) for n in os.listdir(tmp_path)}
    assert modes == {
        "gpushare.db": 0o600, "gpushare.db-wal": 0o600, "gpushare.db-shm": 0o600,
        MARK_NAME: 0o600,
    }  # fmt: skip
    # Another user finds nothing, though the directory lets them in.
    out = subprocess.run(["grep", "-r", "hunter2", str(tmp_path)], user="nobody",
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "hunter2" not in out.stdout
    assert "Permission denied" in out.stderr
    reg.close()


def test_files_an_older_gpushare_left_readable_are_made_private(tmp_path: Path) -> None:
    db = tmp_path / "gpushare.db"
    reg = Registry.open(db)
    _add(reg)
    for name in ("gpushare.db", "gpushare.db-wal", "gpushare.db-shm"):
        (tmp_path / name).chmod(0o644)
    other = Registry.open(db)
    for name in ("gpushare.db", "gpushare.db-wal", "gpushare.db-shm"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o600, name
    other.close()
    reg.close()


# ----------------------------------------------------------------------------- pruning


def test_events_are_pruned_by_age_and_count(tmp_path: Path) -> None:
    now = time.time()
    reg = Registry.open(tmp_path / "gpushare.db", retention=EventRetention(3600.0, 500))
    for i in range(2000):
        reg.add_event("adopt", f"adopt/release {i}", now=now - 7200 if i < 100 else now)
    assert len(reg.events(limit=10_000)) <= 500 + 256  # pruned as they come
    reg.prune_events(now)
    kept = reg.events(limit=10_000)
    assert len(kept) == 500 and kept[-1].message == "adopt/release 1999"
    assert all(e.at >= now - 3600 for e in kept)
    reg.close()


def test_event_retention_keys_are_validated() -> None:
    cfg = config.loads('[daemon]\nevents_max_age = "24h"\nevents_max_rows = 5000\n')
    assert (cfg.daemon.events_max_age_s, cfg.daemon.events_max_rows) == (86400.0, 5000)
    for bad in ('events_max_rows = 10', 'events_max_rows = "many"', 'events_max_age = "1s"',
                'events_max_age = "forever"'):  # fmt: skip
        with pytest.raises(config.ConfigError, match="events_max"):
            config.loads(f"[daemon]\n{bad}\n")
