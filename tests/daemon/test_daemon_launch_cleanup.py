"""A launch that fails after its spawn (registry, attach or limits) leaves nothing behind: no
process, no cgroup, no record of a live client.

An in-process daemon driven tick by tick (tests/support/actions_daemon.py).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from gpushare.daemon.core import Daemon
from gpushare.model import ClientState
from gpushare.node.cgroups.pauser import CgroupPauser
from gpushare.node.pauser_base import PauserError
from gpushare.protocol import ProtocolError
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_policy import ScriptedPolicy
from tests.support.actions_daemon import _submit


@pytest.mark.parametrize("step", ["registry", "attach", "limits"])
def test_a_launch_failing_after_its_spawn_leaves_nothing_behind(
    env: tuple[Daemon, ScriptedPolicy, FakeMpsNode],
    step: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failure at each step between spawn and RUNNING: no process, no cgroup, a FAILED record."""
    d, _, _ = env
    spawned: list[int] = []
    real_spawn = d.lifecycle.spawn

    def spawn(rec: Any) -> Any:
        out = real_spawn(rec)
        if not isinstance(out, str):
            spawned.append(out[0].pid)
        return out

    monkeypatch.setattr(d.lifecycle, "spawn", spawn)
    pauser = d.state.pauser
    if step == "registry":
        real_update = d.registry.update

        def update(client_id: str, **fields: Any) -> Any:
            if set(fields) <= {"queue", "inflight_from"}:
                # Recorded at submit, before the spawn (every --offline job has a queue since
                # issue 32 made auto the default): the failure under test comes after the spawn.
                return real_update(client_id, **fields)
            raise sqlite3.OperationalError("disk I/O error")

        monkeypatch.setattr(d.registry, "update", update)
    else:
        real_attach = pauser.attach

        def attach(client_id: str, pid: int, *, owner_uid: int | None = None) -> None:
            if step == "limits":  # the process is under the pauser, then its limits are refused
                real_attach(client_id, pid, owner_uid=owner_uid)
                raise PauserError("the node cannot hold its limits (injected)")
            raise PauserError("cannot attach (injected)")

        monkeypatch.setattr(pauser, "attach", attach)
    # A workload that forks at once: its child must go too.
    argv = ["sh", "-c", "sleep 3917 & exec sleep 3916"]
    with pytest.raises(ProtocolError) as err:
        _submit(d, argv)
    assert "cannot start" in str(err.value)
    assert "injected" in str(err.value) or "disk I/O error" in str(err.value)
    (pid,) = spawned
    (rec,) = d.registry.clients(include_final=True)
    assert rec.state is ClientState.FAILED
    assert rec.pid is None
    assert rec.reason is not None and "cannot start" in rec.reason
    assert d.registry.clients() == []  # nothing live or STARTING
    assert not _alive(pid)
    if isinstance(pauser, CgroupPauser):
        assert not pauser.path(rec.id).exists()
    # Nothing of the workload survives anywhere: neither the shell nor its forked child.
    assert _processes_named("sleep 391") == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def _processes_named(prefix: str) -> list[int]:
    """Live processes whose command line starts with ``prefix``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if cmd.startswith(prefix) and _alive(int(entry)):
            out.append(int(entry))
    return out
