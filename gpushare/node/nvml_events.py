"""XID events: a thread of their own waits on NVML's event set and keeps what it sees.

:class:`XidWatcher` registers every discovered GPU for critical XID errors, waits on the set in
slices of ``wait_ms`` (finite, so the thread notices :meth:`XidWatcher.stop`), and records each
XID as a :class:`~gpushare.model.GpuEvent` (``fatal`` when its number is in ``fatal_xids``) until
:meth:`gpushare.node.nvml.NvmlBackend.drain_events` takes them. All calls go through
:class:`~gpushare.node.nvml_calls.NvmlCalls`, on the watcher's thread (event waits are not per GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from gpushare.model import GpuEvent
from gpushare.node.nvml_calls import NvmlCalls, NvmlGpu
from gpushare.node.nvml_errors import NVML_ERROR_TIMEOUT, GpuLostError, NvmlError

# The backend's logger: operators filter NVML's lines by it, whichever file writes them.
log = structlog.get_logger("gpushare.node.nvml")

XID_CRITICAL_ERROR_EVENT = 0x8


class XidWatcher:
    """The event thread, its event set and the events seen and not yet drained."""

    def __init__(
        self,
        calls: NvmlCalls,
        *,
        wait_ms: int,
        wall_clock: Callable[[], float],
        fatal_xids: frozenset[int],
    ) -> None:
        self._calls = calls
        self._wait_ms = wait_ms
        self._wall_clock = wall_clock
        self._fatal_xids = fatal_xids
        self._events: list[GpuEvent] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._event_set: Any = None

    def start(self, gpus: Sequence[NvmlGpu]) -> None:
        """Start the thread, which registers ``gpus`` (those discovered) for XID events."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, args=(gpus,), name="nvml-events", daemon=True
        )
        self._thread.start()

    def stop(self) -> bool:
        """Ask the thread to stop and wait for it (bounded); whether it has ended."""
        self._stop.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout=self._wait_ms / 1000 + 1.0)
        return not thread.is_alive()

    def free_set(self) -> None:
        """Free the event set (only once the thread has ended: freeing under a waiter is undefined)."""
        if self._event_set is not None:
            with contextlib.suppress(NvmlError, GpuLostError):
                self._calls.call(None, "nvmlEventSetFree", self._event_set)

    def drain(self) -> tuple[GpuEvent, ...]:
        """XID events seen since the last call."""
        with self._lock:
            events, self._events = tuple(self._events), []
        return events

    def _loop(self, gpus: Sequence[NvmlGpu]) -> None:
        calls = self._calls
        by_handle: dict[Any, str] = {}
        try:
            self._event_set = calls.call(None, "nvmlEventSetCreate")
            if self._event_set is None:
                return
            for gpu in gpus:
                if gpu.discovery_error is not None:
                    continue
                by_handle[_handle_key(gpu.handle)] = gpu.uuid
                try:
                    calls.call(
                        None,
                        "nvmlDeviceRegisterEvents",
                        gpu.handle,
                        XID_CRITICAL_ERROR_EVENT,
                        self._event_set,
                    )
                except (NvmlError, GpuLostError) as exc:
                    log.warning("nvml_event_register_failed", gpu=gpu.uuid, error=str(exc))
        except (NvmlError, GpuLostError) as exc:
            log.warning("nvml_event_set_failed", error=str(exc))
            return
        log.info("nvml_events_started", gpus=len(by_handle))
        while not self._stop.is_set():
            try:
                data = calls.call(None, "nvmlEventSetWait_v2", self._event_set, self._wait_ms)
            except NvmlError as exc:
                if exc.code == NVML_ERROR_TIMEOUT:
                    continue
                log.warning("nvml_event_wait_failed", error=str(exc))
                self._stop.wait(1.0)
                continue
            except GpuLostError as exc:
                log.warning("nvml_event_wait_gpu_lost", error=str(exc))
                self._stop.wait(1.0)
                continue
            if data is None:
                # NotSupported: the set is unusable on this host; stop instead of spinning.
                return
            self._on_event(data, by_handle)

    def _on_event(self, data: Any, by_handle: dict[Any, str]) -> None:
        if int(data.eventType) & XID_CRITICAL_ERROR_EVENT == 0:
            return
        uuid = by_handle.get(_handle_key(data.device), "unknown")
        xid = int(data.eventData)
        event = GpuEvent(
            gpu_uuid=uuid, xid=xid, at_s=self._wall_clock(), fatal=xid in self._fatal_xids
        )
        log.warning("gpu_xid", gpu=uuid, xid=xid, fatal=event.fatal)
        with self._lock:
            self._events.append(event)


def _handle_key(handle: Any) -> Any:
    """A hashable key equal for two handles of the same device (ctypes pointers compare by id)."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return handle
