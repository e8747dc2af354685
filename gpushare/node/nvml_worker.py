"""The thread NVML calls run on, so that a call hung in the kernel can be waited for with a timeout.

NVML can hang in the kernel (a D-state thread cannot be killed or joined).
:class:`gpushare.node.nvml.NvmlBackend` gives every GPU a :class:`Worker` of its own (and one for
init, discovery and shutdown), submits each call to it and waits on the returned future at most its
``call_timeout_s``; a stuck worker is left alone, and nothing more is queued to it until it answers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class Worker:
    """One daemon thread running submitted calls in order.

    Daemon, not a ThreadPoolExecutor: a call stuck in the kernel must not block interpreter exit.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        """Queue ``fn``; its result (or exception) arrives in the returned future."""
        fut: Future[Any] = Future()
        self._queue.put((fn, fut))
        return fut

    def stop(self) -> None:
        """End the thread once the calls queued before this one have run."""
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which decides
                fut.set_exception(exc)
