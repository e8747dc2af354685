"""One supervised worker per polled URL, so a slow endpoint delays nobody else's poll.

``--latency-from`` histograms and ``--inflight-from`` gauges are URLs chosen by the user who
submitted the client. Polled in turn on one thread, one endpoint that trickles its reply (a byte
every 30 ms) held back every other client's poll, and so another user's gauge-gated service lost
its protection. :class:`EndpointWorkers` gives each endpoint its own thread (bounded: at most
:data:`MAX_ENDPOINTS`; each is an online client's, and a GPU holds few), under the daemon's
:class:`~gpushare.latency.threads.Supervisor`, with its own period and its own
:class:`~gpushare.latency.prometheus.Cancel`: :meth:`EndpointWorkers.forget` shuts the
connection under way at once, so it does not outlive the client. Each fetch has its own connect,
read and total timeouts (:func:`gpushare.latency.prometheus.fetch_local`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpushare.latency.prometheus import Cancel
from gpushare.latency.threads import SupervisedThread, Supervisor

#: Endpoints polled at once (one thread each); a submit beyond it is refused.
MAX_ENDPOINTS = 256


@dataclass(slots=True)
class _Worker:
    stop: threading.Event
    cancel: Cancel
    thread: SupervisedThread | None = None


class EndpointWorkers:
    """Polls each key (a client id) every ``period_s`` on a supervised thread of its own.

    Args:
        name: the threads' name prefix (``status`` lists them as ``NAME:KEY``).
        period_s: the polling period.
        poll: called with ``(key, cancel)`` once per period; it catches what it expects (a bad
            reply), and anything else it raises restarts its worker (counted).
        threads: the supervisor.
    """

    def __init__(
        self,
        name: str,
        period_s: float,
        poll: Callable[[str, Cancel], None],
        threads: Supervisor,
    ) -> None:
        self.name = name
        self.period_s = period_s
        self._poll = poll
        self._threads = threads
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._started = False
        #: Polls done (tests check an idle set of workers does not wake up).
        self.wakeups = 0

    def add(self, key: str) -> None:
        """Poll ``key`` from now on (a key already polled starts again with a new worker).

        Raises:
            ValueError: :data:`MAX_ENDPOINTS` endpoints are polled already.
        """
        self.check_room(key)
        with self._lock:
            old = self._workers.pop(key, None)
            worker = self._workers[key] = _Worker(threading.Event(), Cancel())
            started = self._started
        if old is not None:
            self._end(old)
        if started:
            self._spawn(key, worker)

    def check_room(self, key: str) -> None:
        """Whether :meth:`add` would take ``key`` now.

        Raises:
            ValueError: :data:`MAX_ENDPOINTS` endpoints are polled already.
        """
        with self._lock:
            full = key not in self._workers and len(self._workers) >= MAX_ENDPOINTS
        if full:
            raise ValueError(
                f"{MAX_ENDPOINTS} endpoints are polled already; end a client that has one"
            )

    def forget(self, key: str) -> None:
        """Stop polling ``key``: the fetch under way is cut off and its connection closed."""
        with self._lock:
            worker = self._workers.pop(key, None)
        if worker is not None:
            self._end(worker)

    def keys(self) -> list[str]:
        """The keys polled."""
        with self._lock:
            return list(self._workers)

    def start(self) -> None:
        """Start a worker for every key, and for each one added later."""
        with self._lock:
            self._started = True
            workers = list(self._workers.items())
        for key, worker in workers:
            self._spawn(key, worker)

    def close(self) -> None:
        """Stop every worker (fetches under way are cut off) and wait for them."""
        with self._lock:
            self._started = False
            workers, self._workers = self._workers, {}
        for worker in workers.values():
            self._end(worker)
        for worker in workers.values():
            if worker.thread is not None:
                worker.thread.join(timeout_s=2.0)

    def alive(self) -> int:
        """Workers whose thread runs."""
        with self._lock:
            workers = list(self._workers.values())
        return sum(1 for w in workers if w.thread is not None and w.thread.is_alive())

    def _spawn(self, key: str, worker: _Worker) -> None:
        def body() -> None:
            deadline = time.monotonic()
            while not worker.stop.wait(max(0.0, deadline - time.monotonic())):
                self.wakeups += 1
                self._poll(key, worker.cancel)
                deadline = max(deadline + self.period_s, time.monotonic())

        worker.thread = self._threads.spawn(f"{self.name}:{key}", body, worker.stop)

    def _end(self, worker: _Worker) -> None:
        worker.stop.set()
        worker.cancel.cancel()
        if worker.thread is not None:
            self._threads.remove(worker.thread)
