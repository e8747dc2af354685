"""The signal fallback (gpushare.node.signal_pauser): SIGSTOP/SIGCONT/SIGKILL to a process group.

What a host without a usable cgroup freezer gets: stopping and continuing a whole group, refusing
the daemon's own group and gone pids, re-adopting a stopped group, several clients at once, and
one pass over /proc answering every client's pids.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpushare.node import signal_pauser
from gpushare.node.pauser_base import PauserError
from gpushare.node.signal_pauser import SignalPauser
from tests.support.processes import BUSY, FORK_ON_LINE, Children
from tests.support.processes import cpu_s as _cpu_s
from tests.support.processes import gone as _gone
from tests.support.processes import wait_for as _wait_for
from tests.support.processes import wait_running_cpu as _wait_running_cpu


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2]


def test_signal_pauser_stops_and_continues_group(children: Children) -> None:
    pauser = SignalPauser()
    script = "import os\nif os.fork() == 0:\n    while True: pass\nwhile True: pass\n"
    proc = children.start([sys.executable, "-c", script])
    assert pauser.pids("x") == []
    pauser.attach("x", proc.pid)
    assert _wait_for(lambda: len(pauser.pids("x")) == 2)
    members = list(pauser.pids("x"))
    assert _wait_running_cpu(members[1]) >= 0.05

    pauser.freeze("x")
    assert all(_state(pid) == "T" for pid in members)
    assert pauser.is_frozen("x")
    before = [_cpu_s(pid) for pid in members]
    time.sleep(0.4)
    frozen_delta = sum(_cpu_s(pid) for pid in members) - sum(before)
    assert frozen_delta <= 0.01

    pauser.thaw("x")
    assert not pauser.is_frozen("x")
    assert _wait_running_cpu(members[1]) >= 0.05

    pauser.kill("x")
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert _wait_for(lambda: all(_gone(pid) for pid in members))
    assert pauser.pids("x") == []
    pauser.release("x")
    assert pauser.clients() == {}


def test_signal_pauser_refuses_own_group() -> None:
    pauser = SignalPauser()
    same_group = subprocess.Popen(["sleep", "60"])  # no new session: our process group
    try:
        with pytest.raises(PauserError, match="daemon's own process group"):
            pauser.attach("me", same_group.pid)
    finally:
        same_group.kill()
        same_group.wait()
    with pytest.raises(PauserError, match="attach it first"):
        pauser.freeze("me")


def test_signal_pauser_gone_pid(children: Children) -> None:
    pauser = SignalPauser()
    proc = children.start(["true"])
    proc.wait(timeout=5)
    with pytest.raises(PauserError, match="no such process"):
        pauser.attach("gone", proc.pid)


def test_signal_pauser_readoption(children: Children) -> None:
    # A daemon restarted while a client was stopped: a new pauser attaches the recorded pid,
    # sees the group stopped and continues it.
    first = SignalPauser()
    proc = children.start(BUSY)
    first.attach("c", proc.pid)
    first.freeze("c")
    del first

    second = SignalPauser()
    assert second.clients() == {}
    second.attach("c", proc.pid)
    assert second.clients() == {"c": [proc.pid]}
    assert second.is_frozen("c")
    second.thaw("c")
    assert _wait_for(lambda: _state(proc.pid) != "T")
    assert _wait_running_cpu(proc.pid) >= 0.05


def test_signal_freeze_many(children: Children) -> None:
    pauser = SignalPauser()
    kids = [children.start(BUSY) for _ in range(2)]
    for i, kid in enumerate(kids):
        pauser.attach(f"s{i}", kid.pid)
    with pytest.raises(PauserError, match="attach it first"):
        pauser.freeze_many(["s0", "nope"])
    assert not pauser.is_frozen("s0")  # nothing was signalled
    pauser.freeze_many(["s0", "s1"])
    assert all(_state(k.pid) == "T" for k in kids)
    pauser.thaw_many(["s0", "s1"])
    assert _wait_for(lambda: all(_state(k.pid) != "T" for k in kids))


def test_signal_pauser_reads_proc_once_for_every_client(
    children: Children, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauser = SignalPauser(pids_rescan_s=0.2)
    shells = [children.start(FORK_ON_LINE, stdin=subprocess.PIPE) for _ in range(3)]
    for i, shell in enumerate(shells):
        pauser.attach(f"s{i}", shell.pid)
    passes: list[object] = []
    real = signal_pauser.groups_members

    def counting(pgids: object) -> dict[int, list[int]]:
        passes.append(pgids)
        return real(pgids)  # type: ignore[arg-type]

    monkeypatch.setattr(signal_pauser, "groups_members", counting)
    for i, shell in enumerate(shells):
        assert pauser.pids(f"s{i}") == [shell.pid]
    assert len(passes) == 1  # one pass over /proc answered all three
    stdin = shells[0].stdin
    assert stdin is not None
    stdin.write(b"go\n")
    stdin.flush()
    # The fork shows at the next pass, within pids_rescan_s.
    assert _wait_for(lambda: len(pauser.pids("s0")) == 2, timeout_s=3.0), pauser.pids("s0")
    assert pauser.pids("s1") == [shells[1].pid]
