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
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpushare import config
from gpushare.daemon.registry import Registry
from gpushare.daemon.reporter import Reporter
from gpushare.daemon.state import NodeState
from gpushare.daemon.thawlog import ThawLog
from gpushare.daemon.tick import Tick
from gpushare.metrics import Exporter
from gpushare.model import (
    ClientClass,
    ClientState,
    ClientView,
    Limits,
    MpsState,
    Observation,
    ProbeReading,
)
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


# ----------------------------------------------------------------------------- the metrics snapshot


class CountingThawLog(ThawLog):
    """The thaw log, counting the per-client figures asked of it (the snapshot's cost, not timed)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = 0

    def total_s(self, client_id: str, now: float) -> float | None:
        self.asked += 1
        return super().total_s(client_id, now)

    def fraction(self, client_id: str, now: float) -> float | None:
        self.asked += 1
        return super().fraction(client_id, now)


def offline_clients(state: NodeState, n: int) -> dict[str, Observation]:
    """``n`` running offline clients on the GPU, thawed since t=90; the GPU's observation."""
    views = []
    for i in range(n):
        rec = state.registry.add_client(
            cls=ClientClass.OFFLINE, argv=["sleep", "600"], uid=1000, gid=1000, user="u",
            state=ClientState.STARTING, priority=1, gpu_uuid=GPU, gpu_index=0, now=0.0,
        )  # fmt: skip
        state.registry.transition(rec.id, ClientState.RUNNING, pid=100000 + i)
        state.ops.paused(rec.id, False, 90.0)
        limits = Limits(sm_pct=40.0, pinned_mem_bytes=None, priority=1)
        views.append(ClientView(rec.id, ClientClass.OFFLINE, ClientState.RUNNING, limits, uid=1000))
    sample = state.samples[0]
    probe = ProbeReading(latency_ms=None, baseline_ms=None, ratio=None)
    return {GPU: Observation(GPU, 0, sample, probe, tuple(views), MpsState.UP)}


def thawed_seconds(exporter: Exporter) -> dict[str, float]:
    text = generate_latest(exporter.registry).decode()
    return {
        s.labels["client"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "gpushare_client_thawed_seconds_total"
    }


def test_ticks_without_a_scrape_do_no_per_client_snapshot_work(state: NodeState) -> None:
    thaw = state.ops.thaw = CountingThawLog()
    observations = offline_clients(state, 20)
    exporter = Exporter(hostname="n1")
    reporter = Reporter(state, notify=lambda *f: True, metrics=exporter)
    records = state.registry.clients()
    thaw.asked = 0
    for i in range(50):
        reporter.publish(observations, records, Tick(100.0 + i * 0.1, 1e9 + i * 0.1))
    # Before: every tick asked the thaw log for each live client's two figures (2 x 20 x 50).
    assert thaw.asked == 0
    assert exporter.health()[0]  # the ticks still count for /healthz
    # A scrape asks once per client and figure, as of the last tick (thawed from 90 to 104.9).
    seconds = thawed_seconds(exporter)
    assert thaw.asked == 2 * 20
    assert seconds == {r.id: pytest.approx(14.9) for r in records}
    # A second scrape within the same tick renders the same snapshot: nothing asked again.
    assert thawed_seconds(exporter) == seconds
    assert thaw.asked == 2 * 20


def test_a_scrape_never_waits_for_the_state_lock(state: NodeState) -> None:
    # A tick holds the state lock; a scrape that needed it would stall behind every tick (and
    # a flood of them would stall the loop): it reads only what the last tick published.
    observations = offline_clients(state, 3)
    exporter = Exporter(hostname="n1")
    reporter = Reporter(state, notify=lambda *f: True, metrics=exporter)
    reporter.publish(observations, state.registry.clients(), Tick(100.0, 1e9))
    got: list[dict[str, float]] = []
    with state.lock:
        scrape = threading.Thread(target=lambda: got.append(thawed_seconds(exporter)))
        scrape.start()
        scrape.join(timeout=10)
        assert not scrape.is_alive()
    assert sorted(got[0].values()) == [10.0, 10.0, 10.0]
