"""Parsers of MPS output: command replies and ``-f``/``control.log`` lines, as typed values.

Pure functions over text (NVIDIA's MPS documentation, listed in docs/sources.md, is the source of every format handled here); they
raise nothing but :class:`~gpushare.node.mps.errors.MpsParseError`. :func:`parse_error` maps a
reply that carries an error message to its :class:`~gpushare.node.mps.errors.MpsError` subclass.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass

from gpushare.model import MpsEvent, MpsEventKind
from gpushare.node.mps.errors import (
    DaemonNotReachable,
    DaemonShuttingDown,
    InsufficientPrivileges,
    InvalidValue,
    MpsError,
    MpsParseError,
    ServerNotFound,
    UnknownCommand,
)

MIB = 1 << 20
GIB = 1 << 30


# --------------------------------------------------------------------------------------------
# Typed replies


class ServerStatus(str, enum.Enum):
    """``get_server_status`` (R555+)."""

    INITIALIZING = "INITIALIZING"
    ACTIVE = "ACTIVE"
    FAULT = "FAULT"


@dataclass(frozen=True, slots=True)
class PsRow:
    """One row of ``ps``: a client process of a server.

    ``columns`` keeps every column by its header name, including ones this class has no field for.
    """

    client_pid: int
    client_id: int | None
    server_pid: int | None
    device: str | None
    namespace: str | None
    command: str
    status: str | None
    columns: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class LspartRow:
    """One row of ``lspart`` (R6xx static partitioning). ``partition`` is None on the device total row."""

    gpu: str
    partition: str | None
    free_chunks: int | None
    used_chunks: int | None
    free_sm: int | None
    used_sm: int | None
    clients: bool | None


@dataclass(frozen=True, slots=True)
class DeviceClients:
    """One device of ``get_device_client_list`` and the client PIDs listed under it.

    The R535/R555 format is undocumented (binary strings ``[%d] %02d:%02d.%d, %s``); ``location`` is
    the ``bus:dev.fn`` text and ``name`` the rest of the device line.
    """

    ordinal: int
    location: str
    name: str
    client_pids: tuple[int, ...]


# --------------------------------------------------------------------------------------------
# Parsers (pure; they raise nothing but MpsParseError)

_ERROR_PATTERNS: tuple[tuple[re.Pattern[str], type[MpsError]], ...] = (
    (re.compile(r'^Unknown command "(.*)"'), UnknownCommand),
    (re.compile(r"^Server (-?\d+) not found!?$"), ServerNotFound),
    (re.compile(r"^Server not found$"), ServerNotFound),
    (re.compile(r"^A server PID is required"), InvalidValue),
    (re.compile(r"^A user id \(UID\) is required"), InvalidValue),
    (re.compile(r"^Invalid "), InvalidValue),
    (re.compile(r"^Insufficient privileges"), InsufficientPrivileges),
    (re.compile(r"^Not enough privilege"), InsufficientPrivileges),
    (re.compile(r"^The MPS control daemon is shutting down"), DaemonShuttingDown),
    (re.compile(r"^Cannot "), DaemonNotReachable),
    (re.compile(r"^Internal error"), MpsError),
)


def parse_error(output: str, command: str | None = None) -> MpsError | None:
    """The typed error a front-end reply carries, or None when it carries none.

    Args:
        output: stdout and stderr of one front-end invocation.
        command: the command sent, kept on the error.
    """
    for raw in output.splitlines():
        line = raw.strip()
        for pattern, cls in _ERROR_PATTERNS:
            match = pattern.match(line)
            if match is None:
                continue
            if cls is ServerNotFound:
                pid = int(match.group(1)) if match.groups() else None
                return ServerNotFound(line, server_pid=pid, command=command, output=output)
            return cls(line, command=command, output=output)
    return None


def _int_token(token: str, what: str, text: str) -> int:
    if not re.fullmatch(r"-?\d{1,19}", token):
        raise MpsParseError(f"expected {what}, got {token!r}", output=text)
    return int(token)


def parse_pid_list(text: str) -> tuple[int, ...]:
    """PIDs separated by any whitespace (``get_server_list``, ``get_client_list``); empty -> ()."""
    pids = tuple(_int_token(tok, "a PID", text) for tok in text.split())
    if any(pid <= 0 for pid in pids):
        raise MpsParseError("PIDs must be positive", output=text)
    return pids


def parse_pct(text: str) -> float:
    """A percentage printed as ``%.1f`` (``40.0``)."""
    tokens = text.split()
    if len(tokens) != 1 or not re.fullmatch(r"\d{1,3}(?:\.\d+)?", tokens[0]):
        raise MpsParseError(f"expected one percentage such as 40.0, got {text!r}", output=text)
    value = float(tokens[0])
    if not 0.0 <= value <= 100.0:
        raise MpsParseError(f"percentage out of range: {value}", output=text)
    return value


def parse_mps_size(text: str) -> int | None:
    """A pinned-memory limit (``2G``, ``512M``) in bytes; empty output (no limit set) -> None."""
    tokens = text.split()
    if not tokens:
        return None
    match = re.fullmatch(r"(\d{1,15})([MG])", tokens[0]) if len(tokens) == 1 else None
    if match is None:
        raise MpsParseError(f"expected a size such as 2G or 512M, got {text!r}", output=text)
    number, unit = match.groups()
    return int(number) * (GIB if unit == "G" else MIB)


def parse_priority(text: str) -> int:
    """A client priority, ``0`` or ``1``."""
    tokens = text.split()
    if tokens not in (["0"], ["1"]):
        raise MpsParseError(f"expected priority 0 or 1, got {text!r}", output=text)
    return int(tokens[0])


def parse_server_status(text: str) -> ServerStatus:
    """``INITIALIZING``, ``ACTIVE`` or ``FAULT``."""
    tokens = text.split()
    names = {s.value for s in ServerStatus}
    if len(tokens) != 1 or tokens[0].upper() not in names:
        raise MpsParseError(f"expected a server status, got {text!r}", output=text)
    return ServerStatus(tokens[0].upper())


def parse_terminate_status(text: str) -> int:
    """The numeric CUDA status ``terminate_client`` prints last (0 on success)."""
    tokens = text.split()
    if not tokens:
        raise MpsParseError("terminate_client printed nothing", output=text)
    return _int_token(tokens[-1], "a CUDA status", text)


def _header_line(lines: Sequence[str], first: str) -> int | None:
    for i, line in enumerate(lines):
        words = line.split()
        if words and words[0].upper() == first:
            return i
    return None


def parse_ps(text: str) -> tuple[PsRow, ...]:
    """The ``ps`` table, by header name; COMMAND may hold spaces wherever it sits.

    The R5xx table is ``PID ID SERVER DEVICE NAMESPACE COMMAND``; an 8-column variant with more
    columns exists in the binaries. Columns left of COMMAND are split from the left, the ones right
    of it from the right, and COMMAND gets what lies between.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    start = _header_line(lines, "PID")
    if start is None:
        if not lines:
            return ()
        raise MpsParseError(f"no ps header (PID ...) in {text[:200]!r}", output=text)
    header = [name.upper() for name in lines[start].split()]
    if len(set(header)) != len(header):
        raise MpsParseError(f"duplicate ps column in {lines[start]!r}", output=text)
    cmd_at = header.index("COMMAND") if "COMMAND" in header else len(header) - 1
    right = len(header) - 1 - cmd_at
    rows = []
    for line in lines[start + 1 :]:
        words = line.split()
        if len(words) < len(header):
            raise MpsParseError(f"ps row has too few columns: {line!r}", output=text)
        left_words = words[:cmd_at]
        right_words = words[len(words) - right :] if right else []
        # Rebuild COMMAND from the original line so inner spacing survives: drop the left columns
        # and the right columns by splitting on whitespace a bounded number of times.
        rest = line.split(None, cmd_at)[cmd_at] if cmd_at else line.strip()
        command = rest.rsplit(None, right)[0] if right else rest.strip()
        values = [*left_words, command.strip(), *right_words]
        cols = dict(zip(header, values, strict=True))
        rows.append(
            PsRow(
                client_pid=_int_token(cols["PID"], "a client PID", text),
                client_id=_opt_int(cols.get("ID"), text),
                server_pid=_opt_int(cols.get("SERVER"), text),
                device=cols.get("DEVICE"),
                namespace=cols.get("NAMESPACE"),
                command=cols.get("COMMAND", ""),
                status=cols.get("STATUS"),
                columns=tuple(cols.items()),
            )
        )
    return tuple(rows)


