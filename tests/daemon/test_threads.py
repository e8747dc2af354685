"""Supervised receiver and poller threads: a thread that dies is restarted, counted and shown.

On b0c0ecb one datagram ended the latency receiver for good and nothing said so: ``status``
had no word of it. Here a body that raises is restarted with a backoff; ``status`` lists every
supervised thread (``daemon.threads``) and ``doctor`` turns a dead one into a FAIL.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from bench.support.daemon_helpers import DaemonProc, wait_for
from gpushare.cli.doctor import Status, daemon_threads_check
from gpushare.daemon.gating import Gatekeeper
from gpushare.latency.inflight import GaugePoller, Rejections
from gpushare.latency.threads import Supervisor
from gpushare.node.procs.exits import ExitWatcher


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
    path = daemon.base / "run" / "latency.sock"
    # The receiver binds its socket on its own thread: ready for the API is not yet bound here.
    wait_for(path.exists, 10.0, "the latency socket to be bound")
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        tx.connect(str(path))
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


def test_status_shows_every_thread_the_nodes_protection_needs(daemon: DaemonProc) -> None:
    # On b0c0ecb the gate timer, the exit watcher, the adoption scan and the API's I/O loop were
    # plain threads: one that died took gating, exit reports or adoption with it, unseen.
    wanted = ("api-io", "adoption", "exit-watcher", "gate-timer", "latency-receiver")

    def threads() -> dict[str, dict[str, object]] | None:
        found = {t["name"]: t for t in daemon.call("status")["daemon"]["threads"]}
        # The API answers before the latency socket is opened: wait for the whole start.
        return found if all(n in found and found[n]["alive"] for n in wanted) else None

    names = wait_for(threads, 10.0, "every thread alive")
    assert all(names[n]["restarts"] == 0 for n in wanted)


def test_the_gate_timer_survives_a_failure_and_counts_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpushare.control import gate
    from tests.daemon.test_gating import CFG, GPU, FakePauser

    gk = Gatekeeper(CFG, FakePauser())
    real = gate.due_at
    failures = [1]

    def due_at_failing_once(*args: object, **kwargs: object) -> float | None:
        if failures:
            failures.pop()
            raise ZeroDivisionError("a bug some timing reaches")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gate, "due_at", due_at_failing_once)
    gk.update_clients({"web": GPU}, {GPU: ["train-1"]}, 0.0)
    gk.set_enabled(GPU, True, 0.0)
    gk.start()
    try:
        gk.on_inflight("web", None, 1, time.monotonic())  # the timer now has a gate to time
        wait_for(lambda: gk.timer_health()[1] == 1, 5.0, "the timer's failure counted")
        alive, restarts, last_error = gk.timer_health()
        assert alive and restarts == 1 and last_error == "ZeroDivisionError"
    finally:
        gk.close()


def test_the_exit_watcher_survives_a_failure_and_still_reports_exits() -> None:
    reported: list[tuple[int, int | None]] = []
    w = ExitWatcher(lambda pid, code: reported.append((pid, code)))
    real = w._watch
    calls = [0]

    def failing_once() -> None:
        calls[0] += 1
        if calls[0] == 1:
            raise OSError("a pidfd gone bad")
        real()

    w._watch = failing_once  # type: ignore[method-assign]
    w.start()
    try:
        wait_for(lambda: w.health()[1] == 1, 5.0, "the watcher's failure counted")
        proc = subprocess.Popen(["sh", "-c", "exit 7"])
        w.watch(proc)
        wait_for(lambda: reported == [(proc.pid, 7)], 5.0, "the exit reported after the failure")
        assert w.health() == (True, 1, "OSError")
    finally:
        w.stop()
