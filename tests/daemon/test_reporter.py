"""What the loop tells systemd after each tick, read from a real notify socket (issue 29 item 6).

The reporter sends ``READY=1`` once, a ``STATUS=`` line only when it changes, and the watchdog
ping at half of ``WatchdogSec=`` (``WATCHDOG_USEC``), each after a completed tick, never every
tick: a profile of the daemon at 8 GPUs x 200 clients showed the notify sends, because the bench
asks for a ping each tick (``WATCHDOG_USEC=1``, to count the ticks). Here the daemon's
:func:`gpushare.node.notify.notify` sends to an ``AF_UNIX`` datagram socket bound in a temporary
directory as ``NOTIFY_SOCKET``, as systemd's.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare import config
from gpushare.daemon.registry import Registry
from gpushare.daemon.reporter import Reporter
from gpushare.daemon.state import NodeState
from gpushare.daemon.tick import Tick
from gpushare.model import MpsState
from gpushare.node.clock import SystemClock
from gpushare.node.notify import notify
from gpushare.node.procs.host import HostProcesses
from tests.fakes.fake_gpu import FakeGpuBackend, fake_uuid
from tests.fakes.fake_mps import FakeMpsNode
from tests.fakes.fake_pauser import FakePauser

GPU = fake_uuid(0)
TICK_S = 0.25  # exact in binary: the watchdog's comparisons are not at the mercy of rounding


@pytest.fixture
def systemd(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A notify socket in place of systemd's, named by ``NOTIFY_SOCKET``; 1 s watchdog period."""
    # A short directory: sun_path holds 107 bytes and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="gs-notify-") as tmp:
        address = os.path.join(tmp, "notify.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(address)
        sock.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", address)
        monkeypatch.setenv("WATCHDOG_USEC", "2000000")  # WatchdogSec=2s: ping every 1 s
        monkeypatch.delenv("WATCHDOG_PID", raising=False)
        yield sock
        sock.close()


@pytest.fixture
def state(tmp_path: Path) -> Iterator[NodeState]:
    cfg = config.loads(f"""version = 1
[paths]
runtime_dir = "{tmp_path}/run"
state_dir = "{tmp_path}/state"
""")
    s = NodeState(
        cfg, registry=Registry.in_memory(), gpu=FakeGpuBackend(gpus=1), mps=FakeMpsNode([GPU]),
        pauser=FakePauser(), probe=None, policy=None, clock=SystemClock(), procs=HostProcesses(),
        shallow_library=None,
    )  # fmt: skip
    s.samples = list(s.gpu.sample())
    s.mps_states[GPU] = MpsState.DOWN
    yield s
    s.registry.close()


def received(sock: socket.socket) -> list[list[str]]:
    """Every datagram waiting, each as its lines (read at once: the queue holds only a few)."""
    out = []
    while True:
        try:
            out.append(sock.recv(65536).decode().split("\n"))
        except BlockingIOError:
            return out


def run_ticks(
    reporter: Reporter, sock: socket.socket, lines: list[str], start_s: float = 100.0
) -> list[tuple[float, list[str]]]:
    """One report per tick, every TICK_S, with these lines; the datagrams with their tick time."""
    got = []
    for i, line in enumerate(lines):
        now = start_s + i * TICK_S
        reporter.report(Tick(now, now), line)
        got += [(now, d) for d in received(sock)]
    return got


def test_status_only_when_it_changes_and_the_watchdog_at_half_its_period(
    systemd: socket.socket, state: NodeState
) -> None:
    reporter = Reporter(state, notify=notify, metrics=None)
    lines = ["MPS up 0/1"] * 4 + ["MPS up 1/1"] * 12 + ["MPS up 1/1, 1 queued"] * 8
    state_up_at = 4
    got: list[tuple[float, list[str]]] = []
    got += run_ticks(reporter, systemd, lines[:state_up_at])
    state.mps_states[GPU] = MpsState.UP
    got += run_ticks(reporter, systemd, lines[state_up_at:], start_s=100.0 + state_up_at * TICK_S)
    statuses = [f for _, d in got for f in d if f.startswith("STATUS=")]
    # One STATUS= per distinct line, READY=1 once (it carries the line it was sent with).
    assert statuses == ["STATUS=MPS up 0/1", "STATUS=MPS up 1/1", "STATUS=MPS up 1/1, 1 queued"]
    assert [d for _, d in got if "READY=1" in d] == [["READY=1", "STATUS=MPS up 1/1"]]
    pings = [t for t, d in got if d == ["WATCHDOG=1"]]
    # 24 ticks over 6 s, a 1 s period: a ping at the first tick and then once a second, not 24.
    assert pings == [100.0, 101.0, 102.0, 103.0, 104.0, 105.0]


def test_no_watchdog_ping_when_the_watchdog_is_not_this_process(
    systemd: socket.socket, state: NodeState, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    reporter = Reporter(state, notify=notify, metrics=None)
    got = run_ticks(reporter, systemd, ["steady"] * 12)
    assert [d for _, d in got] == [["STATUS=steady"]]


def test_a_watchdog_of_one_microsecond_pings_after_every_tick(
    systemd: socket.socket, state: NodeState, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What bench/daemon_overhead.py asks for to count the ticks: one ping per completed tick.
    monkeypatch.setenv("WATCHDOG_USEC", "1")
    reporter = Reporter(state, notify=notify, metrics=None)
    got = run_ticks(reporter, systemd, ["steady"] * 5)
    assert [t for t, d in got if d == ["WATCHDOG=1"]] == [100.0 + i * TICK_S for i in range(5)]
