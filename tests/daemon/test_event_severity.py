"""Event severities fit the event: a client that failed or was lost is a warning (b0c0ecb: info)."""

from __future__ import annotations

from pathlib import Path

from gpushare.daemon.registry import Registry
from gpushare.model import ClientClass, ClientState


def test_failed_and_lost_clients_are_warnings_and_the_rest_info(tmp_path: Path) -> None:
    reg = Registry.open(tmp_path / "gpushare.db")
    ids = []
    for _ in range(3):
        rec = reg.add_client(cls=ClientClass.OFFLINE, argv=["x"], uid=0, gid=0, user="root",
                             state=ClientState.STARTING, priority=1)  # fmt: skip
        reg.transition(rec.id, ClientState.RUNNING)
        ids.append(rec.id)
    reg.transition(ids[0], ClientState.FAILED, reason="exit code 3")
    reg.transition(ids[1], ClientState.LOST, reason="gone while the daemon was down")
    reg.transition(ids[2], ClientState.EXITED, reason="exit code 0")
    severity = {(e.client_id, e.kind): e.severity for e in reg.events()}
    assert severity[(ids[0], "client_failed")] == "warning"
    assert severity[(ids[1], "client_lost")] == "warning"
    assert severity[(ids[2], "client_exited")] == "info"
    assert severity[(ids[2], "client_running")] == "info"
