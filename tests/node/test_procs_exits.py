"""Noticing exits (gpushare.node.procs.exits.ExitWatcher) of real children and non-children.

Exit codes of children (by Popen or pid, reaped), non-children noticed promptly by pidfd with their
code read from the zombie when it is still there, recycled or gone pids, unwatch and stop, a
failing callback, many processes at once, and no CPU used while nothing exits.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from gpushare.node.procs.exits import ExitWatcher
from gpushare.node.procs.identity import process_start_time
from tests.support.processes import Procs
from tests.support.processes import wait_for as _wait


@pytest.fixture
def watcher() -> Iterator[ExitWatcher]:
    w = ExitWatcher().start()
    yield w
    w.stop()


def test_watcher_reports_child_exit_codes(watcher: ExitWatcher, started: Procs) -> None:
    ok = started.add(subprocess.Popen(["sh", "-c", "exit 0"]))
    three = started.add(subprocess.Popen(["sh", "-c", "sleep 0.2; exit 3"]))
    killed = started.add(subprocess.Popen(["sleep", "30"]))
    for proc in (ok, three, killed):
        watcher.watch(proc)
    killed.send_signal(signal.SIGTERM)
    got = {watcher.exits.get(timeout=10) for _ in range(3)}
    assert got == {(ok.pid, 0), (three.pid, 3), (killed.pid, -signal.SIGTERM)}
    assert watcher.watched() == []
    assert three.returncode == 3  # reaped through the Popen, which keeps its code


def test_watcher_reaps_child_given_by_pid(watcher: ExitWatcher) -> None:
    proc = subprocess.Popen(["sh", "-c", "sleep 0.1; exit 5"])
    watcher.watch(proc.pid)
    assert watcher.exits.get(timeout=10) == (proc.pid, 5)
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)  # already reaped: no zombie left behind


def test_watcher_child_already_exited(watcher: ExitWatcher) -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 9"])
    assert _wait(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE)
    watcher.watch(proc)
    assert watcher.exits.get(timeout=10) == (proc.pid, 9)


def _grandchild(started: Procs, seconds: float = 30) -> int:
    """Start a process that is not our child (its parent exits at once) and return its pid."""
    out = subprocess.run(
        ["sh", "-c", f"sleep {seconds} >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    pid = int(out.stdout.strip())
    started.pids.append(pid)
    return pid


def test_watcher_notices_non_child_exit_promptly(watcher: ExitWatcher, started: Procs) -> None:
    pid = _grandchild(started)
    assert psutil.Process(pid).ppid() != os.getpid()
    start = process_start_time(pid)
    assert start is not None
    assert watcher.watch(pid, start_time=start)
    time.sleep(0.2)
    assert watcher.exits.empty()  # still running: nothing reported
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    got = watcher.exits.get(timeout=5)
    noticed_s = time.monotonic() - t0
    # Unknown (None) once its reaper was faster than us, else read from the zombie.
    assert got in {(pid, None), (pid, -signal.SIGKILL)}
    # Generous bound: event-driven noticing is sub-millisecond; polling every few seconds fails.
    assert noticed_s < 2.0


def test_watcher_non_child_recycled_or_gone(watcher: ExitWatcher, started: Procs) -> None:
    pid = _grandchild(started)
    start = process_start_time(pid)
    assert start is not None
    assert not watcher.watch(pid, start_time=start - 10.0)  # recorded start differs
    assert watcher.exits.get(timeout=5) == (pid, None)
    assert watcher.watched() == []

    proc = subprocess.Popen(["true"])
    proc.wait()
    assert not watcher.watch(proc.pid)  # gone and reaped before watch: reported at once
    assert watcher.exits.get(timeout=5) == (proc.pid, None)


def test_watcher_unwatch_and_stop(started: Procs) -> None:
    got: list[tuple[int, int | None]] = []
    done = threading.Event()

    def on_exit(pid: int, code: int | None) -> None:
        got.append((pid, code))
        done.set()

    w = ExitWatcher(on_exit).start()
    try:
        quiet = started.add(subprocess.Popen(["sleep", "30"]))
        loud = started.add(subprocess.Popen(["sleep", "30"]))
        w.watch(quiet)
        w.watch(loud)
        w.unwatch(quiet.pid)
        quiet.kill()
        loud.kill()
        assert done.wait(5)
        time.sleep(0.1)
        assert got == [(loud.pid, -signal.SIGKILL)]
    finally:
        w.stop()
    assert not w._thread.is_alive()
    assert w.watched() == []


def test_watcher_survives_failing_callback(started: Procs) -> None:
    seen: queue.Queue[int] = queue.Queue()

    def on_exit(pid: int, code: int | None) -> None:
        seen.put(pid)
        raise RuntimeError("callback bug")

    w = ExitWatcher(on_exit).start()
    try:
        a = started.add(subprocess.Popen(["true"]))
        w.watch(a)
        assert seen.get(timeout=5) == a.pid
        b = started.add(subprocess.Popen(["true"]))
        w.watch(b)
        assert seen.get(timeout=5) == b.pid  # still watching after the first callback raised
    finally:
        w.stop()


def test_watcher_many_processes(watcher: ExitWatcher, started: Procs) -> None:
    kids = [
        started.add(subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({i})"]))
        for i in range(20)
    ]
    for kid in kids:
        watcher.watch(kid)
    got = dict(watcher.exits.get(timeout=20) for _ in kids)
    assert got == {kid.pid: i for i, kid in enumerate(kids)}


def test_watcher_thread_sleeps_while_nothing_exits(watcher: ExitWatcher, started: Procs) -> None:
    # Exit noticing is event-driven: a watcher with live processes uses no CPU while they run.
    for _ in range(5):
        watcher.watch(started.add(subprocess.Popen(["sleep", "30"])))
    native_id = watcher._thread.native_id

    def thread_cpu() -> float:
        for t in psutil.Process().threads():
            if t.id == native_id:
                return t.user_time + t.system_time
        raise AssertionError("watcher thread not found")

    before = thread_cpu()
    time.sleep(1.0)
    assert thread_cpu() - before <= 0.01
    assert len(watcher.watched()) == 5
    assert watcher.exits.empty()


@pytest.mark.parametrize(("how", "code"), [("exit 4", 4), ("kill -9 $$", -signal.SIGKILL)])
def test_watcher_reads_code_of_unreaped_non_child(
    watcher: ExitWatcher, started: Procs, how: str, code: int
) -> None:
    # The grandchild finishes while its parent (now `sleep 5`, which never waits) keeps it a
    # zombie: its status is still in /proc and the watcher reports it.
    parent = started.add(
        subprocess.Popen(
            ["sh", "-c", f"sh -c 'sleep 0.3; {how}' & echo $!; exec sleep 5"],
            stdout=subprocess.PIPE,
        )
    )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert psutil.Process(pid).ppid() == parent.pid
    watcher.watch(pid)
    assert watcher.exits.get(timeout=5) == (pid, code)


def test_watcher_popen_already_waited(watcher: ExitWatcher) -> None:
    proc = subprocess.Popen(["sh", "-c", "exit 6"])
    assert proc.wait(timeout=10) == 6
    watcher.watch(proc)
    assert watcher.exits.get(timeout=5) == (proc.pid, 6)
    assert watcher.watched() == []


def test_watcher_refuses_watch_after_stop() -> None:
    w = ExitWatcher().start()
    w.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        w.watch(os.getpid())
