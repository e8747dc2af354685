"""Supervised threads: a receiver or poller that dies is restarted with backoff, and counted.

The daemon's background threads read what any local user can send (latency datagrams, the
gauges and histograms of their URLs). A bug one input reaches must not switch request gating or
app latency off for the whole node until a restart, silently: :class:`Supervisor` runs each
body in a loop, and when it raises, logs it (type and traceback, no local variables:
:mod:`gpushare.logs`), counts a restart, waits a backoff that doubles up to ``max_backoff_s``
(reset once the body has run ``healthy_after_s`` without failing) and runs it again.
:meth:`Supervisor.health` is what ``status`` shows as ``daemon.threads`` and ``doctor`` checks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ThreadHealth:
    """One supervised thread, as ``status`` shows it.

    ``last_error`` is the exception's type only: its message may hold text a user sent.
    """

    name: str
    alive: bool
    restarts: int
    last_error: str | None
    last_restart_mono_s: float | None


class SupervisedThread:
    """A daemon thread running ``body`` until ``stop`` is set, restarting it when it raises."""

    def __init__(
        self,
        name: str,
        body: Callable[[], None],
        stop: threading.Event,
        *,
        backoff_s: float,
        max_backoff_s: float,
        healthy_after_s: float,
    ) -> None:
        self.name = name
        self._body = body
        self.stop = stop
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._healthy_after_s = healthy_after_s
        self.restarts = 0
        self.last_error: str | None = None
        self.last_restart_mono_s: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> SupervisedThread:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        """Whether the thread runs (it ends only once ``stop`` is set or its body returns)."""
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        """Wait for the thread to end."""
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        delay = self._backoff_s
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                self._body()
            except Exception as exc:
                self.last_error = type(exc).__name__
                self.restarts += 1
                self.last_restart_mono_s = time.monotonic()
                if time.monotonic() - began >= self._healthy_after_s:
                    delay = self._backoff_s
                log.exception(
                    "thread_died", thread=self.name, restarts=self.restarts, backoff_s=delay
                )
                if self.stop.wait(delay):
                    return
                delay = min(delay * 2.0, self._max_backoff_s)
            else:
                return  # the body ended on its own (its stop was set, or it has nothing to do)

    def health(self) -> ThreadHealth:
        """The thread's health now."""
        return ThreadHealth(
            self.name, self.is_alive(), self.restarts, self.last_error, self.last_restart_mono_s
        )


WatchProbe = Callable[[], tuple[bool, int, "str | None"]]
"""How a thread the supervisor does not start reports itself: ``(alive, restarts, last_error)``."""


class Supervisor:
    """Starts and keeps the daemon's receiver and poller threads; see the module docstring.

    Threads that keep themselves alive in their own loop (the gate timer, the exit watcher, the
    adoption scan, the API's I/O loop) are :meth:`watch`-ed instead, so that ``status`` and
    ``doctor`` show every thread the node's protection depends on.
    """

    def __init__(
        self,
        *,
        backoff_s: float = 0.1,
        max_backoff_s: float = 30.0,
        healthy_after_s: float = 60.0,
    ) -> None:
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._healthy_after_s = healthy_after_s
        self._lock = threading.Lock()
        self._threads: dict[str, SupervisedThread] = {}
        #: Restarts of threads since removed (a forgotten endpoint's worker), so totals only grow.
        self._gone_restarts = 0
        self._watched: dict[str, WatchProbe] = {}

    def watch(self, name: str, probe: WatchProbe) -> None:
        """Show a thread that restarts itself (see the class docstring) under ``name``."""
        with self._lock:
            self._watched[name] = probe

    def spawn(self, name: str, body: Callable[[], None], stop: threading.Event) -> SupervisedThread:
        """Start ``body`` on a supervised thread called ``name``.

        A listed thread of that name is replaced in the listing (stop it first).
        """
        thread = SupervisedThread(
            name, body, stop, backoff_s=self._backoff_s, max_backoff_s=self._max_backoff_s,
            healthy_after_s=self._healthy_after_s,
        )  # fmt: skip
        with self._lock:
            old = self._threads.pop(name, None)
            if old is not None:
                self._gone_restarts += old.restarts
            self._threads[name] = thread
        return thread.start()

    def remove(self, thread: SupervisedThread) -> None:
        """Stop listing a thread whose work ended (its stop is set); its restarts stay counted."""
        with self._lock:
            if self._threads.get(thread.name) is thread:
                del self._threads[thread.name]
                self._gone_restarts += thread.restarts

    def health(self) -> list[ThreadHealth]:
        """Every listed and watched thread's health, by name."""
        with self._lock:
            threads = list(self._threads.values())
            watched = list(self._watched.items())
        found = [t.health() for t in threads]
        for name, probe in watched:
            alive, restarts, last_error = probe()
            found.append(ThreadHealth(name, alive, restarts, last_error, None))
        return sorted(found, key=lambda h: h.name)

    def total_restarts(self) -> int:
        """Restarts of every thread so far, removed and watched ones included."""
        with self._lock:
            listed = self._gone_restarts + sum(t.restarts for t in self._threads.values())
            watched = list(self._watched.values())
        return listed + sum(probe()[1] for probe in watched)

    def dead(self) -> list[str]:
        """Threads that ended while their stop was not set (a supervisor bug; should be none)."""
        with self._lock:
            threads = list(self._threads.values())
        return [t.name for t in threads if not t.is_alive() and not t.stop.is_set()]


def threads_status(threads: Supervisor, datagram_drops: Mapping[str, int]) -> dict[str, Any]:
    """What ``status`` shows of the threads: ``daemon.threads`` and its companions.

    ``thread_restarts`` and ``datagram_drops`` too (docs/status-schema.md).
    """
    return {
        "threads": [
            {"name": h.name, "alive": h.alive, "restarts": h.restarts, "last_error": h.last_error}
            for h in threads.health()
        ],
        "thread_restarts": threads.total_restarts(),
        "datagram_drops": dict(datagram_drops),
    }
