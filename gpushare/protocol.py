"""The wire protocol between the daemon and its clients (the CLI, scripts, services).

Transport: a Unix stream socket carrying newline-delimited JSON, one request and one response per
line. Every connection starts with ``hello``, which carries :data:`API_VERSION`; the client refuses
a daemon that answers with another version. A request is::

    {"id": 1, "method": "status", "params": {...}}

and its response is either ``{"id": 1, "result": {...}}`` or
``{"id": 1, "error": {"code": <ErrorCode>, "message": "..."}}``. Messages are bounded in size
(``daemon.max_request_bytes``); a malformed or oversized message gets an error response and never
disturbs the daemon or another connection.

This module imports nothing of gpushare's own, so any tool can speak the protocol with it alone.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import types
import typing
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, TypeVar

from gpushare.model import DEFAULT_OFFLINE_QUEUE as DEFAULT_OFFLINE_QUEUE

# submit --queue's values and its default live with the data model (control/ reads them too).
from gpushare.model import DEFAULT_QUEUE_MODE as DEFAULT_QUEUE_MODE
from gpushare.model import QUEUE_MODES as QUEUE_MODES

API_VERSION = 1
"""Bumped on any incompatible change to a method, its parameters or its result."""

STATUS_SCHEMA_VERSION = 2
LIST_SCHEMA_VERSION = 1
"""``gpushare list --json``: ``{"schema_version": 1, "clients": [...]}`` (docs/status-schema.md)."""
EVENTS_SCHEMA_VERSION = 1
"""``gpushare events --json``: one event per line, each with ``"schema_version": 1``."""
"""Version of the ``status`` result (``gpushare status --json``), documented in docs/status-schema.md."""

# Method names. The daemon dispatches only names that appear in its explicit METHODS table.
HELLO = "hello"
STATUS = "status"
LIST = "list"
EVENTS = "events"
SUBMIT = "submit"
CANCEL = "cancel"
PAUSE = "pause"
RESUME = "resume"
ADOPT = "adopt"
RELEASE = "release"
#: ``gpushare drain``/``undrain`` (root and the admin group; gpushare/daemon/cordon.py).
DRAIN = "drain"
UNDRAIN = "undrain"

READ_METHODS = frozenset({HELLO, STATUS, LIST, EVENTS})
"""Methods anyone may call; the others are checked against the caller's rights."""


class ErrorCode(IntEnum):
    """Why a request failed. :meth:`exit_code` maps each to the CLI's exit status."""

    PARSE_ERROR = 1
    BAD_REQUEST = 2
    UNKNOWN_METHOD = 3
    INVALID_PARAMS = 4
    TOO_LARGE = 5
    HELLO_REQUIRED = 6
    VERSION_MISMATCH = 7
    NOT_FOUND = 8
    PERMISSION_DENIED = 9
    CONFLICT = 10
    NO_CAPACITY = 11
    UNAVAILABLE = 12
    INTERNAL = 13
    BUSY = 14

    def exit_code(self) -> int:
        """The CLI exit status: 2 bad input, 4 permission denied, 5 no capacity, 1 otherwise.

        The table of every status is gpushare.cli.exitcodes (README "Exit status").
        """
        if self in _BAD_INPUT:
            return 2
        if self is ErrorCode.PERMISSION_DENIED:
            return EXIT_PERMISSION_DENIED
        if self is ErrorCode.NO_CAPACITY:
            return EXIT_NO_CAPACITY
        return 1


_BAD_INPUT = frozenset(
    {
        ErrorCode.PARSE_ERROR,
        ErrorCode.BAD_REQUEST,
        ErrorCode.UNKNOWN_METHOD,
        ErrorCode.INVALID_PARAMS,
        ErrorCode.TOO_LARGE,
        ErrorCode.NOT_FOUND,
    }
)

EXIT_UNREACHABLE = 3
"""CLI exit status when the daemon's socket is missing or refuses the connection."""

EXIT_PERMISSION_DENIED = 4
"""CLI exit status when the caller may not do what it asked (or may not use the socket)."""

EXIT_NO_CAPACITY = 5
"""CLI exit status when no GPU can hold a submit now (an ``--offline`` one queues instead)."""


class ProtocolError(Exception):
    """A request that cannot be served; becomes an ``error`` response at the boundary."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        self.code = code
        self.message = message
        super().__init__(f"{code.name}: {message}")


# Requests. Field types are checked by from_params; unknown fields are refused.


@dataclass(frozen=True, slots=True)
class HelloRequest:
    """``hello``: the client's API version and a free-form name for logs."""

    api_version: int
    client: str = ""


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """``status``: the whole node, or one GPU named by index or UUID."""

    gpu: str | None = None


@dataclass(frozen=True, slots=True)
class ListRequest:
    """``list``: clients, by default only live and queued ones."""

    all: bool = False


