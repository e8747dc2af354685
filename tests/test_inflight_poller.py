"""gpushare.latency.inflight.GaugePoller's workers: none while it has nothing to poll, prompt once it has."""

from __future__ import annotations

import threading
import time

from gpushare.latency.inflight import GaugePoller, Rejections
from gpushare.latency.threads import Supervisor

SPEC = "prometheus:http://127.0.0.1:9/metrics#inflight"


def test_an_idle_poller_sleeps_and_polls_a_gauge_added_later_at_once() -> None:
    counts: list[tuple[str, int]] = []
    got = threading.Event()

    def on_count(client_id: str, count: int, _now: float) -> None:
        counts.append((client_id, count))
        got.set()

    threads = Supervisor()
    poller = GaugePoller(
        0.01, on_count, Rejections(), fetch=lambda _src, _t: "inflight 3\n", threads=threads
    )
    poller.start()
    try:
        # Thirty periods with no gauge: a poller that woke every period would count ~30.
        time.sleep(0.3)
        assert poller.wakeups == 0
        poller.add("web", SPEC)
        assert got.wait(5.0), "a gauge added to an idle poller was not polled"
        assert counts[0] == ("web", 3)
        # With a gauge it polls every period again.
        time.sleep(0.2)
        assert len(counts) >= 5
        poller.forget("web")
        time.sleep(0.05)  # the poll under way, if any, ends; then it sleeps again
        idle_from = poller.wakeups
        time.sleep(0.3)
        assert poller.wakeups - idle_from <= 1
    finally:
        poller.close()
    assert poller.alive() == 0 and threads.health() == []


def test_close_ends_a_poller_waiting_out_a_long_period() -> None:
    threads = Supervisor()
    poller = GaugePoller(
        10.0, lambda *_: None, Rejections(), fetch=lambda _src, _t: "", threads=threads
    )
    poller.start()
    poller.add("web", SPEC)
    assert poller.alive() == 1
    t0 = time.monotonic()
    poller.close()
    assert poller.alive() == 0 and threads.health() == []
    assert time.monotonic() - t0 < 2.0
