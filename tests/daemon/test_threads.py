"""Supervised receiver and poller threads: a thread that dies is restarted, counted and shown.

On b0c0ecb one datagram ended the latency receiver for good and nothing said so: ``status``
had no word of it. Here a body that raises is restarted with a backoff; ``status`` lists every
supervised thread (``daemon.threads``) and ``doctor`` turns a dead one into a FAIL.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gpushare.cli.doctor import Status, daemon_threads_check
from gpushare.daemon.threads import Supervisor
from gpushare.inflight import GaugePoller, Rejections
from tests.support.daemon_helpers import DaemonProc, wait_for


def test_a_body_that_raises_is_restarted_with_backoff_and_counted() -> None:
    threads = Supervisor(backoff_s=0.02, max_backoff_s=0.05)
    stop = threading.Event()
    runs: list[float] = []

    def body() -> None:
        runs.append(time.monotonic())
        if len(runs) <= 3:
            raise KeyError("a bug some input reaches")
        stop.wait()

    threads.spawn("worker", body, stop)
    wait_for(lambda: len(runs) == 4, 5.0, "three restarts")
    (health,) = threads.health()
    assert health.alive and health.restarts == 3
    assert health.last_error == "KeyError"  # the type only: a message may hold a user's text
    assert runs[1] - runs[0] >= 0.02 and runs[3] - runs[2] >= 0.04  # the backoff doubles
    stop.set()
    wait_for(lambda: not threads.health()[0].alive, 5.0, "the thread to end")
    assert threads.dead() == []  # ended because asked to


def test_a_gauge_worker_that_hits_a_bug_keeps_polling() -> None:
    threads = Supervisor(backoff_s=0.01)
    polls: list[int] = []

    def on_count(_client_id: str, count: int, _now: float) -> None:
        polls.append(count)
        if len(polls) == 1:
            raise RuntimeError("a bug in the gate")

    poller = GaugePoller(
        0.01, on_count, Rejections(), fetch=lambda _s, _t: "inflight 1\n", threads=threads
    )
    poller.start()
    try:
        poller.add("web", "prometheus:http://127.0.0.1:9/metrics#inflight")
        wait_for(lambda: len(polls) >= 5, 5.0, "polls after the restart")
        (health,) = threads.health()
        assert health.name == "inflight-gauge:web" and health.alive and health.restarts == 1
    finally:
        poller.close()
    assert threads.total_restarts() == 1


def test_doctor_fails_a_dead_thread_and_warns_on_restarts() -> None:
    alive = {"name": "latency-receiver", "alive": True, "restarts": 0, "last_error": None}
    ok = daemon_threads_check({"threads": [alive], "thread_restarts": 0})
    assert ok is not None and ok.status is Status.OK
    dead = daemon_threads_check({"threads": [{**alive, "alive": False}], "thread_restarts": 0})
    assert dead is not None and dead.status is Status.FAIL
    assert "latency-receiver" in dead.detail
    again = {**alive, "restarts": 2, "last_error": "KeyError"}
    warn = daemon_threads_check({"threads": [again], "thread_restarts": 2})
    assert warn is not None and warn.status is Status.WARN and "KeyError" in warn.detail
    assert daemon_threads_check(None) is None


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc().start()
    try:
        yield d
    finally:
        d.cleanup()


def test_status_shows_the_receiver_alive_after_hostile_datagrams(daemon: DaemonProc) -> None:
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        tx.connect(str(daemon.base / "run" / "latency.sock"))
        for data in (b"[" * 60000, b'{"v":1,"id":"c1","s":[' + b"9" * 400 + b"]}", b"[" * 3000):
            tx.send(data)
    finally:
        tx.close()

    def drops() -> int:
        return sum(daemon.call("status")["daemon"]["datagram_drops"].values())

    wait_for(lambda: drops() == 3, 15.0, "three drops counted")  # a loaded CI machine
    info = daemon.call("status")["daemon"]
    receiver = next(t for t in info["threads"] if t["name"] == "latency-receiver")
    assert receiver["alive"] and receiver["restarts"] == 0
    assert info["thread_restarts"] == 0
    assert info["datagram_drops"] == {
        "oversized": 1,
        "malformed: number too long": 1,
        "malformed: nested too deep": 1,
    }
