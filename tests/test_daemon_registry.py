"""The SQLite registry: transitions, events, persistence, and a corrupted database."""

from __future__ import annotations

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
