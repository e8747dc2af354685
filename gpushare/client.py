"""Talking to the gpushare daemon from other processes.

Sections of this module:

* the CLI's API socket client (added by the CLI work; above the latency section), and
* **app-reported latency** (at the end): :func:`report_latency`, which a latency-critical service
  calls once per request. Its daemon side is :mod:`gpushare.latency`.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import socket
import threading
import time

from gpushare import paths

# =====================================================================================
# App-reported latency: services call report_latency(seconds) once per request.
# Wire format (UTF-8 JSON, one datagram per batch):
#     {"v": 1, "id": "<GPUSHARE_CLIENT_ID or empty>", "s": [<latency in seconds>, ...]}
# Reports are batched for up to FLUSH_INTERVAL_S or FLUSH_MAX_VALUES values, because the kernel
# queues only net.unix.max_dgram_qlen (default 10) datagrams per Unix socket: one datagram per
# request would be dropped at any real request rate. The daemon identifies the sender by the
# kernel-verified pid/uid (SCM_CREDENTIALS) and the id.
# =====================================================================================

LATENCY_WIRE_VERSION = 1
FLUSH_INTERVAL_S = 0.02
FLUSH_MAX_VALUES = 32

_latency_lock = threading.Lock()
_latency_sock: socket.socket | None = None
_latency_sock_pid: int | None = None
_latency_buffer: list[float] = []
_latency_last_flush_s = 0.0
_latency_dropped = 0


def latency_socket_path() -> str:
    """Where reports go: ``$GPUSHARE_LATENCY_SOCKET``, else the daemon's default runtime path."""
    return os.environ.get(paths.ENV_LATENCY_SOCKET) or str(
        paths.RUNTIME_DIR / paths.LATENCY_SOCKET_NAME
    )


def encode_latency(client_id: str, seconds: list[float]) -> bytes:
    """A batch of latency reports as the datagram :func:`report_latency` sends."""
    return json.dumps(
        {"v": LATENCY_WIRE_VERSION, "id": client_id, "s": seconds}, separators=(",", ":")
    ).encode()


def _socket() -> socket.socket:
    global _latency_sock, _latency_sock_pid
    pid = os.getpid()
    sock = _latency_sock
    if sock is not None and _latency_sock_pid == pid:
        return sock
    with _latency_lock:
        # A forked child must not share its parent's socket object state; make its own.
        if _latency_sock is None or _latency_sock_pid != pid:
            new = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            new.setblocking(False)
            _latency_sock, _latency_sock_pid = new, pid
        return _latency_sock


def report_latency(seconds: float) -> None:
    """Report one request's latency to the gpushare daemon. Never blocks, never raises.

    Reports are sent as non-blocking datagrams to the daemon's latency socket, batched for at
    most 20 ms (or 32 reports), carrying ``$GPUSHARE_CLIENT_ID`` (set by ``gpushare submit``).
    When the daemon is down, its socket is missing or its queue is full, the batch is dropped
    silently (see :func:`latency_reports_dropped`); a negative, NaN or infinite value is dropped
    too. The daemon turns reports into the client's p99 over ``[latency] window``.

    Args:
        seconds: the request's latency in seconds (wall time from arrival to response).
    """
    global _latency_dropped, _latency_last_flush_s, _latency_buffer
    try:
        value = float(seconds)
        if not math.isfinite(value) or value < 0:
            _latency_dropped += 1
            return
        now = time.monotonic()
        with _latency_lock:
            _latency_buffer.append(value)
            if (
                len(_latency_buffer) < FLUSH_MAX_VALUES
                and now - _latency_last_flush_s < FLUSH_INTERVAL_S
            ):
                return
            batch, _latency_buffer = _latency_buffer, []
            _latency_last_flush_s = now
        _send(batch)
    except Exception:  # noqa: BLE001 - a service must never fail because gpushare is absent
        _latency_dropped += 1


def flush_latency() -> None:
    """Send reports still batched (also run at interpreter exit). Never blocks, never raises."""
    global _latency_buffer, _latency_last_flush_s
    try:
        with _latency_lock:
            batch, _latency_buffer = _latency_buffer, []
            _latency_last_flush_s = time.monotonic()
        if batch:
            _send(batch)
    except Exception:  # noqa: BLE001 - see report_latency
        pass


def _send(batch: list[float]) -> None:
    global _latency_dropped
    try:
        payload = encode_latency(os.environ.get(paths.ENV_CLIENT_ID, ""), batch)
        _socket().sendto(payload, latency_socket_path())
    except OSError:
        _latency_dropped += len(batch)


atexit.register(flush_latency)


def latency_reports_dropped() -> int:
    """How many reports this process dropped (daemon down, queue full, bad value)."""
    return _latency_dropped
