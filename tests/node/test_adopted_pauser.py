"""AdoptingPauser: adopted processes paused where they are (real cgroup v2 freezer, real signals)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.support.cgroup_helpers import cgroup_skip_reason, remove_tree, unique_base
from bench.support.daemon_helpers import wait_for
from gpushare.model import PauseMechanism
from gpushare.node.adopted import AdoptingPauser
from gpushare.node.pauser_base import PauserError
from gpushare.node.procs.identity import descendants, is_same_process, process_start_time
from gpushare.node.signal_pauser import SignalPauser


@pytest.fixture
def leaf() -> Iterator[Path]:
    """A cgroup of its own, as a service or a container has."""
    if (reason := cgroup_skip_reason()) is not None:
        pytest.skip(reason)
    base = unique_base("gs-adopted")
    base.mkdir()
    try:
        yield base
    finally:
        remove_tree(base)


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
            os.killpg(p.pid, signal.SIGCONT)
        p.wait(timeout=5)


def _start(spawned, argv: list[str], cgroup: Path | None = None) -> subprocess.Popen[bytes]:
    if cgroup is not None:
        fd = os.open(cgroup / "cgroup.procs", os.O_WRONLY)
        proc = subprocess.Popen(argv, start_new_session=True,
                                preexec_fn=lambda: os.write(fd, b"0"))  # fmt: skip
        os.close(fd)
    else:
        proc = subprocess.Popen(argv, start_new_session=True)
    spawned.append(proc)
    return proc


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2]


def test_a_process_in_a_cgroup_of_its_own_is_frozen_through_that_cgroup(leaf, spawned):
    proc = _start(spawned, ["sh", "-c", "sleep 60 & wait"], leaf)
    kid = wait_for(lambda: descendants(proc.pid), what="the child")[0]
    pauser = AdoptingPauser(SignalPauser())
    route = pauser.adopt("a1", proc.pid, owner_uid=os.getuid())
    assert route.mechanism is PauseMechanism.CGROUP and route.cgroup == leaf, route.reason
    assert route.reason == f"cgroup freezer on its own cgroup: {leaf}"
    assert pauser.mechanism_of("a1") is PauseMechanism.CGROUP
    assert pauser.pids("a1") == sorted([proc.pid, kid])
    pauser.freeze("a1")
    assert "frozen 1" in (leaf / "cgroup.events").read_text()
    assert pauser.is_frozen("a1")
    pauser.thaw("a1")
    assert "frozen 0" in (leaf / "cgroup.events").read_text()
    assert not pauser.is_frozen("a1")
    pauser.freeze_many(["a1"])
    pauser.release("a1")  # released clients are never left frozen
    assert "frozen 0" in (leaf / "cgroup.events").read_text()
    assert leaf.exists()  # the cgroup is the service's or container's, not gpushare's
    pauser.adopt("a1", proc.pid)
    pauser.freeze("a1")
    pauser.kill("a1")  # a frozen client dies too
    assert proc.wait(timeout=5) == -signal.SIGKILL
    wait_for(lambda: not is_same_process(kid, process_start_time(kid)), what="kid")
    assert leaf.exists()


def test_a_process_sharing_its_cgroup_is_stopped_with_signals_and_its_group_is_left_alone(spawned):
    # Started from this test, the process shares the test's cgroup (or the root): not its own.
    # Its group leader and a sibling in that group are not the client's (a Slurm task's shell, a
    # service's helper): SIGSTOP goes to the client's processes, not to the group.
    leader = _start(spawned, ["sh", "-c", "sh -c 'sleep 60 & wait' & sleep 60 & wait"])
    kids = wait_for(
        lambda: len(descendants(leader.pid)) == 3 and descendants(leader.pid),
        what="the children",
    )
    shell = next(pid for pid in kids if Path(f"/proc/{pid}/comm").read_text().strip() == "sh")
    (kid,) = descendants(shell)
    (sibling,) = set(kids) - {shell, kid}
    pauser = AdoptingPauser(SignalPauser())
    route = pauser.adopt("a2", shell)
    assert route.mechanism is PauseMechanism.SIGNAL, route.reason
    assert route.reason.startswith("SIGSTOP/SIGCONT: ")
    pauser.freeze("a2")
    assert (_state(shell), _state(kid)) == ("T", "T")
    assert "T" not in (_state(sibling), _state(leader.pid))
    assert pauser.is_frozen("a2")
    pauser.thaw("a2")
    wait_for(lambda: _state(shell) != "T" and _state(kid) != "T", what="SIGCONT")
    assert not pauser.is_frozen("a2")
    pauser.kill("a2")
    wait_for(lambda: descendants(leader.pid) == [sibling], what="the client to die")
    assert pauser.pids("a2") == []


def test_a_process_that_is_gone_or_not_the_owners_is_refused(spawned):
    pauser = AdoptingPauser(SignalPauser())
    proc = _start(spawned, ["true"])
    proc.wait(timeout=5)
    with pytest.raises(PauserError, match=f"pid {proc.pid}.*no such process"):
        pauser.adopt("a3", proc.pid)
    with pytest.raises(PauserError, match="init or the daemon"):
        pauser.adopt("a3", os.getpid())
    live = _start(spawned, ["sleep", "60"])
    with pytest.raises(
        PauserError, match=f"belongs to uid {os.getuid()}, not to the client's owner uid 4242"
    ):
        pauser.adopt("a3", live.pid, owner_uid=4242)
    assert pauser.route("a3") is None and pauser.clients() == {}


def test_launched_clients_go_on_to_the_inner_pauser(spawned):
    inner = SignalPauser()
    pauser = AdoptingPauser(inner)
    launched = _start(spawned, ["sleep", "60"])
    adopted = _start(spawned, ["sleep", "60"])
    pauser.attach("l1", launched.pid)
    pauser.adopt("a4", adopted.pid)
    assert pauser.mechanism is inner.mechanism
    assert pauser.mechanism_of("l1") is PauseMechanism.SIGNAL and pauser.route("l1") is None
    assert set(pauser.clients()) == {"l1", "a4"} and inner.clients().keys() == {"l1"}
    pauser.freeze_many(["l1", "a4"])
    assert _state(launched.pid) == _state(adopted.pid) == "T"
    pauser.thaw_many(["l1", "a4"])
    wait_for(lambda: "T" not in (_state(launched.pid), _state(adopted.pid)), what="SIGCONT")
    # Re-adoption after a restart goes through attach: an adopted client stays adopted.
    pauser.attach("a4", adopted.pid)
    assert pauser.route("a4") is not None and "a4" not in inner.clients()
    pauser.release("l1")
    assert inner.clients() == {}


def test_request_frozen_asks_without_waiting_for_both_routes(leaf, spawned):
    """Request gating's path: the adopted client's own cgroup written, or its processes signalled."""
    in_leaf = _start(spawned, ["sleep", "60"], leaf)
    sharing = _start(spawned, ["sleep", "60"])
    pauser = AdoptingPauser(SignalPauser())
    pauser.adopt("a1", in_leaf.pid, owner_uid=os.getuid())
    pauser.adopt("a2", sharing.pid, owner_uid=os.getuid())
    assert pauser.request_frozen(["a1", "a2", "nobody"], True) == ["nobody"]
    assert (leaf / "cgroup.freeze").read_text().strip() == "1"
    wait_for(lambda: pauser.is_frozen("a1") and pauser.is_frozen("a2"), what="both frozen")
    assert pauser.request_frozen(["a1", "a2"], False) == []
    wait_for(lambda: not pauser.is_frozen("a1") and not pauser.is_frozen("a2"), what="thawed")
