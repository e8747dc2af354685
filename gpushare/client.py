"""Talking to the gpushare daemon from other processes.

Sections of this module:

* the **API socket client** (:class:`ApiClient`): connect to the daemon's Unix socket, say
  ``hello`` (refusing another API version), then one JSON request per line,
* **app-reported latency**: :func:`report_latency`, which a latency-critical service calls once
  per request, and an LLM server's :func:`report_ttft` and :func:`report_tpot`. Their daemon side
  is :mod:`gpushare.latency`, and
* **request boundaries** (at the end): :func:`request_started`, :func:`request_ended` and the
  context manager :func:`request`, for request gating (its daemon side is
  :mod:`gpushare.latency.inflight` and :mod:`gpushare.control.gate`).
"""

from __future__ import annotations

import atexit
import json
import math
import os
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from gpushare import paths, protocol

# =====================================================================================
# The API socket client: the CLI and scripts call the daemon through ApiClient.
# =====================================================================================

# Responses can be larger than requests (status of a busy node, a page of events).
_MAX_RESPONSE_BYTES = 64 << 20


class DaemonUnreachableError(Exception):
    """The socket is missing or refuses connections: the daemon is not running there."""

    #: The CLI's exit status for this failure (gpushare.cli.exitcodes).
    exit_code = protocol.EXIT_UNREACHABLE

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(
            f"cannot reach gpushare at {path}: is gpushare.service running? "
            "(systemctl status gpushare)"
        )


class DaemonAccessError(DaemonUnreachableError):
    """The socket exists but this user may not connect to it (its mode or group)."""

    exit_code = protocol.EXIT_PERMISSION_DENIED

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(path, reason)
        self.args = (
            f"permission denied on {path}: this user may not connect to gpushare's socket; "
            'ask an admin to set [daemon] socket_mode = "0666" in the config (or to add '
            "you to the socket's group) and restart gpushare",
        )


