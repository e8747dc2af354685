"""Real child processes for the node tests: starting, reaping, and watching their CPU time.

:class:`Children` (the ``children`` fixture of ``tests/node/conftest.py``) and :class:`Procs` (its
``started`` fixture) kill and reap what a test started; :func:`wait_for` polls a condition; the
CPU helpers tell a running process from a frozen or stopped one on a shared machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import psutil

BUSY = [sys.executable, "-c", "while True: pass"]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# Forks one child on the first line of input, then waits for a second line (so it outlives the child).
FORK_ON_LINE = ["sh", "-c", "read line; sleep 60 & read line"]


class Children:
    """Processes started by a test; every one is killed and reaped at teardown."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def cleanup(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout=10)


class Procs:
    """Every process a test starts, killed (group first) and reaped at teardown."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[bytes]] = []
        self.pids: list[int] = []

    def add(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.popens.append(proc)
        return proc

    def cleanup(self) -> None:
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.popens:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(ChildProcessError):
                proc.wait(timeout=10)


def wait_for(predicate: Callable[[], object], timeout_s: float = 5.0) -> bool:
    """Whether ``predicate()`` became true within ``timeout_s``, polled every 10 ms."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def cpu_s(pid: int) -> float:
    """User plus system CPU seconds the process has used so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def cpu_over(pid: int, seconds: float) -> float:
    """CPU seconds the process uses while this one sleeps ``seconds``."""
    before = cpu_s(pid)
    time.sleep(seconds)
    return cpu_s(pid) - before


def wait_running_cpu(pid: int, want_s: float = 0.05, limit_s: float = 10.0) -> float:
    """CPU seconds gained once ``want_s`` is reached, or what was gained within ``limit_s``."""
    # The machine is shared: wait for the child to get some CPU rather than assume a rate.
    start = cpu_s(pid)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(0.05)
        gained = cpu_s(pid) - start
        if gained >= want_s:
            return gained
    return cpu_s(pid) - start


def gone(pid: int) -> bool:
    """Whether the process has exited (a zombie counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
