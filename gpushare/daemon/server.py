"""The API server: a Unix stream socket speaking :mod:`gpushare.protocol`, shared fairly.

The kernel vouches for every caller (SO_PEERCRED, SO_PEERGROUPS); handlers get that identity and
decide rights themselves. Dispatch is only through the explicit ``methods`` table the daemon passes
in. Every failure inside a request becomes an error response on that connection; nothing a client
sends can stop the server or touch another connection.

Every local user may connect, so no user may take the socket from the others
(docs/security.md, "Fair use of the API socket"):

- one thread (``api-io``) reads and writes every connection through a selector, and a fixed pool
  of ``daemon.api_workers`` threads runs the handlers: an idle connection costs a file descriptor
  and a few hundred bytes, never a thread;
- each uid may hold ``daemon.max_connections_per_uid`` connections and run
  ``daemon.max_inflight_per_uid`` requests at once; past ``daemon.max_connections`` in all, and in
  the last ``daemon.admin_reserve_workers`` workers, only root and the admin group are served;
- a connection idle for ``daemon.idle_timeout`` is closed, and so is one that starts a request and
  does not finish sending it (or does not read its answer) within ``daemon.request_timeout``;
- a request longer than ``daemon.max_request`` gets an error and the connection is closed;
- running out of file descriptors (EMFILE, ENFILE) stops accepting for a growing backoff, with
  one warning per minute at most, and accepting resumes by itself.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import queue
import selectors
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog

from gpushare import protocol
from gpushare.daemon.dispatch import Caller, Dispatcher, Handler, peer_credentials
from gpushare.daemon.limits import Limits, server_limits

log = structlog.get_logger(__name__)

__all__ = [
    "ApiServer", "Caller", "Handler", "Limits", "ServerError", "peer_credentials", "server_limits"
]  # fmt: skip

_ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_ACCEPT_BACKOFF_S = (0.05, 2.0)  # first and longest pause of accepting after EMFILE
_WARN_EVERY_S = 60.0  # one warning per minute at most, for each kind of trouble
_SWEEP_EVERY_S = 0.25  # how often timeouts are checked; their resolution
_READ_CHUNK = 65536


class ServerError(Exception):
    """The socket cannot be set up (another daemon holds it, bad group, bad directory)."""


@dataclass(slots=True, eq=False)
class _Conn:
    """One connection's buffers and timers; touched by the I/O thread only (so mutable)."""

    sock: socket.socket
    caller: Caller
    privileged: bool
    last_active: float
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    greeted: bool = False
    busy: bool = False  # a request of it waits for or runs on a worker: reading stops
    closing: bool = False  # hang up once the answer is out
    closed: bool = False
    mask: int = 0  # the selector events it is registered for
    partial_since: float | None = None  # a request is started and not finished
    write_since: float | None = None  # an answer waits for the client to read it


class _RateLimitedWarning:
    """A warning logged when trouble starts and then at most once per ``_WARN_EVERY_S``."""

    def __init__(self, event: str) -> None:
        self.event = event
        self.count = 0
        self._last = -_WARN_EVERY_S

    def hit(self, now: float, **fields: Any) -> None:
        self.count += 1
        if now - self._last >= _WARN_EVERY_S:
            self._last = now
            log.warning(self.event, times=self.count, **fields)