class ApiError(Exception):
    """The daemon answered a request with an error."""

    def __init__(self, code: protocol.ErrorCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(message)


def socket_path(explicit: str | Path | None = None) -> Path:
    """The API socket: ``explicit``, else ``$GPUSHARE_SOCKET``, else the config's, else the default."""
    if explicit:
        return Path(explicit)
    env = os.environ.get(paths.ENV_SOCKET)
    if env:
        return Path(env)
    config_file = paths.default_config_file()
    if config_file.exists():
        # Imported here so scripts that only report latency never pay for the config module.
        from gpushare import config

        try:
            return config.load(config_file).paths.resolved("socket")
        except config.ConfigError:
            pass
    return paths.RUNTIME_DIR / paths.SOCKET_NAME


class ApiClient:
    """One connection to the daemon, after a successful ``hello``."""

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self._sock = sock
        self.path = path
        self._reader = protocol.LineReader(sock, _MAX_RESPONSE_BYTES)
        self._next_id = 1
        self.hello: dict[str, Any] = {}

    @classmethod
    def connect(
        cls, path: str | Path | None = None, *, timeout_s: float | None = 30.0, name: str = "cli"
    ) -> ApiClient:
        """Connect and say hello.

        Raises:
            DaemonUnreachableError: no socket, or nobody listening on it.
            ApiError: the daemon refused the hello (another API version).
        """
        target = socket_path(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(target))
        except PermissionError as exc:
            sock.close()
            raise DaemonAccessError(target, str(exc)) from None
        except (OSError, ValueError) as exc:
            # Missing, refused, not a socket, a path too long for AF_UNIX, a daemon that does not
            # accept in time: all mean that gpushare cannot be reached there.
            sock.close()
            raise DaemonUnreachableError(target, str(exc)) from None
        client = cls(sock, target)
        try:
            client.hello = client.call(
                protocol.HELLO, {"api_version": protocol.API_VERSION, "client": name}
            )
        except BaseException:
            client.close()
            raise
        theirs = client.hello.get("api_version") if isinstance(client.hello, dict) else None
        if theirs != protocol.API_VERSION:
            client.close()
            raise ApiError(
                protocol.ErrorCode.VERSION_MISMATCH,
                f"the daemon at {target} speaks API version {theirs}, this CLI "
                f"{protocol.API_VERSION}; use the gpushare CLI installed with the daemon",
            )
        return client

    def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """Send one request and return its result.

        Raises:
            ApiError: the daemon answered with an error.
            DaemonUnreachableError: the daemon closed the connection.
        """
        req_id = self._next_id
        self._next_id += 1
        try:
            self._sock.sendall(
                protocol.encode({"id": req_id, "method": method, "params": params or {}})
            )
            line = self._reader.read_line()
        except OSError as exc:
            # Reset, closed, or no answer within the timeout (a hung or overloaded daemon).
            raise DaemonUnreachableError(self.path, str(exc)) from None
        if line is None:
            raise DaemonUnreachableError(self.path, "the daemon closed the connection")
        reply = json.loads(line)
        if "error" in reply:
            err = reply["error"]
            try:
                code = protocol.ErrorCode(err.get("code"))
            except ValueError:
                code = protocol.ErrorCode.INTERNAL
            raise ApiError(code, str(err.get("message", "")))
        return reply.get("result")

    def close(self) -> None:
        """Close the connection."""
        self._sock.close()

    def __enter__(self) -> ApiClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# =====================================================================================
# App-reported latency: services call report_latency(seconds) once per request.
# Wire format (UTF-8 JSON, one datagram per batch):
#     {"v": 1, "id": "<GPUSHARE_CLIENT_ID or empty>", "s": [<latency in seconds>, ...]}
# with, for an LLM server, "t": [<time to first token>, ...] and "p": [<time per output token>,
# ...] beside or instead of "s" (report_ttft, report_tpot); kinds without reports are left out.
# Reports are batched for up to FLUSH_INTERVAL_S or FLUSH_MAX_VALUES values, because the kernel
# queues only net.unix.max_dgram_qlen (default 10) datagrams per Unix socket: one datagram per
# request would be dropped at any real request rate. The daemon identifies the sender by the
# kernel-verified pid/uid (SCM_CREDENTIALS) and the id.
# =====================================================================================

LATENCY_WIRE_VERSION = 1
FLUSH_INTERVAL_S = 0.02
FLUSH_MAX_VALUES = 32

#: The datagram's keys: request latency, time to first token, time per output token.
_KEYS = ("s", "t", "p")

_latency_lock = threading.Lock()
_latency_sock: socket.socket | None = None
_latency_sock_pid: int | None = None
_latency_buffer: dict[str, list[float]] = {key: [] for key in _KEYS}
_latency_buffered = 0
_latency_last_flush_s = 0.0
_latency_dropped = 0


def latency_socket_path() -> str:
    """Where reports go: ``$GPUSHARE_LATENCY_SOCKET``, else the daemon's default runtime path."""
    return os.environ.get(paths.ENV_LATENCY_SOCKET) or str(
        paths.RUNTIME_DIR / paths.LATENCY_SOCKET_NAME
    )


def encode_latency(client_id: str, seconds: list[float]) -> bytes:
    """A batch of latency reports as the datagram :func:`report_latency` sends."""
    return encode_reports(client_id, {"s": seconds})


def encode_reports(client_id: str, batch: dict[str, list[float]]) -> bytes:
    """A batch of reports of every kind (``"s"``, ``"t"``, ``"p"``); empty kinds are left out."""
    msg: dict[str, Any] = {"v": LATENCY_WIRE_VERSION, "id": client_id}
    msg.update((key, values) for key, values in batch.items() if values)
    return json.dumps(msg, separators=(",", ":")).encode()


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
    _report("s", seconds)


def report_ttft(seconds: float) -> None:
    """Report one request's time to first token (an LLM server). Never blocks, never raises.

    Sent as :func:`report_latency` sends, batched with it; the daemon keeps the p99 over
    ``[latency] ttft_window`` against ``submit --slo-ttft-p99``.

    Args:
        seconds: from the request's arrival to its first output token.
    """
    _report("t", seconds)


def report_tpot(seconds: float) -> None:
    """Report a time per output token (an LLM server). Never blocks, never raises.

    Call it once per request with its mean, ``(latency - ttft) / (tokens - 1)``: the TPOT a TPOT
    SLO is scored on (vLLM's benchmark, TGI's per-request histogram). The daemon keeps the p99 of
    what is reported over ``[latency] tpot_window`` against ``submit --slo-tpot-p99``. Once per
    further token with the gap since the previous one (the inter-token latency) also works, with
    the SLO declared on that quantity, but its p99 jumps with any stall of the batch, so the
    controller holds offline work back far more for the same requests (docs/controller.md, "LLM
    servers").

    Args:
        seconds: a request's mean time per output token after its first.
    """
    _report("p", seconds)


def _report(key: str, seconds: float) -> None:
    global _latency_dropped, _latency_last_flush_s, _latency_buffer, _latency_buffered
    try:
        value = float(seconds)
        if not math.isfinite(value) or value < 0:
            _latency_dropped += 1
            return
        now = time.monotonic()
        with _latency_lock:
            _latency_buffer[key].append(value)
            _latency_buffered += 1
            if (
                _latency_buffered < FLUSH_MAX_VALUES
                and now - _latency_last_flush_s < FLUSH_INTERVAL_S
            ):
                return
            batch = _take_batch(now)
        _send(batch)
    except Exception:  # noqa: BLE001 - a service must never fail because gpushare is absent
        _latency_dropped += 1


def _take_batch(now: float) -> dict[str, list[float]]:
    """Empty the buffer (the caller holds ``_latency_lock``)."""
    global _latency_buffer, _latency_buffered, _latency_last_flush_s
    batch, _latency_buffer = _latency_buffer, {key: [] for key in _KEYS}
    _latency_buffered = 0
    _latency_last_flush_s = now
    return batch


def flush_latency() -> None:
    """Send reports still batched (also run at interpreter exit). Never blocks, never raises."""
    try:
        with _latency_lock:
            batch = _take_batch(time.monotonic())
        if any(batch.values()):
            _send(batch)
    except Exception:  # noqa: BLE001 - see report_latency
        pass


def _send(batch: dict[str, list[float]]) -> None:
    global _latency_dropped
    try:
        payload = encode_reports(os.environ.get(paths.ENV_CLIENT_ID, ""), batch)
        _socket().sendto(payload, latency_socket_path())
    except OSError:
        _latency_dropped += sum(len(values) for values in batch.values())


atexit.register(flush_latency)


def latency_reports_dropped() -> int:
    """How many reports this process dropped (daemon down, queue full, bad value)."""
    return _latency_dropped


# =====================================================================================
# Request boundaries: services call request_started() / request_ended() around each request
# (or use ``with request():``), so the daemon can freeze offline work on the GPU exactly while
# requests are in flight (request gating, docs/controller.md). Wire format, on the latency socket:
#     {"v": 1, "id": "<GPUSHARE_CLIENT_ID or empty>", "n": <requests in flight in this process>}
# A datagram goes out at once when the process's count leaves or reaches 0 (the edges gating acts
# on); changes in between go out at most every FLUSH_INTERVAL_S (for the count `status` shows),
# and while requests are in flight at least every INFLIGHT_REFRESH_S (a source silent for the
# daemon's [gate] inflight_timeout stops holding the gate). The daemon credits the datagram to
# the sending pid (SCM_CREDENTIALS), so each process is its own source.
# =====================================================================================

INFLIGHT_REFRESH_S = 1.0

_inflight_lock = threading.Lock()
_inflight_pid: int | None = None
_inflight = 0
_inflight_sent_s = -math.inf
_inflight_sent_n = 0
_boundaries_dropped = 0


def encode_inflight(client_id: str, count: int) -> bytes:
    """The datagram :func:`request_started` and :func:`request_ended` send."""
    return json.dumps(
        {"v": LATENCY_WIRE_VERSION, "id": client_id, "n": count}, separators=(",", ":")
    ).encode()


def _boundary(delta: int) -> None:
    global _inflight, _inflight_pid, _inflight_sent_s, _inflight_sent_n, _boundaries_dropped
    pid = os.getpid()
    with _inflight_lock:
        if _inflight_pid != pid:
            # A forked child's requests are its own: it starts from none in flight.
            _inflight_pid, _inflight, _inflight_sent_s, _inflight_sent_n = pid, 0, -math.inf, 0
        if delta < 0 and _inflight == 0:
            _boundaries_dropped += 1  # an end without a start: nothing to tell the daemon
            return
        _inflight += delta
        now = time.monotonic()
        edge = (_inflight == 0) != (_inflight_sent_n == 0)
        due = now - _inflight_sent_s >= (
            FLUSH_INTERVAL_S if _inflight != _inflight_sent_n else INFLIGHT_REFRESH_S
        )
        if not (edge or due):
            return
        # Sent under the lock: datagrams from one process then reach the daemon in count order.
        try:
            payload = encode_inflight(os.environ.get(paths.ENV_CLIENT_ID, ""), _inflight)
            _socket().sendto(payload, latency_socket_path())
        except OSError:
            _boundaries_dropped += 1
            return
        _inflight_sent_s, _inflight_sent_n = now, _inflight


def request_started() -> None:
    """Tell the gpushare daemon a request started in this process. Never blocks, never raises.

    While any request is in flight, the daemon may freeze the GPU's offline work (request gating,
    when the controller has it on for the GPU). Pair every call with :func:`request_ended`, or use
    :func:`request`. When the daemon is down or its queue is full, the boundary is dropped
    silently (see :func:`request_boundaries_dropped`).
    """
    try:
        _boundary(+1)
    except Exception:  # noqa: BLE001 - a service must never fail because gpushare is absent
        global _boundaries_dropped
        _boundaries_dropped += 1


def request_ended() -> None:
    """Tell the gpushare daemon a request of this process ended. Never blocks, never raises.

    An end without a start is ignored (counted in :func:`request_boundaries_dropped`).
    """
    try:
        _boundary(-1)
    except Exception:  # noqa: BLE001 - see request_started
        global _boundaries_dropped
        _boundaries_dropped += 1


class request:  # noqa: N801 - used as ``with gpushare.client.request():``, like a function
    """Context manager around one request.

    Calls :func:`request_started` on entry and :func:`request_ended` on exit (also when the body
    raises).

    Args:
        report: also :func:`report_latency` the time the body took.
    """

    __slots__ = ("_report", "_t0")

    def __init__(self, *, report: bool = False) -> None:
        self._report = report
        self._t0 = 0.0

    def __enter__(self) -> request:
        self._t0 = time.monotonic()
        request_started()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        request_ended()
        if self._report:
            report_latency(time.monotonic() - self._t0)


def requests_in_flight() -> int:
    """Requests this process has started and not yet ended."""
    return _inflight if _inflight_pid == os.getpid() else 0


def request_boundaries_dropped() -> int:
    """How many boundaries this process dropped (daemon down, queue full, end without start)."""
    return _boundaries_dropped