def _opt_int(value: str | None, text: str) -> int | None:
    if value is None or value == "-":
        return None
    return _int_token(value, "a number", text)


def parse_lspart(text: str) -> tuple[LspartRow, ...]:
    """The ``lspart`` table (R6xx), whose header wraps over two lines (NVIDIA's MPS tools reference, docs/sources.md)."""
    lines = [line for line in text.splitlines() if line.strip()]
    start = _header_line(lines, "GPU")
    if start is None:
        if not lines:
            return ()
        raise MpsParseError(f"no lspart header (GPU Partition ...) in {text[:200]!r}", output=text)
    body = lines[start + 1 :]
    # The second header line ("chunk chunk SM SM") has no GPU identifier in its first column.
    if body and body[0].split()[0].lower() == "chunk":
        body = body[1:]
    rows = []
    for line in body:
        words = line.split()
        if len(words) != 7:
            raise MpsParseError(f"lspart row needs 7 columns: {line!r}", output=text)
        gpu, part, free_c, used_c, free_sm, used_sm, clients = words
        if clients not in ("Yes", "-", "No"):
            raise MpsParseError(f"lspart clients column must be Yes or -: {line!r}", output=text)
        rows.append(
            LspartRow(
                gpu=gpu,
                partition=None if part == "-" else part,
                free_chunks=_opt_int(free_c, text),
                used_chunks=_opt_int(used_c, text),
                free_sm=_opt_int(free_sm, text),
                used_sm=_opt_int(used_sm, text),
                clients=None if clients == "-" else clients == "Yes",
            )
        )
    return tuple(rows)