@dataclass(frozen=True, slots=True)
class EventsRequest:
    """``events``: event log entries with id greater than ``since_id``, oldest first."""

    since_id: int = 0
    limit: int = 100


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """``cancel``, ``pause``, ``resume``: one client by id."""

    client_id: str


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """``submit``: start a workload as an MPS client.

    ``pid`` is set for a foreground submit: the CLI's own pid, which the daemon adopts before the
    CLI execs the command. ``env`` and ``cwd`` are the caller's, used for a detached spawn.
    Sizes are bytes, durations milliseconds, as in :mod:`gpushare.model`.
    """

    cls: str
    argv: list[str]
    gpu: str = "any"
    sm_pct: float | None = None
    mem_bytes: int | None = None
    slo_p99_ms: float | None = None
    slo_ttft_p99_ms: float | None = None
    """Online (an LLM server): p99 SLO on the time to the first token (``--slo-ttft-p99``)."""
    slo_tpot_p99_ms: float | None = None
    """Online (an LLM server): p99 SLO on the time per further token (``--slo-tpot-p99``)."""
    name: str | None = None
    restartable: bool = False
    checkpoint_signal: int = 10
    detach: bool = False
    pid: int | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    latency_from: str | None = None
    inflight_from: str | None = None
    queue: str | None = None
    no_queue: bool = False
    """Offline: refuse at once (NO_CAPACITY) rather than wait in the queue when no GPU fits."""
    expected_s: float | None = None
    """Offline: the job's expected length (``--time``); the queue starts shorter jobs first."""
    restart_cost_s: float | None = None
    """Offline: what a restart costs the job (``--restart-cost``, seconds; issue 32)."""
    wait_for: str | None = None
    """Foreground offline: the client id of this caller's queued submit, asked again to start it."""
    gpus: str | None = None
    """A gang (``--gpus``): a count (``"8"``) or GPUs by index or UUID (``"0,1"``); rank ``k``
    runs on the ``k``-th (``gpushare rank-exec``)."""


MAX_RESTART_COST_S = 7 * 86400.0
"""The largest ``--restart-cost`` (a week: larger means never restart for a share)."""


@dataclass(frozen=True, slots=True)
class AdoptRequest:
    """``adopt``: make the processes of one scheduler job clients, now and as they start.

    A scheduler's prolog sends it once per job and node, before the job's tasks run
    (``gpushare.slurm``). The daemon keeps it as an adoption rule scoped to the job: processes of
    ``uid`` whose environment matches every glob of ``match_env`` become clients of class ``cls``,
    ``pids`` at once, the others as they appear, until a ``release`` with the same ``source`` and
    ``job``. A second ``adopt`` for the same pair replaces the first. Root may register any uid's
    job in any class; any other caller only its own processes (``uid`` equal to its own), which is
    its owner asking. Sizes are bytes, durations milliseconds, as in :class:`SubmitRequest`.
    ``pids`` are adopted at once, without the ``match_env`` condition. ``gpu`` must be left out
    (``None``): each process's GPU comes from its environment (``GPUSHARE_GPU_UUID``).
    """

    source: str
    job: str
    uid: int
    cls: str
    match_env: dict[str, str] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    slo_p99_ms: float | None = None
    sm_pct: float | None = None
    mem_bytes: int | None = None
    gpu: str | None = None


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    """``release``: end an ``adopt`` registration: drop its rule and forget its clients.

    The scheduler has ended the job's processes by then (an epilog runs after the job); anything of
    the job still running is released from gpushare's control (thawed), not killed. Releasing a
    job that was never registered is not an error: an epilog runs for every job.
    """

    source: str
    job: str


# Results.


@dataclass(frozen=True, slots=True)
class HelloResult:
    """``hello`` answer: the daemon's API version and the caller identity it saw."""

    api_version: int
    daemon_version: str
    uid: int
    gid: int
    pid: int


@dataclass(frozen=True, slots=True)
class SubmitResult:
    """``submit`` answer: the client id and the exact environment its workload runs with.

    A queued offline submit (``state`` ``queued``) has no GPU yet (``gpu_uuid`` null), its place in
    the queue (``position``, 1 is next) and why it waits (``waiting``).
    """

    client_id: str
    gpu_uuid: str | None
    state: str
    env: dict[str, str]
    log_path: str | None = None
    pid: int | None = None
    unset_env: list[str] = field(default_factory=list)
    position: int | None = None
    waiting: str | None = None


# Framing.