class ApiServer:
    """Accepts connections on ``path`` and serves requests through ``methods``.

    Args:
        privileged: whether a caller is root or in the admin group (the reserves are theirs);
            called once per accepted connection on the I/O thread, so it must be cheap.
    """

    def __init__(
        self,
        path: Path,
        methods: Mapping[str, Handler],
        *,
        max_request_bytes: int,
        mode: int = 0o666,
        group: str = "",
        daemon_version: str = "",
        limits: Limits | None = None,
        privileged: Callable[[Caller], bool] = lambda c: c.uid == 0,
    ) -> None:
        self.path = path
        self._dispatcher = Dispatcher(methods, daemon_version)
        self._max_request_bytes = max_request_bytes
        self._mode = mode
        self._group = group
        self.limits = limits or Limits()
        self._privileged = privileged
        self._sock: socket.socket | None = None
        self._sel: selectors.BaseSelector | None = None
        self._wake_r, self._wake_w = -1, -1
        self._running = threading.Event()
        self._thread: threading.Thread | None = None
        self._io_error: str | None = None
        # Daemon threads, not an executor's: a handler stuck at exit must not outlive SIGTERM.
        self._jobs: queue.SimpleQueue[tuple[_Conn, bytes, bool] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._done: deque[tuple[_Conn, bytes, bool]] = deque()  # worker -> I/O thread
        # I/O thread state.
        self._conns: set[_Conn] = set()
        self._per_uid: Counter[int] = Counter()
        self._inflight_uid: Counter[int] = Counter()
        self._inflight = self._inflight_unprivileged = 0
        self._pending: dict[int, deque[tuple[_Conn, bytes]]] = {}
        self._accept_paused_until: float | None = None
        self._accept_backoff_s = _ACCEPT_BACKOFF_S[0]
        self._accept_failing_since: float | None = None
        self._accept_warning = _RateLimitedWarning("api_accept_failed")
        self._refused_warning = _RateLimitedWarning("api_connections_refused")

    # ----------------------------------------------------------------------------- set-up

    def start(self) -> None:
        """Bind the socket, set its mode and group, and start serving.

        Raises:
            ServerError: the path is held by a live daemon, its directory cannot be created, or
                the group does not exist.
        """
        gid = -1
        if self._group:
            try:
                gid = grp.getgrnam(self._group).gr_gid
            except KeyError:
                raise ServerError(
                    f"daemon.socket_group {self._group!r} does not exist; create it or set "
                    '`socket_group = ""`'
                ) from None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ServerError(
                f"cannot create {self.path.parent} for the socket: {exc.strerror or exc}; "
                "create it or set paths.socket"
            ) from exc
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(str(self.path))
            os.chmod(self.path, self._mode)
            if gid >= 0:
                os.chown(self.path, -1, gid)
            sock.listen(1024)
        except OSError as exc:
            sock.close()
            raise ServerError(f"cannot listen on {self.path}: {exc.strerror or exc}") from exc
        sock.setblocking(False)
        self._sock = sock
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel = selectors.DefaultSelector()
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._workers = [
            threading.Thread(target=self._worker, name=f"api-worker-{i}", daemon=True)
            for i in range(self.limits.api_workers)
        ]
        for worker in self._workers:
            worker.start()
        self._running.set()
        self._thread = threading.Thread(target=self._io_loop, name="api-io", daemon=True)
        self._thread.start()
        log.info("api_listening", socket=str(self.path), workers=self.limits.api_workers)

    def _remove_stale(self) -> None:
        if not self.path.exists() and not self.path.is_symlink():
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(self.path))
        except OSError:
            self.path.unlink()  # nobody answers: a leftover of a daemon that died
            return
        finally:
            probe.close()
        raise ServerError(f"another gpushare daemon is serving {self.path}; stop it first")

    def health(self) -> tuple[bool, int, str | None]:
        """The I/O thread's ``(alive, restarts, last_error)``.

        It is not restarted (it owns every connection): a dead one is a FAIL in ``doctor`` and a
        daemon to restart.
        """
        alive = self._thread is not None and self._thread.is_alive()
        return alive, 0, self._io_error

    def close(self) -> None:
        """Stop accepting, close every connection and remove the socket file."""
        if not self._running.is_set():
            return
        self._running.clear()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        for _ in self._workers:
            self._jobs.put(None)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def set_limits(self, limits: Limits) -> None:
        """New limits (a reload): for the next connection and request; the pool keeps its size."""
        self.limits = replace(limits, api_workers=self.limits.api_workers)

    # ----------------------------------------------------------------------------- I/O thread

    def _io_loop(self) -> None:
        assert self._sel is not None
        next_sweep = time.monotonic()
        try:
            while self._running.is_set():
                now = time.monotonic()
                timeout = max(0.0, next_sweep - now)
                if self._accept_paused_until is not None:
                    timeout = min(timeout, max(0.0, self._accept_paused_until - now))
                for key, mask in self._sel.select(timeout):
                    try:
                        self._on_event(key, mask)
                    except Exception as exc:  # noqa: BLE001 - one connection's bug, not all's
                        log.error("api_event_failed", error=type(exc).__name__)  # noqa: TRY400
                        if isinstance(key.data, _Conn):
                            self._drop(key.data)
                self._finish_done()
                now = time.monotonic()
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._resume_accepting()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + _SWEEP_EVERY_S
        except Exception as exc:  # a bug here must not leave the socket silently dead: say so
            self._io_error = type(exc).__name__
            log.exception("api_io_failed")
            raise
        finally:
            self._shut_down()

    def _on_event(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.fileobj is self._sock:
            self._accept_some()
        elif key.fileobj == self._wake_r:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
        else:
            conn: _Conn = key.data
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ and not conn.closed:
                self._read(conn)

    def _shut_down(self) -> None:
        assert self._sel is not None
        for conn in list(self._conns):
            self._drop(conn)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._sel.close()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    # ----------------------------------------------------------------------------- accepting

    def _accept_some(self) -> None:
        assert self._sock is not None
        for _ in range(64):  # then let the other connections have a turn
            try:
                sock, _addr = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno in _ACCEPT_ERRORS:
                    self._pause_accepting(exc)
                return
            if self._accept_failing_since is not None:
                # At the warning's level, so that whoever saw the warning sees its end.
                log.warning(
                    "api_accept_recovered",
                    failed=self._accept_warning.count,
                    after_s=round(time.monotonic() - self._accept_failing_since, 3),
                )
                self._accept_failing_since = None
                self._accept_warning.count = 0
                self._accept_backoff_s = _ACCEPT_BACKOFF_S[0]
            self._admit(sock)

    def _pause_accepting(self, exc: OSError) -> None:
        # The listening socket stays readable while the queue holds connections: without a pause
        # the loop would spin. Pending connections wait in the kernel's queue meanwhile.
        assert self._sel is not None
        now = time.monotonic()
        if self._accept_failing_since is None:
            self._accept_failing_since = now
        self._accept_warning.hit(
            now,
            error=exc.strerror or str(exc),
            open_connections=len(self._conns),
            hint="raise LimitNOFILE of gpushare.service or lower daemon.max_connections",
        )
        if self._sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(self._sock)
        self._accept_paused_until = now + self._accept_backoff_s
        self._accept_backoff_s = min(self._accept_backoff_s * 2, _ACCEPT_BACKOFF_S[1])

    def _resume_accepting(self) -> None:
        assert self._sel is not None
        self._accept_paused_until = None
        if self._sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.register(self._sock, selectors.EVENT_READ, None)

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            caller = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        lim = self.limits
        privileged = self._privileged(caller)
        total = len(self._conns)
        why = None
        if privileged:
            if total >= lim.max_connections + lim.admin_reserve_connections:
                why = "the daemon's connections are all taken, its reserve too; retry"
        elif self._per_uid[caller.uid] >= lim.max_connections_per_uid:
            why = (
                f"too many connections from uid {caller.uid} "
                f"(daemon.max_connections_per_uid = {lim.max_connections_per_uid}); close some"
            )
        elif total >= lim.max_connections:
            why = f"too many connections (daemon.max_connections = {lim.max_connections}); retry"
        if why is not None:
            self._refused_warning.hit(time.monotonic(), uid=caller.uid, reason=why)
            reply = protocol.encode(protocol.error_response(None, protocol.ErrorCode.BUSY, why))
            with contextlib.suppress(OSError):
                sock.send(reply)  # best effort: the buffer of a fresh socket takes it
            sock.close()
            return
        conn = _Conn(sock, caller, privileged, time.monotonic())
        self._conns.add(conn)
        self._per_uid[caller.uid] += 1
        self._set_interest(conn)

    # ----------------------------------------------------------------------------- reading

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(_READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            self._drop(conn)
            return
        if not chunk:
            # The peer is done sending; answer what it already sent, then hang up.
            conn.closing = True
            self._next_request(conn)
            if not conn.busy and not conn.outbuf:
                self._drop(conn)
            else:
                self._set_interest(conn)
            return
        conn.inbuf += chunk
        conn.last_active = time.monotonic()
        self._next_request(conn)

    def _next_request(self, conn: _Conn) -> None:
        """Hand the next whole request of ``conn`` to the workers, if any.

        One at a time, and only once the last answer is out: a client that sends and never
        reads stalls itself (and is dropped after ``request_timeout``), never the daemon's memory.
        """
        while not conn.busy and not conn.closed and not conn.outbuf:
            end = conn.inbuf.find(b"\n")
            if end < 0:
                if len(conn.inbuf) > self._max_request_bytes:
                    self._refuse_too_large(conn)
                elif conn.inbuf and conn.partial_since is None:
                    conn.partial_since = time.monotonic()
                elif not conn.inbuf:
                    conn.partial_since = None
                break
            line = bytes(conn.inbuf[:end])
            del conn.inbuf[: end + 1]
            conn.partial_since = None
            if len(line) > self._max_request_bytes:
                self._refuse_too_large(conn)
                break
            if not line.strip():
                continue
            conn.busy = True
            self._pending.setdefault(conn.caller.uid, deque()).append((conn, line))
            self._pump()
        self._set_interest(conn)

    def _refuse_too_large(self, conn: _Conn) -> None:
        # The stream is out of step after an oversized message: answer, then hang up.
        message = (
            f"message larger than {self._max_request_bytes} bytes (daemon.max_request); send less"
        )
        response = protocol.error_response(None, protocol.ErrorCode.TOO_LARGE, message)
        conn.inbuf.clear()
        conn.partial_since = None
        conn.closing = True
        conn.outbuf += protocol.encode(response)
        self._flush(conn)

    # ----------------------------------------------------------------------------- workers

    def _may_run(self, conn: _Conn) -> bool:
        lim = self.limits
        if self._inflight >= lim.api_workers:
            return False
        if conn.privileged:
            return True
        return (
            self._inflight_uid[conn.caller.uid] < lim.max_inflight_per_uid
            and self._inflight_unprivileged < lim.api_workers - lim.admin_reserve_workers
        )

    def _pump(self) -> None:
        """Start waiting requests on free workers: one per uid in turn, within each uid's limit."""
        progress = True
        while progress:
            progress = False
            for uid in list(self._pending):
                queue = self._pending[uid]
                while queue and queue[0][0].closed:
                    queue.popleft()
                if queue and self._may_run(queue[0][0]):
                    conn, line = queue.popleft()
                    self._inflight += 1
                    self._inflight_uid[uid] += 1
                    if not conn.privileged:
                        self._inflight_unprivileged += 1
                    self._jobs.put((conn, line, conn.greeted))
                    progress = True
                if not queue:
                    del self._pending[uid]

    def _worker(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._work(*job)

    def _work(self, conn: _Conn, line: bytes, greeted: bool) -> None:
        """On a worker: run one request and hand its encoded answer to the I/O thread."""
        try:
            data, greeted = self._dispatcher.handle(line, conn.caller, greeted)
        except Exception as exc:  # noqa: BLE001 - an odd result must not cost the worker slot
            log.error("api_response_failed", error=type(exc).__name__)  # noqa: TRY400 - no locals
            data = protocol.encode(
                protocol.error_response(None, protocol.ErrorCode.INTERNAL, "internal error")
            )
        self._done.append((conn, data, greeted))
        self._wake()

    def _finish_done(self) -> None:
        while self._done:
            conn, data, greeted = self._done.popleft()
            uid = conn.caller.uid
            self._inflight -= 1
            self._inflight_uid[uid] -= 1
            if self._inflight_uid[uid] <= 0:
                del self._inflight_uid[uid]
            if not conn.privileged:
                self._inflight_unprivileged -= 1
            if conn.closed:
                continue
            conn.busy = False
            conn.greeted = greeted
            conn.last_active = time.monotonic()
            conn.outbuf += data
            self._flush(conn)
        self._pump()

    # ----------------------------------------------------------------------------- writing

    def _flush(self, conn: _Conn) -> None:
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except BlockingIOError:
                break
            except OSError:
                self._drop(conn)
                return
            del conn.outbuf[:sent]
        if conn.outbuf:
            if conn.write_since is None:
                conn.write_since = time.monotonic()
            self._set_interest(conn)
            return
        conn.write_since = None
        # The next pipelined request: a client that sent several and then shut its side down
        # gets every answer before the hang-up.
        self._next_request(conn)
        if conn.closing and not conn.busy and not conn.outbuf:
            self._drop(conn)

    def _set_interest(self, conn: _Conn) -> None:
        assert self._sel is not None
        if conn.closed:
            return
        mask = 0
        if not conn.busy and not conn.closing and not conn.outbuf:
            mask |= selectors.EVENT_READ
        if conn.outbuf:
            mask |= selectors.EVENT_WRITE
        if mask == conn.mask:
            return
        if conn.mask == 0:
            self._sel.register(conn.sock, mask, conn)
        elif mask == 0:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, mask, conn)
        conn.mask = mask

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.mask and self._sel is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(conn.sock)
        conn.mask = 0
        conn.sock.close()
        self._conns.discard(conn)
        self._per_uid[conn.caller.uid] -= 1
        if self._per_uid[conn.caller.uid] <= 0:
            del self._per_uid[conn.caller.uid]

    def _sweep(self, now: float) -> None:
        """Close connections that idle too long, or stall in the middle of a request or answer."""
        lim = self.limits
        for conn in list(self._conns):
            if conn.busy:
                continue
            stalled = (
                conn.partial_since is not None and now - conn.partial_since > lim.request_timeout_s
            ) or (conn.write_since is not None and now - conn.write_since > lim.request_timeout_s)
            idle = (
                not conn.inbuf and not conn.outbuf and now - conn.last_active > lim.idle_timeout_s
            )
            if stalled or idle:
                self._drop(conn)