_DEVICE_LINE = re.compile(r"^\[(\d+)\]\s+([0-9A-Fa-f]+:[0-9A-Fa-f]+\.\d+),\s*(.*)$")


def parse_device_client_list(text: str) -> tuple[DeviceClients, ...]:
    """``get_device_client_list``: device lines ``[n] bb:dd.f, name`` each followed by client PIDs.

    Lines such as ``Server N is <busy>`` are ignored (their meaning is unconfirmed).
    """
    devices: list[DeviceClients] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("Server "):
            continue
        match = _DEVICE_LINE.match(line)
        if match is not None:
            devices.append(DeviceClients(int(match.group(1)), match.group(2), match.group(3), ()))
            continue
        pids = parse_pid_list(line)
        if not devices:
            raise MpsParseError(f"client PIDs before any device line: {line!r}", output=text)
        last = devices[-1]
        devices[-1] = dataclasses.replace(last, client_pids=last.client_pids + pids)
    return tuple(devices)


LOG_LINE_RE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) (\S+(?: \S+)?) +(\d+)\] (.*)$"
)

_MESSAGES: tuple[tuple[re.Pattern[str], MpsEventKind], ...] = (
    (re.compile(r"^Cmd:(.*)$"), MpsEventKind.COMMAND),
    (re.compile(r"^Starting new server (\d+) for user (\d+)"), MpsEventKind.SERVER_STARTED),
    (re.compile(r"^NEW SERVER (\d+): Ready"), MpsEventKind.SERVER_READY),
    (re.compile(r"^Server (\d+) exited with status (-?\d+)"), MpsEventKind.SERVER_EXITED),
    (re.compile(r"^Failed to start server using uid (\d+)"), MpsEventKind.SERVER_EXITED),
    (re.compile(r"^Server encountered a fatal exception"), MpsEventKind.FATAL_EXCEPTION),
    (re.compile(r"^NEW CLIENT (\d+) from user (\d+)"), MpsEventKind.CLIENT_CONNECTED),
    (re.compile(r"^Starting control daemon using socket"), MpsEventKind.DAEMON_STARTED),
    (re.compile(r"^To connect CUDA applications to this daemon"), MpsEventKind.DAEMON_STARTED),
    (re.compile(r"^Exit with status (-?\d+)"), MpsEventKind.DAEMON_EXITED),
)
# Connection bookkeeping of every front-end call: not worth an event each.
CHATTER = ("Accepting connection...", "NEW UI", "UI closed")
CHATTER_PREFIXES = ("Using log directory:",)


