"""sd_notify in pure Python: readiness, status, watchdog (``sd_notify(3)``).

One datagram of newline-separated ``KEY=VALUE`` lines to the ``AF_UNIX``/``SOCK_DGRAM`` socket in
``$NOTIFY_SOCKET`` (a leading ``@`` names the abstract namespace). Without that variable the daemon
was not started by systemd as ``Type=notify`` and every call is a no-op that returns ``False``.

Children must not inherit the notify variables (a workload could otherwise tell systemd the daemon is
ready, or ping its watchdog): :func:`clean_env` gives the environment for every spawned process.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)

NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")

# One unbound datagram socket per process, reused by every call (the address goes with each
# datagram): a socket made and closed per call was most of a watchdog ping's cost. A forked child
# makes its own (the kernel stamps the sender's pid on each datagram anyway).
_lock = threading.Lock()
_sock: socket.socket | None = None
_sock_pid = 0


def _socket() -> socket.socket:
    global _sock, _sock_pid
    with _lock:
        if _sock is None or _sock_pid != os.getpid():
            _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            _sock_pid = os.getpid()
        return _sock


def _drop(sock: socket.socket) -> None:
    """Forget a socket a send failed on: the next call makes a fresh one."""
    global _sock
    with _lock:
        if _sock is sock:
            _sock = None
    sock.close()


def notify(*fields: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``KEY=VALUE`` fields to systemd in one datagram.

    Example: ``notify("READY=1", "STATUS=2 GPUs, MPS up")``.

    Args:
        fields: ``KEY=VALUE`` strings, each one line.
        env: where to find ``NOTIFY_SOCKET`` (default ``os.environ``).

    Returns:
        True when the datagram was sent; False when there is no systemd socket (unset, or a
        ``vsock:`` address, which is not supported) or sending failed (logged).

    Raises:
        ValueError: a field is not ``KEY=VALUE`` or spans more than one line.
    """
    for field in fields:
        key, sep, _value = field.partition("=")
        if not sep or not key or "\n" in field:
            raise ValueError(
                f"bad sd_notify field {field!r}: use one line of KEY=VALUE (e.g. 'STATUS=ok')"
            )
    target = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if target.startswith("@"):
        address = "\0" + target[1:]
    elif target.startswith("/"):
        address = target
    else:
        return False
    try:
        sock = _socket()
    except OSError as exc:
        log.warning("sd_notify_failed", socket=target, error=str(exc))
        return False
    try:
        sock.sendto("\n".join(fields).encode(), address)
    except OSError as exc:
        _drop(sock)
        log.warning("sd_notify_failed", socket=target, error=str(exc))
        return False
    return True


def status_field(text: str) -> str:
    """``STATUS=<text>`` made safe for :func:`notify`: one line, control characters as spaces.

    Example: ``notify("READY=1", status_field(summary))``.
    """
    line = "".join(ch if ch.isprintable() else " " for ch in text)
    return "STATUS=" + " ".join(line.split())


def watchdog_period_s(env: Mapping[str, str] | None = None) -> float | None:
    """Half of ``WatchdogSec=`` when systemd's watchdog is meant for this process, else ``None``.

    The watchdog is ours when ``WATCHDOG_USEC`` is a positive integer and ``WATCHDOG_PID`` is
    absent or equals our pid.

    Args:
        env: where to read the variables (default ``os.environ``).
    """
    source = os.environ if env is None else env
    usec, pid = source.get("WATCHDOG_USEC", ""), source.get("WATCHDOG_PID", "")
    try:
        period_us = int(usec)
        if pid and int(pid) != os.getpid():
            return None
    except ValueError:
        return None
    return period_us / 2e6 if period_us > 0 else None


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) without systemd's notify and watchdog variables."""
    source = os.environ if env is None else env
    return {key: value for key, value in source.items() if key not in NOTIFY_VARS}
