"""The API server: a Unix stream socket speaking :mod:`gpushare.protocol`, one thread per connection.

The kernel vouches for every caller (SO_PEERCRED, SO_PEERGROUPS); handlers get that identity and
decide rights themselves. Dispatch is only through the explicit ``methods`` table the daemon passes
in. Every failure inside a request becomes an error response on that connection; nothing a client
sends can stop the server or touch another connection.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import socket
import struct
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from gpushare import protocol

log = structlog.get_logger(__name__)

_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is on the other end of a connection, as the kernel reports it."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


Handler = Callable[[Caller, dict[str, Any]], Any]


class ServerError(Exception):
    """The socket cannot be set up (another daemon holds it, bad group, bad directory)."""


def peer_credentials(conn: socket.socket) -> Caller:
    """The pid, uid, gid and supplementary groups of a connected Unix socket's peer."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: tuple[int, ...] = ()
    with contextlib.suppress(OSError):
        buf = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        groups = struct.unpack(f"{len(buf) // 4}I", buf[: len(buf) // 4 * 4])
    return Caller(pid=pid, uid=uid, gid=gid, groups=groups)


class ApiServer:
    """Accepts connections on ``path`` and serves requests through ``methods``."""

    def __init__(
        self,
        path: Path,
        methods: Mapping[str, Handler],
        *,
        max_request_bytes: int,
        mode: int = 0o666,
        group: str = "",
        daemon_version: str = "",
        max_connections: int = 1024,
    ) -> None:
        self.path = path
        self._methods = dict(methods)
        self._max_request_bytes = max_request_bytes
        self._mode = mode
        self._group = group
        self._daemon_version = daemon_version
        self._slots = threading.BoundedSemaphore(max_connections)
        self._sock: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._accepting = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind the socket, set its mode and group, and start accepting.

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
            sock.listen(256)
        except OSError as exc:
            sock.close()
            raise ServerError(f"cannot listen on {self.path}: {exc.strerror or exc}") from exc
        self._sock = sock
        self._accepting.set()
        self._thread = threading.Thread(target=self._accept_loop, name="api-accept", daemon=True)
        self._thread.start()
        log.info("api_listening", socket=str(self.path))

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

    def close(self) -> None:
        """Stop accepting, close every connection and remove the socket file."""
        self._accepting.clear()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        with self._conns_lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _accept_loop(self) -> None:
        while self._accepting.is_set() and self._sock is not None:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if not self._accepting.is_set():
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("api_accept_failed", error=str(exc))
                    threading.Event().wait(0.05)
                continue
            if not self._slots.acquire(blocking=False):
                with contextlib.suppress(OSError):
                    conn.sendall(
                        protocol.encode(
                            protocol.error_response(
                                None, protocol.ErrorCode.BUSY, "too many connections; retry"
                            )
                        )
                    )
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="api-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(conn)
        try:
            caller = peer_credentials(conn)
            self._serve_requests(conn, caller)
        except OSError:
            pass  # the peer went away; nothing to answer
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()
            self._slots.release()

    def _serve_requests(self, conn: socket.socket, caller: Caller) -> None:
        reader = protocol.LineReader(conn, self._max_request_bytes)
        greeted = False
        while self._accepting.is_set():
            try:
                line = reader.read_line()
            except protocol.ProtocolError as exc:
                # The stream is out of step after an oversized message: answer, then hang up.
                conn.sendall(protocol.encode(protocol.error_response(None, exc.code, exc.message)))
                return
            if line is None:
                return
            if not line.strip():
                continue
            response, greeted = self._handle(line, caller, greeted)
            conn.sendall(protocol.encode(response))

    def _handle(self, line: bytes, caller: Caller, greeted: bool) -> tuple[dict[str, Any], bool]:
        req_id: Any = None
        try:
            req_id, method, params = protocol.decode_request(line)
            result, greeted = self._dispatch(method, params, caller, greeted)
            return protocol.ok_response(req_id, result), greeted
        except protocol.ProtocolError as exc:
            return protocol.error_response(req_id, exc.code, exc.message), greeted
        except Exception as exc:  # a bug in a handler must not take the connection down
            log.exception("api_handler_failed", error=str(exc))
            response = protocol.error_response(
                req_id, protocol.ErrorCode.INTERNAL, f"internal error: {exc}"
            )
            return response, greeted

    def _dispatch(
        self, method: str, params: dict[str, Any], caller: Caller, greeted: bool
    ) -> tuple[Any, bool]:
        if method == protocol.HELLO:
            hello = protocol.from_params(protocol.HelloRequest, params)
            if hello.api_version != protocol.API_VERSION:
                raise protocol.ProtocolError(
                    protocol.ErrorCode.VERSION_MISMATCH,
                    f"the daemon speaks API version {protocol.API_VERSION}, the client "
                    f"{hello.api_version}; use a gpushare CLI of the daemon's version",
                )
            result = protocol.HelloResult(
                api_version=protocol.API_VERSION,
                daemon_version=self._daemon_version,
                uid=caller.uid,
                gid=caller.gid,
                pid=caller.pid,
            )
            return protocol.as_dict(result), True
        if not greeted:
            raise protocol.ProtocolError(
                protocol.ErrorCode.HELLO_REQUIRED, "send hello with api_version first"
            )
        handler = self._methods.get(method)
        if handler is None:
            known = ", ".join(sorted({protocol.HELLO, *self._methods}))
            raise protocol.ProtocolError(
                protocol.ErrorCode.UNKNOWN_METHOD, f"unknown method {method!r}; known: {known}"
            )
        return handler(caller, params), greeted