@dataclass(frozen=True, slots=True)
class LogLine:
    """A parsed ``control.log``/``-f`` line: ``[time component pid] message``."""

    stamp: str
    component: str
    pid: int
    message: str


def parse_log_line(line: str) -> LogLine | None:
    """Split a daemon output line into its parts; None if it is not in the log format."""
    match = LOG_LINE_RE.match(line.rstrip("\r\n"))
    if match is None:
        return None
    stamp, component, pid, message = match.groups()
    return LogLine(stamp, component, int(pid), message)


def event_from_line(line: str, gpu_uuid: str, at_s: float) -> MpsEvent:
    """The event one line of daemon output reports (RAW when the line is not recognised)."""
    text = line.rstrip("\r\n")
    parsed = parse_log_line(text)
    if parsed is None:
        return MpsEvent(MpsEventKind.RAW, gpu_uuid, at_s, text)
    msg = parsed.message
    for pattern, kind in _MESSAGES:
        match = pattern.match(msg)
        if match is None:
            continue
        groups = match.groups()
        if kind is MpsEventKind.COMMAND:
            return MpsEvent(kind, gpu_uuid, at_s, groups[0].strip())
        if kind is MpsEventKind.SERVER_STARTED:
            return MpsEvent(
                kind, gpu_uuid, at_s, msg, server_pid=int(groups[0]), uid=int(groups[1])
            )
        if kind is MpsEventKind.SERVER_READY:
            return MpsEvent(kind, gpu_uuid, at_s, msg, server_pid=int(groups[0]))
        if kind is MpsEventKind.SERVER_EXITED and len(groups) == 2:
            return MpsEvent(
                kind, gpu_uuid, at_s, msg, server_pid=int(groups[0]), status=int(groups[1])
            )
        if kind is MpsEventKind.SERVER_EXITED:
            return MpsEvent(kind, gpu_uuid, at_s, msg, uid=int(groups[0]))
        if kind is MpsEventKind.FATAL_EXCEPTION:
            # Written by the server itself: the line's pid is the faulted server's.
            spid = parsed.pid if parsed.component != "Control" else None
            return MpsEvent(kind, gpu_uuid, at_s, msg, server_pid=spid)
        if kind is MpsEventKind.CLIENT_CONNECTED:
            return MpsEvent(
                kind, gpu_uuid, at_s, msg, client_pid=int(groups[0]), uid=int(groups[1])
            )
        if kind is MpsEventKind.DAEMON_EXITED:
            return MpsEvent(kind, gpu_uuid, at_s, msg, status=int(groups[0]))
        return MpsEvent(kind, gpu_uuid, at_s, msg)
    return MpsEvent(MpsEventKind.RAW, gpu_uuid, at_s, text)
