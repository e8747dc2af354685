"""The SQLite registry: transitions, events, persistence, and a corrupted database."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from gpushare.daemon.registry import Registry, RegistryError, TransitionError
from gpushare.model import ClientClass, ClientState


def _add(reg: Registry, **kw: object) -> str:
    rec = reg.add_client(
        cls=ClientClass.OFFLINE, argv=["sleep", "1"], uid=1000, gid=1000, user="alice",
        state=ClientState.STARTING, priority=1, **kw,  # type: ignore[arg-type]
    )  # fmt: skip
    return rec.id


def test_transitions_are_checked_and_logged(tmp_path: Path) -> None:
    reg = Registry.open(tmp_path / "db.sqlite")
    cid = _add(reg, sm_pct=30.0, env={"A": "1"})
    rec = reg.transition(cid, ClientState.RUNNING, pid=123, start_time=456.5)
    assert (rec.state, rec.pid, rec.start_time, rec.env) == (
        ClientState.RUNNING,
        123,
        456.5,
        {"A": "1"},
    )
    with pytest.raises(TransitionError):
        reg.transition(cid, ClientState.STARTING)
    rec = reg.transition(cid, ClientState.EXITED, exit_code=3)
    assert rec.ended_at is not None
    assert rec.exit_code == 3
    with pytest.raises(TransitionError):
        reg.transition(cid, ClientState.RUNNING)
    # a refused transition changed nothing
    assert reg.get(cid).state is ClientState.EXITED
    kinds = [e.kind for e in reg.events()]
    assert kinds == ["client_submitted", "client_running", "client_exited"]
    reg.add_event("alert", "probe ratio 2.1", severity="warning", gpu_uuid="GPU-a")
    counts = reg.event_counts()
    assert counts[("client_running", "info", "")] == 1
    assert counts[("alert", "warning", "GPU-a")] == 1
    assert sum(counts.values()) == len(reg.events())
    with pytest.raises(RegistryError):
        reg.get("c999")
    with pytest.raises(RegistryError):
        reg.update(cid, bogus=1)
    reg.close()


def test_state_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    reg = Registry.open(path)
    cid = _add(reg)
    reg.transition(cid, ClientState.RUNNING, pid=42, held=True)
    reg.close()
    reg2 = Registry.open(path)
    rec = reg2.get(cid)
    assert (rec.pid, rec.held, rec.state) == (42, True, ClientState.RUNNING)
    assert [c.id for c in reg2.clients()] == [cid]
    reg2.close()


def test_corrupted_database_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    path.write_bytes(b"this is not a sqlite database" * 100)
    reg = Registry.open(path)
    aside = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert len(aside) == 1
    assert aside[0].read_bytes().startswith(b"this is not a sqlite database")
    events = reg.events()
    assert events[0].kind == "registry_corrupt"
    assert events[0].severity == "error"
    assert str(aside[0]) in events[0].message
    assert reg.clients() == []
    reg.close()


def test_adopted_clients_and_job_registrations_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    reg = Registry.open(path)
    cid = _add(reg, adopted_by="slurm job 42")
    assert reg.events()[-1].message == f"offline client {cid} of alice adopted by slurm job 42"
    assert reg.events()[-1].kind == "client_adopted"
    reg.register("slurm", "42", 0, {"cls": "offline", "uid": 1000})
    reg.register("slurm", "42", 0, {"cls": "online", "uid": 1000})  # a second adopt replaces
    reg.register("slurm", "43", 1000, {"cls": "offline", "uid": 1000})
    reg.close()
    reg = Registry.open(path)
    assert reg.get(cid).adopted_by == "slurm job 42"
    assert [(r.job, r.owner_uid, r.params["cls"]) for r in reg.registrations()] == [
        ("42", 0, "online"),
        ("43", 1000, "offline"),
    ]
    assert reg.unregister("slurm", "42") and not reg.unregister("slurm", "42")
    assert [r.job for r in reg.registrations()] == ["43"]
    reg.close()


def test_a_database_from_before_adoption_gains_the_column(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    Registry.open(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE clients DROP COLUMN adopted_by")
        conn.execute("INSERT INTO clients (id, cls, argv, uid, gid, user, priority, restartable,"
                     " checkpoint_signal, detach, env, state, submitted_at) VALUES"
                     " ('c1', 'online', '[]', 0, 0, 'root', 0, 0, 10, 1, '{}', 'running', 1.0)")  # fmt: skip
    conn.close()
    reg = Registry.open(path)
    assert reg.get("c1").adopted_by is None
    assert reg.events() == []  # not moved aside as corrupt
    reg.close()


def test_a_database_from_before_gangs_gains_the_column_and_reads_each_client_as_a_gang_of_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "db.sqlite"
    Registry.open(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE clients DROP COLUMN gang")
        conn.execute("INSERT INTO clients (id, cls, argv, uid, gid, user, priority, restartable,"
                     " checkpoint_signal, detach, env, state, submitted_at, gpu_uuid, gpu_index)"
                     " VALUES ('c1', 'offline', '[]', 0, 0, 'root', 1, 0, 10, 1, '{}', 'running',"
                     " 1.0, 'GPU-a', 0)")  # fmt: skip
    conn.close()
    reg = Registry.open(path)
    old = reg.get("c1")
    assert old.gang == () and old.gpus() == ("GPU-a",)  # a one-GPU client: a gang of one
    assert reg.events() == []  # not moved aside as corrupt
    # The migrated database takes a gang, and gives it back in rank order after a reopen.
    reg.update("c1", gang=("GPU-a", "GPU-b"))
    reg.close()
    reg = Registry.open(path)
    assert reg.get("c1").gpus() == ("GPU-a", "GPU-b")
    reg.close()
