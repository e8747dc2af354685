"""The latency socket: :class:`LatencyReceiver` reads datagrams and credits them to clients.

The socket is ``SOCK_DGRAM`` Unix with ``SO_PASSCRED`` on, so every datagram carries the sender's
kernel-verified pid/uid/gid (``SCM_CREDENTIALS``); an ``identify`` callback (the daemon's is
:func:`verified_identify`) maps the :class:`Sender` and the client id in the message to a client,
or rejects it. Accepted latencies go to a :class:`~gpushare.latency.p99.P99Tracker`; requests in
flight to request gating (``on_inflight``); an LLM server's token timings to
:class:`~gpushare.latency.p99.TokenTrackers` (``tokens``). :func:`renice_thread` lets this thread, and the gate's
timer, wake ahead of busy offline processes.

Every local user can write to the socket, so no datagram may stop the thread: parsing is bounded
(:mod:`gpushare.latency.datagrams`), a truncated (oversized) datagram is refused unread, every
datagram is handled inside its own ``try`` and a failure is counted by reason in
:attr:`LatencyReceiver.drops`; the thread itself is a supervised one
(:class:`gpushare.latency.threads.Supervisor`), restarted if it ever dies.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from gpushare.latency.datagrams import (
    MAX_DATAGRAM_BYTES,
    DatagramError,
    Message,
    decode_message,
)
from gpushare.latency.p99 import P99Tracker, TokenTrackers
from gpushare.latency.threads import SupervisedThread, Supervisor

log = structlog.get_logger(__name__)

_UCRED = array.array("i", [0, 0, 0])


@dataclass(frozen=True, slots=True)
class Sender:
    """Who sent a latency datagram: kernel-verified credentials plus the id the message claims."""

    pid: int | None
    uid: int | None
    gid: int | None
    claimed_id: str


def claimed_id(sender: Sender) -> str | None:
    """The default ``identify``: trust the id in the message (empty means unknown)."""
    return sender.claimed_id or None


def verified_identify(
    client_of_pid: Callable[[int], str | None], uid_of_client: Callable[[str], int | None]
) -> Callable[[Sender], str | None]:
    """An ``identify`` for the daemon: kernel-verified credentials first, the claimed id second.

    Args:
        client_of_pid: the client a pid belongs to (the daemon's registry and cgroups).
        uid_of_client: the uid a client runs as; ``None`` for an unknown client.

    Returns:
        A function crediting a report to the client owning the sending pid; failing that, to the
        claimed client if the sender runs as that client's uid (or as root). Anything else is
        rejected, so no process can report latency for another user's client.
    """

    def identify(sender: Sender) -> str | None:
        if sender.pid is not None:
            owner = client_of_pid(sender.pid)
            if owner is not None:
                return owner
        if not sender.claimed_id or sender.uid is None:
            return None
        uid = uid_of_client(sender.claimed_id)
        if uid is None:
            return None
        return sender.claimed_id if sender.uid in (uid, 0) else None

    return identify


class LatencyReceiver:
    """Receives latency datagrams on a Unix socket and feeds a :class:`P99Tracker`.

    Args:
        path: the socket path (``paths.latency_socket``); a stale socket there is replaced.
        tracker: where accepted reports go.
        identify: maps a :class:`Sender` to a client id, or ``None`` to reject. The daemon passes
            one that checks the kernel-verified pid/uid against its registry, so a process cannot
            report for another user's client.
        clock: monotonic clock used to stamp reports.
        mode: permissions of the socket file (services of every user report).
        on_inflight: called with ``(client_id, pid, count, now)`` for a request-boundary datagram
            (``gpushare.client.request_started``); returns ``None`` when accepted, else the reason
            it was rejected. Without it such datagrams are rejected ("gating not served here").
        allow: called with ``(pid, now)`` before a datagram is parsed; ``False`` rejects it
            unread (the daemon passes a per-sender rate limit, ``inflight.SenderLimiter``).
        reject: called with a reason for every rejected datagram (the daemon counts and logs them,
            ``inflight.Rejections``); the ``rejected`` counter counts them in any case.
        thread_nice: the receiving thread's nice value (:func:`renice_thread`), so a request
            start is read at once even when offline processes keep every CPU busy.
        thread_realtime: ``SCHED_FIFO`` for it instead, where allowed (:func:`renice_thread`).
        threads: the supervisor the receiving thread runs under (a private one by default).
        tokens: where an LLM server's TTFT and TPOT reports go; without it a datagram carrying
            them is rejected ("token timings not served here"), its other reports kept.
    """

    def __init__(
        self,
        path: Path | str,
        tracker: P99Tracker,
        *,
        identify: Callable[[Sender], str | None] = claimed_id,
        clock: Callable[[], float] = time.monotonic,
        mode: int = 0o666,
        on_inflight: Callable[[str, int | None, int, float], str | None] | None = None,
        allow: Callable[[int | None, float], bool] | None = None,
        reject: Callable[..., None] | None = None,
        thread_nice: int | None = None,
        thread_realtime: bool = False,
        threads: Supervisor | None = None,
        tokens: TokenTrackers | None = None,
    ) -> None:
        self.path = Path(path)
        self.tracker = tracker
        self.tokens = tokens
        self.identify = identify
        self._clock = clock
        self._mode = mode
        self._on_inflight = on_inflight
        self._allow = allow
        self._reject = reject
        self._thread_nice = thread_nice
        self._thread_realtime = thread_realtime
        self._threads = threads if threads is not None else Supervisor()
        self._sock: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: SupervisedThread | None = None
        self.accepted = 0  # reports (values), not datagrams
        self.rejected = 0  # datagrams
        #: Datagrams refused or failed, by reason (``"oversized"``, ``"malformed: not JSON"``,
        #: ``"malformed: nested too deep"``, ``"internal error"``, ...).
        self.drops: dict[str, int] = {}

    def start(self) -> None:
        """Bind the socket and start the receiving thread.

        Raises:
            OSError: the socket cannot be bound (the message names the path).
            FileExistsError: something that is not a socket occupies the path.
        """
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise FileExistsError(
                    f"{self.path} exists and is not a socket; remove it or set paths.latency_socket"
                )
            self.path.unlink()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(str(self.path))
            os.chmod(self.path, self._mode)
            # The timeout lets the thread notice close() without a wake-up datagram.
            sock.settimeout(0.2)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"cannot bind the latency socket {self.path}: {exc}") from exc
        self._sock = sock
        self._thread = self._threads.spawn("latency-receiver", self._run, self._stop)
        log.info("latency_socket_listening", path=str(self.path))

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        if self._thread_nice is not None:
            got = renice_thread(self._thread_nice, realtime=self._thread_realtime)
            log.info("latency_receiver_priority", priority=got)
        cmsg_space = socket.CMSG_SPACE(_UCRED.itemsize * 3)
        while not self._stop.is_set():
            try:
                data, ancdata, flags, _addr = sock.recvmsg(MAX_DATAGRAM_BYTES + 1, cmsg_space)
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise  # the supervisor logs it and starts the thread again
            self.receive(data, ancdata, flags)

    def receive(self, data: bytes, ancdata: Iterable[tuple[int, int, bytes]], flags: int) -> None:
        """Handle one received datagram; never raises (a failure is a counted drop)."""
        try:
            creds = _credentials(ancdata)
            if flags & socket.MSG_TRUNC or len(data) > MAX_DATAGRAM_BYTES:
                self._rejected("oversized", pid=creds[0] if creds else None)
                return
            self.handle(data, creds)
        except Exception:
            # A bug reached by one datagram costs that datagram, not the node's gating.
            self._rejected("internal error")
            log.exception("latency_datagram_failed")

    def handle(self, data: bytes, creds: tuple[int, int, int] | None) -> str | None:
        """Process one datagram; returns the client it was credited to, or ``None``."""
        pid, uid, gid = creds if creds is not None else (None, None, None)
        now = self._clock()
        if self._allow is not None and not self._allow(pid, now):
            self._rejected("flood: over the per-sender datagram rate", pid=pid)
            return None
        try:
            msg = decode_message(data)
        except DatagramError as exc:
            self._rejected("malformed datagram", drop=f"malformed: {exc.reason}", pid=pid)
            return None
        client = self.identify(Sender(pid=pid, uid=uid, gid=gid, claimed_id=msg.claimed_id))
        if client is None:
            self._rejected(
                "sender is not a client of gpushare", pid=pid, uid=uid, claimed=msg.claimed_id
            )
            return None
        for seconds in msg.latencies_s:
            self.tracker.add(client, seconds, now)
        self.accepted += len(msg.latencies_s)
        if (msg.ttft_s or msg.tpot_s) and not self._credit_tokens(client, msg, now):
            self._rejected("token timings not served here", client_id=client, pid=pid)
            if not msg.latencies_s and msg.inflight is None:
                return None
        if msg.inflight is not None:
            why = (
                "gating not served here"
                if self._on_inflight is None
                else self._on_inflight(client, pid, msg.inflight, now)
            )
            if why is not None:
                self._rejected(why, client_id=client, pid=pid)
                return client if msg.latencies_s else None
        return client

    def _credit_tokens(self, client: str, msg: Message, now: float) -> bool:
        """Credit TTFT and TPOT reports; ``False`` when no one keeps them here."""
        if self.tokens is None:
            return False
        self.tokens.ttft.add_many(client, ((now, s) for s in msg.ttft_s))
        self.tokens.tpot.add_many(client, ((now, s) for s in msg.tpot_s))
        self.accepted += len(msg.ttft_s) + len(msg.tpot_s)
        return True

    def _rejected(self, reason: str, *, drop: str | None = None, **context: object) -> None:
        self.rejected += 1
        key = drop or reason
        self.drops[key] = self.drops.get(key, 0) + 1
        if self._reject is not None:
            self._reject(reason, **context)
        log.debug("latency_datagram_rejected", reason=reason, **context)

    def close(self) -> None:
        """Stop the thread, close and remove the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s=2.0)
            self._threads.remove(self._thread)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def renice_thread(nice: int, *, realtime: bool = False) -> str:
    """Raise the calling thread's (not its process's) CPU priority; says what it got.

    With ``realtime``, ``SCHED_FIFO`` at the lowest real-time priority (1): the thread then runs
    as soon as it wakes, ahead of every normal task. Otherwise, or where that is refused, the
    nice value ``nice`` (Linux keeps one per thread). For threads that sleep in a receive or a
    timer and do little when they wake: ``bench/gating_latency.py`` measured a request start to
    the freeze written at a p99 of about 1 ms with 50 spinning offline processes on 2 CPUs under
    ``SCHED_FIFO``, and tens of ms to over 100 ms at nice -10 or 0 (the kernel's fair scheduler
    let the woken thread wait behind them).

    Returns:
        ``"SCHED_FIFO 1"``, ``"nice N"`` or ``"unchanged"`` (not root).
    """
    tid = threading.get_native_id()
    if realtime:
        try:
            os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(1))
        except OSError as exc:
            log.debug("realtime_thread_refused", error=str(exc))
        else:
            return "SCHED_FIFO 1"
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        log.debug("renice_thread_refused", nice=nice, error=str(exc))
        return "unchanged"
    return f"nice {nice}"


def _credentials(ancdata: Iterable[tuple[int, int, bytes]]) -> tuple[int, int, int] | None:
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            creds = array.array("i")
            creds.frombytes(payload[: _UCRED.itemsize * 3])
            pid, uid, gid = creds
            return pid, uid, gid
    return None
