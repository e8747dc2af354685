"""One request on the API socket: who sent it, and which handler answers it.

:class:`Dispatcher` turns one newline-framed request into one response: ``hello`` (the version
handshake, answered here) first, then only the methods of the table the daemon passes in. Every
failure inside a request becomes an error response; nothing a request does can stop the server.
The server (:mod:`gpushare.daemon.server`) runs :meth:`Dispatcher.handle` on its worker threads.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True, slots=True)
class Encoded:
    """A handler's result already encoded, sent as it is (:func:`encoded`).

    An answer shared by many callers (``status``, ``list``) is encoded once per viewer instead of
    once per request: with 48 callers polling, encoding was most of the daemon's time per request.
    """

    json: bytes
    """The result as :func:`gpushare.protocol.encode` writes it (compact, no newline)."""


def encoded(result: Any) -> Encoded:
    """``result`` encoded as :func:`gpushare.protocol.encode` encodes a result."""
    return Encoded(json.dumps(result, separators=(",", ":"), allow_nan=False).encode())


def response_line(req_id: Any, result: Any) -> bytes:
    """The success response to ``req_id``, framed: what ``encode(ok_response(...))`` gives."""
    if isinstance(result, Encoded):
        head = json.dumps({"id": req_id}, separators=(",", ":")).encode()[:-1]
        return head + b',"result":' + result.json + b"}\n"
    return protocol.encode(protocol.ok_response(req_id, result))


def peer_credentials(conn: socket.socket) -> Caller:
    """The pid, uid, gid and supplementary groups of a connected Unix socket's peer."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups: tuple[int, ...] = ()
    with contextlib.suppress(OSError):
        buf = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, 4 * 1024)
        groups = struct.unpack(f"{len(buf) // 4}I", buf[: len(buf) // 4 * 4])
    return Caller(pid=pid, uid=uid, gid=gid, groups=groups)


class Dispatcher:
    """Answers requests through the explicit ``methods`` table; ``hello`` is answered here."""

    def __init__(self, methods: Mapping[str, Handler], daemon_version: str) -> None:
        self._methods = dict(methods)
        self._daemon_version = daemon_version

    def handle(self, line: bytes, caller: Caller, greeted: bool) -> tuple[bytes, bool]:
        """The encoded response to one request line, and whether the connection said hello.

        Raises:
            ValueError: the handler's result cannot be encoded (the server answers INTERNAL).
        """
        req_id: Any = None
        try:
            req_id, method, params = protocol.decode_request(line)
            result, greeted = self._dispatch(method, params, caller, greeted)
        except protocol.ProtocolError as exc:
            return protocol.encode(protocol.error_response(req_id, exc.code, exc.message)), greeted
        except Exception as exc:  # a bug in a handler must not take the connection down
            log.exception("api_handler_failed", error=str(exc))
            response = protocol.error_response(
                req_id, protocol.ErrorCode.INTERNAL, f"internal error: {exc}"
            )
            return protocol.encode(response), greeted
        return response_line(req_id, result), greeted

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