def encode(message: dict[str, Any]) -> bytes:
    """One message as a JSON line (compact, UTF-8, newline-terminated)."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def decode_request(line: bytes) -> tuple[Any, str, dict[str, Any]]:
    """Split a request line into (id, method, params).

    Raises:
        ProtocolError: not JSON, not an object, or a missing/mistyped ``method``/``params``.
    """
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(ErrorCode.PARSE_ERROR, f"not valid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(ErrorCode.PARSE_ERROR, "JSON nested too deeply") from None
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a request must be a JSON object")
    req_id = obj.get("id")
    if req_id is not None and (isinstance(req_id, bool) or not isinstance(req_id, int | str)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, '"id" must be an integer or a string')
    method = obj.get("method")
    if not isinstance(method, str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, 'a request needs a string "method"')
    params = obj.get("params", {})
    if not isinstance(params, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, '"params" must be a JSON object')
    return req_id, method, params


class LineReader:
    """Reads newline-terminated messages from a stream socket, each at most ``max_bytes`` long."""

    def __init__(self, sock: socket.socket, max_bytes: int) -> None:
        self._sock = sock
        self._max_bytes = max_bytes
        self._buf = bytearray()

    def read_line(self) -> bytes | None:
        """The next message without its newline; None at end of stream.

        Raises:
            ProtocolError: ``TOO_LARGE`` when a message exceeds the bound; the stream is then out
                of step and the caller should close it after replying.
            OSError: the socket failed.
        """
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 1]
                if len(line) > self._max_bytes:
                    raise ProtocolError(ErrorCode.TOO_LARGE, self._too_large())
                return line
            if len(self._buf) > self._max_bytes:
                raise ProtocolError(ErrorCode.TOO_LARGE, self._too_large())
            chunk = self._sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk

    def _too_large(self) -> str:
        return f"message larger than {self._max_bytes} bytes (daemon.max_request); send less"


def ok_response(req_id: Any, result: Any) -> dict[str, Any]:
    """A success response."""
    return {"id": req_id, "result": result}


def error_response(req_id: Any, code: ErrorCode, message: str) -> dict[str, Any]:
    """An error response."""
    return {"id": req_id, "error": {"code": int(code), "name": code.name, "message": message}}


T = TypeVar("T")


def from_params(cls: type[T], params: dict[str, Any]) -> T:
    """Build a request dataclass from JSON params, checking every field's type.

    Raises:
        ProtocolError: an unknown field, a missing required field or a wrongly typed value.
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ProtocolError(
            ErrorCode.INVALID_PARAMS,
            f"unknown parameter(s) {', '.join(unknown)}; valid: {', '.join(fields)}",
        )
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in params:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(ErrorCode.INVALID_PARAMS, f"missing parameter {name!r}")
            continue
        value = params[name]
        if not _matches(hints[name], value):
            raise ProtocolError(
                ErrorCode.INVALID_PARAMS,
                f"parameter {name!r} must be {_describe(hints[name])}, got {type(value).__name__}",
            )
        if (problem := value_problem(value)) is not None:
            raise ProtocolError(ErrorCode.INVALID_PARAMS, f"parameter {name!r} {problem}")
        try:
            kwargs[name] = _coerce(hints[name], value)
        except OverflowError:
            # An integer of hundreds of digits is valid JSON but no float.
            raise ProtocolError(
                ErrorCode.INVALID_PARAMS, f"parameter {name!r} is too large for a number"
            ) from None
    return cls(**kwargs)


# SQLite stores 64-bit integers; a larger one reached it as an internal error.
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


def value_problem(value: Any) -> str | None:
    """Why a well-typed param value still cannot be used, or ``None``.

    Integers must fit 64 bits, numbers be finite, and text be UTF-8 without NUL (a lone
    surrogate such as ``"\ud800"`` cannot be encoded, and NUL cannot be in an argv or a path),
    in lists and objects too. Each of these reached a handler as an internal error.
    """
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if _INT_MIN <= value <= _INT_MAX else "is out of range (a 64-bit integer)"
    if isinstance(value, float):
        return None if math.isfinite(value) else "must be a finite number"
    if isinstance(value, str):
        if "\0" in value:
            return "must not contain NUL"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "must be UTF-8 text (it has a lone surrogate)"
        return None
    if isinstance(value, list):
        return next((p for v in value if (p := value_problem(v)) is not None), None)
    if isinstance(value, dict):
        return next(
            (p for k, v in value.items() if (p := value_problem(k) or value_problem(v))), None
        )
    return None


def _coerce(hint: Any, value: Any) -> Any:
    # JSON has one number type: an integral float field may arrive as 3, and is stored as 3.0.
    accepts_float = hint is float or float in typing.get_args(hint)
    if accepts_float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _matches(hint: Any, value: Any) -> bool:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(a, value) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, list) and all(_matches(args[0], v) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            _matches(args[0], k) and _matches(args[1], v) for k, v in value.items()
        )
    return False


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"an object of {_describe(args[1])}"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    return names.get(hint, str(hint))


def as_dict(value: Any) -> dict[str, Any]:
    """A result dataclass as a JSON-ready dict."""
    return dataclasses.asdict(value)
