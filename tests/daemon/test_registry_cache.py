"""The registry's memory copy of the live clients: coherent with SQLite, and nothing lost on a crash.

:class:`Registry` answers ``clients()`` and ``get()`` of live clients from memory; every write
commits to SQLite first. These tests compare the memory copy with what a second connection reads
from the file, kill a writer process mid-run, and write through a second connection.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gpushare.daemon.registry import ClientRecord, Registry, RegistryError, TransitionError
from gpushare.model import ClientClass, ClientState

S = ClientState


def _add(reg: Registry, **kw: object) -> str:
    rec = reg.add_client(
        cls=ClientClass.OFFLINE, argv=["sleep", "1"], uid=1000, gid=1000, user="alice",
        state=S.STARTING, priority=1, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return rec.id


def _from_file(path: Path) -> list[ClientRecord]:
    """The live clients as a fresh connection reads them from the file."""
    other = Registry.open(path)
    try:
        return other.clients()
    finally:
        other.close()


def test_memory_copy_matches_the_file_through_random_writes(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    reg = Registry.open(path)
    rng = random.Random(15)
    ids: list[str] = []
    for step in range(120):
        roll = rng.random()
        if roll < 0.25 or not ids:
            ids.append(_add(reg, sm_pct=rng.choice([None, 20.0]), env={"STEP": str(step)}))
        elif roll < 0.7:
            cid = rng.choice(ids)
            to = rng.choice(list(S))
            # A refused move must change nothing: checked below like every other step.
            with contextlib.suppress(TransitionError):
                reg.transition(cid, to, reason=f"step {step}", pid=rng.randrange(2, 99999))
        else:
            cid = rng.choice(ids)
            reg.update(cid, held=rng.random() < 0.5, failures=rng.randrange(5))
        mine = reg.clients()
        assert mine == _from_file(path), f"step {step}"
        assert all(not r.state.is_final for r in mine)
        for cid in ids:
            assert reg.get(cid) == Registry._get(reg._conn, cid)
    # include_final still reads the whole table, finished clients too.
    assert [r.id for r in reg.clients(include_final=True)] == ids
    reg.close()


def test_a_failed_write_changes_neither_file_nor_memory(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    reg = Registry.open(path)
    cid = _add(reg)
    reg.transition(cid, S.RUNNING, pid=42)
    before = reg.clients()
    with pytest.raises(TransitionError):
        reg.transition(cid, S.STARTING)
    with pytest.raises(RegistryError):
        reg.update(cid, no_such_field=1)
    with pytest.raises(TransitionError):
        reg.transition(cid, S.FROZEN, expect=S.THROTTLED)
    assert reg.clients() == before == _from_file(path)
    reg.close()


def _writer(path: str, ready: Any) -> None:
    reg = Registry.open(Path(path))
    ids = [_add(reg, name=f"job{i}") for i in range(5)]
    reg.transition(ids[0], S.RUNNING, pid=100)
    reg.transition(ids[1], S.EXITED, exit_code=0)
    reg.update(ids[2], held=True)
    reg.transition(ids[3], S.FAILED, reason="boom")
    ready.set()
    # Crash: no close, no flush, no atexit; the kernel ends the process.
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_second_registry_sees_every_write_after_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    Registry.open(path).close()
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_writer, args=(str(path), ready))
    proc.start()
    proc.join(30)
    assert ready.is_set()
    assert proc.exitcode == -signal.SIGKILL
    reg = Registry.open(path)
    live = {r.name: r for r in reg.clients()}
    assert set(live) == {"job0", "job2", "job4"}
    assert (live["job0"].state, live["job0"].pid) == (S.RUNNING, 100)
    assert live["job2"].held is True
    every = {r.name: r.state for r in reg.clients(include_final=True)}
    assert every == {"job0": S.RUNNING, "job1": S.EXITED, "job2": S.STARTING,
                     "job3": S.FAILED, "job4": S.STARTING}  # fmt: skip
    reg.close()


def test_a_commit_by_another_connection_is_seen(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    reg = Registry.open(path)
    cid = _add(reg)
    assert [r.state for r in reg.clients()] == [S.STARTING]
    other = Registry.open(path)
    other.transition(cid, S.RUNNING, pid=7)
    new = _add(other, name="from-the-other")
    assert [(r.id, r.state) for r in reg.clients()] == [(cid, S.RUNNING), (new, S.STARTING)]
    assert reg.get(cid).pid == 7
    # A raw write, as an operator's sqlite3 shell would make it.
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("UPDATE clients SET state = 'lost' WHERE id = ?", (new,))
    raw.close()
    assert [r.id for r in reg.clients()] == [cid]
    other.close()
    reg.close()


def test_clients_without_the_check_is_the_copy_as_last_looked_plus_own_writes(
    tmp_path: Path,
) -> None:
    # The control loop's second read of a tick (check=False): no look for other connections'
    # commits, so it costs no query; its own writes show at once, the other's at the next look.
    path = tmp_path / "db.sqlite"
    reg = Registry.open(path)
    cid = _add(reg)
    assert [r.state for r in reg.clients()] == [S.STARTING]
    other = Registry.open(path)
    theirs = _add(other, name="from-the-other")
    mine = _add(reg, name="mine")
    # Our own commit looks for others' commits too (a commit just before ours is not lost).
    assert [r.id for r in reg.clients(check=False)] == [cid, theirs, mine]
    other.transition(cid, S.RUNNING, pid=7)
    assert [r.state for r in reg.clients(check=False)] == [S.STARTING] * 3
    assert [r.state for r in reg.clients()] == [S.RUNNING, S.STARTING, S.STARTING]
    reg.transition(mine, S.RUNNING, pid=8)
    assert [(r.id, r.state) for r in reg.clients(check=False)] == [
        (cid, S.RUNNING), (theirs, S.STARTING), (mine, S.RUNNING),
    ]  # fmt: skip
    other.close()
    reg.close()


def _statements(reg: Registry) -> list[str]:
    seen: list[str] = []
    reg._conn.set_trace_callback(seen.append)
    return seen


def test_a_look_with_nothing_written_since_asks_sqlite_nothing(tmp_path: Path) -> None:
    # The control loop reads the clients every tick: with no write to the database's files since
    # the last look (inotify), not even PRAGMA data_version is asked; after any write, it is.
    path = tmp_path / "db.sqlite"
    reg = Registry.open(path)
    cid = _add(reg)
    asked = _statements(reg)
    for _ in range(3):
        assert [r.id for r in reg.clients()] == [cid]
        assert reg.get(cid).state is S.STARTING
    assert asked == []
    other = Registry.open(path)
    other.transition(cid, S.RUNNING, pid=7)
    assert [r.state for r in reg.clients()] == [S.RUNNING]
    assert "PRAGMA data_version" in asked
    asked.clear()
    assert [r.state for r in reg.clients()] == [S.RUNNING]
    assert asked == []
    # A raw write (an operator's sqlite3 shell) is a write to the files too.
    raw = sqlite3.connect(path)
    with raw:
        raw.execute("UPDATE clients SET held = 1 WHERE id = ?", (cid,))
    raw.close()
    assert reg.get(cid).held is True
    other.close()
    reg.close()


def test_a_private_in_memory_registry_never_looks_for_other_connections() -> None:
    reg = Registry.in_memory()
    cid = _add(reg)
    asked = _statements(reg)
    assert [r.id for r in reg.clients()] == [cid]
    assert asked == []
    reg.close()
