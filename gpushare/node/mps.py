"""NVIDIA MPS: the typed control front end, the per-GPU supervisor and the node-wide manager.

This is the only module that runs the MPS binaries (``reference/mps.md`` is the source of every
format and message handled here):

* :class:`MpsControl` wraps each Legacy (v2) control command of one control daemon (one pipe
  directory) as a typed method. The front end exits 0 even when it rejects a command, so every
  reply is read and each known error string becomes a :class:`MpsError` subclass. One command per
  invocation (replies to several cannot be told apart), a timeout on every call, values validated
  before they are sent, and echoed values compared with the request (an invalid percentage makes
  the daemon print the *unchanged* value).
* The ``parse_*`` functions turn replies and ``-f`` output lines into typed values; they never
  raise anything but :class:`MpsParseError` (itself an :class:`MpsError`).
* :class:`MpsSupervisor` runs ``nvidia-cuda-mps-control -f`` for one GPU (DESIGN D1), turns its
  output into :class:`~gpushare.model.MpsEvent` values, health-checks it, restarts it with bounded
  exponential backoff, re-applies the defaults, and stops it with ``quit -t``.
* :class:`MpsNodeManager` implements :class:`gpushare.node.base.MpsNode` over one supervisor per
  shared GPU.

Short commands go through :func:`gpushare.node.exec.run`; the long-running ``-f`` child is the
one process started with :class:`subprocess.Popen`, because its output is read while it runs.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import math
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import structlog

from gpushare.config import Config
from gpushare.model import MpsEvent, MpsEventKind, MpsState
from gpushare.node.base import ComputeModeControl
from gpushare.node.exec import run

log = structlog.get_logger(__name__)

SERVER_BINARY = "nvidia-cuda-mps-server"
HEALTH_COMMAND = "get_default_active_thread_percentage"
# Compute-mode names as node.base.ComputeModeControl spells them.
EXCLUSIVE_PROCESS = "exclusive_process"
# Entries the daemon leaves in its pipe directory (reference/mps.md section 1).
PIPE_ENTRIES = (
    "control",
    "control_privileged",
    "control_lock",
    "log",
    "nvidia-cuda-mps-control.pid",
)
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
_SUN_PATH_MAX = 107
# Variables the control daemon reads as its own defaults: a stale value from the caller's
# environment would override the configured defaults or stop the daemon from starting.
_DAEMON_ENV_DROP = (
    "NOTIFY_SOCKET",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_CLIENT_PRIORITY",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_PROTOCOL_VERSION",
)
_MIB = 1 << 20
_GIB = 1 << 30
_EVENT_QUEUE_MAX = 4096
_T = TypeVar("_T")


# --------------------------------------------------------------------------------------------
# Errors


class MpsError(Exception):
    """Anything that went wrong talking to MPS; ``command`` and ``output`` say what was sent/read."""

    def __init__(self, message: str, *, command: str | None = None, output: str = "") -> None:
        super().__init__(message)
        self.command = command
        self.output = output


class UnknownCommand(MpsError):  # noqa: N818 - names from the issue; Error suffix adds nothing
    """The daemon does not know the command (``Unknown command "..."``), e.g. R535 and get_server_status."""


class ServerNotFound(MpsError):  # noqa: N818 - names from the issue; Error suffix adds nothing
    """No MPS server with that PID (``Server N not found``), or no server at all."""

    def __init__(
        self,
        message: str,
        *,
        server_pid: int | None = None,
        command: str | None = None,
        output: str = "",
    ) -> None:
        super().__init__(message, command=command, output=output)
        self.server_pid = server_pid


class InvalidValue(MpsError):  # noqa: N818 - names from the issue; Error suffix adds nothing
    """A value was rejected before sending, refused by the daemon, or not taken (echo mismatch)."""


class InsufficientPrivileges(MpsError):  # noqa: N818 - names from the issue; Error suffix adds nothing
    """The daemon refused the command for this user (``Insufficient privileges``/``Not enough privilege``)."""


class DaemonNotReachable(MpsError):  # noqa: N818 - names from the issue; Error suffix adds nothing
    """No control daemon answers on the pipe directory (or the front end exited non-zero)."""


class DaemonShuttingDown(DaemonNotReachable):
    """The control daemon is shutting down (``The MPS control daemon is shutting down``)."""


class CommandTimeout(DaemonNotReachable):
    """The front end did not return within the timeout: the daemon is hung or overloaded."""


class CommandFailed(MpsError):  # noqa: N818 - names from the issue; Error suffix adds nothing
    """A command answered with a non-zero CUDA status (``terminate_client``)."""

    def __init__(self, message: str, *, status: int, command: str | None = None) -> None:
        super().__init__(message, command=command)
        self.status = status


class MpsParseError(MpsError):
    """A reply or output line did not have the documented format."""


class MpsSetupError(MpsError):
    """The supervisor cannot run MPS as configured (missing binary, unsupported option, bad path)."""


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
    return int(number) * (_GIB if unit == "G" else _MIB)


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
    """The ``lspart`` table (R6xx), whose header wraps over two lines (reference/mps.md 4.1)."""
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
_CHATTER_PREFIXES = ("Using log directory:",)


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


# --------------------------------------------------------------------------------------------
# Validation of values before they are sent

_DEVICE_RE = re.compile(r"^(\d{1,3}|(?:GPU|MIG)-[0-9a-fA-F][0-9a-fA-F-]{0,63})$")
_MPS_SIZE_RE = re.compile(r"^([1-9]\d{0,12})([MG])$")


def check_pct(pct: float) -> float:
    """A percentage in (0, 100] as float.

    Raises:
        InvalidValue: not a number in (0, 100].
    """
    if isinstance(pct, bool) or not isinstance(pct, int | float):
        raise InvalidValue(f"active thread percentage must be a number in (0, 100], got {pct!r}")
    value = float(pct)
    if not math.isfinite(value) or not 0.0 < value <= 100.0:
        raise InvalidValue(f"active thread percentage must lie in (0, 100], got {pct!r}")
    return value


def check_mps_size(size: int | str) -> str:
    """The ``<int>M``/``<int>G`` spelling MPS takes for a limit given as bytes or as that spelling.

    Bytes are rounded down to whole MiB (never above the cap the caller asked for).

    Raises:
        InvalidValue: not a positive size of at least 1 MiB.
    """
    if isinstance(size, bool):
        raise InvalidValue(f"pinned memory limit must be bytes or <int>M|G, got {size!r}")
    if isinstance(size, int):
        if size < _MIB:
            raise InvalidValue(
                f"pinned memory limit must be at least 1M (1048576 bytes), got {size}"
            )
        if size % _GIB == 0:
            return f"{size // _GIB}G"
        return f"{size // _MIB}M"
    if isinstance(size, str) and _MPS_SIZE_RE.match(size):
        return size
    raise InvalidValue(
        f"pinned memory limit must be written <int>M or <int>G (e.g. 512M, 2G), got {size!r}"
    )


def mps_size_bytes(spelling: str) -> int:
    """Bytes of a valid ``<int>M|G`` spelling (see :func:`check_mps_size`)."""
    number, unit = spelling[:-1], spelling[-1]
    return int(number) * (_GIB if unit == "G" else _MIB)


def expected_readback(num_bytes: int) -> int:
    """What the getter prints for a limit: whole GiB when >= 1 GiB (floored), else MiB [obs535]."""
    return (num_bytes // _GIB) * _GIB if num_bytes >= _GIB else (num_bytes // _MIB) * _MIB


def check_device(device: int | str) -> str:
    """A device as MPS takes it: an ordinal or a ``GPU-``/``MIG-`` UUID.

    Raises:
        InvalidValue: anything else.
    """
    text = str(device) if isinstance(device, int) and not isinstance(device, bool) else device
    if isinstance(text, str) and _DEVICE_RE.match(text):
        return text
    raise InvalidValue(f"device must be an ordinal (0, 1, ...) or a GPU-/MIG- UUID, got {device!r}")


def check_pid(pid: int, what: str = "PID") -> int:
    """A positive PID.

    Raises:
        InvalidValue: not a positive int.
    """
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise InvalidValue(f"{what} must be a positive integer, got {pid!r}")
    return pid


def check_priority(priority: int) -> int:
    """A client priority, 0 (normal) or 1 (below normal).

    Raises:
        InvalidValue: anything else.
    """
    if isinstance(priority, bool) or priority not in (0, 1):
        raise InvalidValue(
            f"client priority must be 0 (normal) or 1 (below normal), got {priority!r}"
        )
    return priority


# --------------------------------------------------------------------------------------------
# The control front end


class MpsControl:
    """Typed front end of one control daemon (one pipe directory).

    Every method sends one command through ``nvidia-cuda-mps-control`` on stdin and reads its
    reply. Errors are raised as :class:`MpsError` subclasses; timeouts as :class:`CommandTimeout`.
    """

    def __init__(
        self,
        control_binary: str | Path,
        pipe_dir: Path,
        *,
        timeout_s: float = 5.0,
        log_dir: Path | None = None,
    ) -> None:
        self.control_binary = str(control_binary)
        self.pipe_dir = pipe_dir
        self.timeout_s = timeout_s
        self.log_dir = log_dir

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DAEMON_ENV_DROP}
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        if self.log_dir is not None:
            env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        return env

    def command(self, *words: str, timeout_s: float | None = None) -> str:
        """Send one raw command and return its stdout; raises the typed error it carries.

        Raises:
            MpsError: the subclass matching the reply; :class:`CommandTimeout` on timeout,
                :class:`DaemonNotReachable` on a non-zero exit, :class:`MpsSetupError` if the
                binary is missing.
        """
        line = " ".join(words)
        if "\n" in line or "\r" in line:
            raise InvalidValue(f"a control command is one line, got {line!r}")
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            done = run([self.control_binary], input=line + "\n", timeout_s=timeout, env=self._env())
        except (FileNotFoundError, PermissionError) as exc:
            raise MpsSetupError(
                f"cannot run {self.control_binary}: {exc}; install nvidia-cuda-mps or set "
                "mps.control_binary (tests: scripts/get-mps-control.sh)",
                command=line,
            ) from exc
        output = done.stdout + done.stderr
        if done.timed_out:
            raise CommandTimeout(
                f"{line!r} got no answer within {timeout}s from the daemon at {self.pipe_dir}",
                command=line,
                output=output,
            )
        error = parse_error(output, line)
        if error is not None:
            raise error
        if done.returncode != 0:
            raise DaemonNotReachable(
                f"{line!r}: front end exited {done.returncode} ({output.strip()[:200]!r})",
                command=line,
                output=output,
            )
        log.debug("mps_command", pipe_dir=str(self.pipe_dir), cmd=line, reply=done.stdout[:200])
        return done.stdout

    def _parsed(self, parser: Callable[[str], _T], *words: str) -> _T:
        text = self.command(*words)
        try:
            return parser(text)
        except MpsParseError as exc:
            if not text.strip():
                # Exit 0 with nothing printed: the connection broke mid-command (seen when the
                # daemon is killed while the front end waits on it).
                raise DaemonNotReachable(
                    f"{' '.join(words)!r}: no reply from the daemon at {self.pipe_dir}",
                    command=" ".join(words),
                ) from exc
            exc.command = " ".join(words)
            raise

    # Servers ---------------------------------------------------------------------------------

    def get_server_list(self) -> tuple[int, ...]:
        """PIDs of all MPS servers of this daemon."""
        return self._parsed(parse_pid_list, "get_server_list")

    def get_server_status(self, server_pid: int) -> ServerStatus:
        """State of a server (R555+; R535 raises :class:`UnknownCommand`)."""
        return self._parsed(parse_server_status, "get_server_status", str(check_pid(server_pid)))

    def start_server(self, uid: int, *, mlopart: bool = False) -> None:
        """Start a server for ``uid`` (its start and exit show up as events)."""
        if isinstance(uid, bool) or not isinstance(uid, int) or uid < 0:
            raise InvalidValue(f"uid must be a non-negative integer, got {uid!r}")
        words = ["start_server", "-uid", str(uid)] + (["-mlopart"] if mlopart else [])
        self._expect_silent(*words)

    def shutdown_server(self, server_pid: int, *, force: bool = False) -> None:
        """Ask a server to exit once its clients are gone; ``force`` exits it at once."""
        words = ["shutdown_server", str(check_pid(server_pid))] + (["-f"] if force else [])
        self._expect_silent(*words)

    def get_client_list(self, server_pid: int) -> tuple[int, ...]:
        """Client PIDs of a server."""
        return self._parsed(parse_pid_list, "get_client_list", str(check_pid(server_pid)))

    def get_device_client_list(self, server_pid: int | None = None) -> tuple[DeviceClients, ...]:
        """Devices and the client PIDs that enumerated each (of all servers, or one)."""
        words = ["get_device_client_list"]
        if server_pid is not None:
            words.append(str(check_pid(server_pid)))
        return self._parsed(parse_device_client_list, *words)

    def quit(self, timeout_s: float | None = None) -> None:
        """Stop the daemon; with ``timeout_s`` servers are forced down after that many seconds."""
        words = ["quit"]
        wait_s = self.timeout_s
        if timeout_s is not None:
            if not math.isfinite(timeout_s) or timeout_s < 0:
                raise InvalidValue(f"quit timeout must be >= 0 seconds, got {timeout_s!r}")
            # The daemon reads whole seconds (%u); round up so it never waits less than asked.
            words += ["-t", str(math.ceil(timeout_s))]
            # The front end may wait while servers wind down: allow it the quit timeout too.
            wait_s += math.ceil(timeout_s)
        text = self.command(*words, timeout_s=wait_s)
        if text.strip():
            raise MpsParseError(
                f"quit: unexpected reply {text.strip()[:200]!r}",
                command=" ".join(words),
                output=text,
            )

    # Active thread percentage ---------------------------------------------------------------

    def set_default_active_thread_percentage(self, pct: float) -> float:
        """Default SM share of servers started from now on; returns the value the daemon holds.

        Raises:
            InvalidValue: out of range, or the daemon kept another value (it prints the unchanged
                value instead of an error).
        """
        value = check_pct(pct)
        echoed = self._parsed(parse_pct, "set_default_active_thread_percentage", repr(value))
        return self._check_echo(value, echoed, "set_default_active_thread_percentage")

    def get_default_active_thread_percentage(self) -> float:
        """Default SM share of future servers (100.0 initially)."""
        return self._parsed(parse_pct, HEALTH_COMMAND)

    def set_active_thread_percentage(self, server_pid: int, pct: float) -> float:
        """SM share of a server's clients created from now on; returns the value it holds."""
        value = check_pct(pct)
        words = ("set_active_thread_percentage", str(check_pid(server_pid)), repr(value))
        text = self.command(*words)
        if not text.split():
            # The echo is documented (%.1f) but unconfirmed for this command: read back instead.
            return self._check_echo(value, self.get_active_thread_percentage(server_pid), words[0])
        try:
            echoed = parse_pct(text)
        except MpsParseError as exc:
            exc.command = " ".join(words)
            raise
        return self._check_echo(value, echoed, words[0])

    def get_active_thread_percentage(self, server_pid: int) -> float:
        """SM share of a server."""
        return self._parsed(parse_pct, "get_active_thread_percentage", str(check_pid(server_pid)))

    @staticmethod
    def _check_echo(requested: float, echoed: float, command: str) -> float:
        if f"{requested:.1f}" != f"{echoed:.1f}":
            raise InvalidValue(
                f"{command}: asked for {requested:.1f}, the daemon holds {echoed:.1f}",
                command=command,
            )
        return echoed

    # Pinned device memory -------------------------------------------------------------------

    def set_default_device_pinned_mem_limit(
        self, device: int | str, limit: int | str
    ) -> int | None:
        """Default per-client pinned-memory cap on ``device`` for future servers.

        ``limit`` is bytes (rounded down to MiB) or ``<int>M|G``. Returns the limit read back, or
        None when the daemon cannot show it (a UUID without a visible GPU reads back empty). The
        getter floors to whole GiB at or above 1 GiB.

        Raises:
            InvalidValue: bad device or size, or the daemon reads back another limit.
        """
        dev = check_device(device)
        spelling = check_mps_size(limit)
        self._expect_silent("set_default_device_pinned_mem_limit", dev, spelling)
        return self._check_limit(
            self.get_default_device_pinned_mem_limit(dev),
            spelling,
            "set_default_device_pinned_mem_limit",
        )

    def get_default_device_pinned_mem_limit(self, device: int | str) -> int | None:
        """Default pinned-memory cap on ``device`` in bytes; None if unset."""
        return self._parsed(
            parse_mps_size, "get_default_device_pinned_mem_limit", check_device(device)
        )

    def set_device_pinned_mem_limit(
        self, server_pid: int, device: int | str, limit: int | str
    ) -> int | None:
        """Pinned-memory cap of a server's clients created from now on (see the default setter)."""
        pid = str(check_pid(server_pid))
        dev = check_device(device)
        spelling = check_mps_size(limit)
        self._expect_silent("set_device_pinned_mem_limit", pid, dev, spelling)
        return self._check_limit(
            self.get_device_pinned_mem_limit(server_pid, dev),
            spelling,
            "set_device_pinned_mem_limit",
        )

    def get_device_pinned_mem_limit(self, server_pid: int, device: int | str) -> int | None:
        """Pinned-memory cap of a server on ``device`` in bytes; None if unset."""
        return self._parsed(
            parse_mps_size,
            "get_device_pinned_mem_limit",
            str(check_pid(server_pid)),
            check_device(device),
        )

    @staticmethod
    def _check_limit(readback: int | None, spelling: str, command: str) -> int | None:
        if readback is None:
            log.info("mps_pinned_limit_unreadable", cmd=command, limit=spelling)
            return None
        expected = expected_readback(mps_size_bytes(spelling))
        if readback != expected:
            raise InvalidValue(
                f"{command}: set {spelling}, the daemon reads back {readback} bytes",
                command=command,
            )
        return readback

    # Clients ---------------------------------------------------------------------------------

    def terminate_client(self, server_pid: int, client_pid: int) -> None:
        """Kill all outstanding GPU work of a client (it then gets sticky error 810).

        Raises:
            ServerNotFound: no such server. InvalidValue: no such client.
            CommandFailed: the daemon answered a non-zero CUDA status.
        """
        words = (
            "terminate_client",
            str(check_pid(server_pid)),
            str(check_pid(client_pid, "client PID")),
        )
        status = self._parsed(parse_terminate_status, *words)
        if status != 0:
            raise CommandFailed(
                f"terminate_client {server_pid} {client_pid} returned CUDA status {status}",
                status=status,
                command=" ".join(words),
            )

    def ps(self, server_pid: int | None = None) -> tuple[PsRow, ...]:
        """Client processes (of all servers, or of one).

        With no server at all the daemon prints ``Server not found``; for the whole node that is
        simply no client, so it returns ``()`` (``ps(pid)`` of a missing server still raises).
        """
        if server_pid is None:
            try:
                return self._parsed(parse_ps, "ps")
            except ServerNotFound as exc:
                if exc.server_pid is None:
                    return ()
                raise
        return self._parsed(parse_ps, "ps", "-p", str(check_pid(server_pid)))

    def set_default_client_priority(self, priority: int) -> None:
        """Default priority of new clients: 0 normal, 1 below normal."""
        self._expect_silent("set_default_client_priority", str(check_priority(priority)))

    def get_default_client_priority(self) -> int:
        """Default priority of new clients."""
        return self._parsed(parse_priority, "get_default_client_priority")

    def lspart(self) -> tuple[LspartRow, ...]:
        """Static SM partitions (R6xx with ``-S``; older daemons raise :class:`UnknownCommand`)."""
        return self._parsed(parse_lspart, "lspart")

    def _expect_silent(self, *words: str) -> None:
        text = self.command(*words)
        if text.strip():
            raise MpsParseError(f"{' '.join(words)!r}: unexpected reply {text.strip()[:200]!r}",
                                command=" ".join(words), output=text)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Compute mode (through NVML, injected: this module must not import pynvml)


def find_binary(control_binary: str | Path) -> str | None:
    """Where ``mps.control_binary`` resolves (an absolute path, or a name on PATH); None if absent.

    The one lookup :func:`binary_status`, ``gpushare doctor`` and the daemon share.
    """
    return shutil.which(str(control_binary))


_VERSION_RE = re.compile(rb"(?<![\d.])(\d{3}\.\d{2,3}(?:\.\d{2})?)(?![\d.])")


def binary_version(control_binary: str | Path) -> str | None:
    """The driver version the control binary was built for (``535.261.03``), None if not seen.

    R535 has no ``-v`` option; its one driver-version literal is read from the binary instead
    (as :func:`supports_multiuser` reads its options). None unless exactly one version is found.
    """
    path = find_binary(control_binary)
    if path is None:
        return None
    try:
        found = {m.decode() for m in _VERSION_RE.findall(Path(path).read_bytes())}
    except OSError:
        return None
    return found.pop() if len(found) == 1 else None


def binary_status(control_binary: str | Path) -> tuple[bool, str, str]:
    """Whether the control binary is found and runs: ``(ok, what was seen, hint)``.

    Runs the front end against an empty pipe directory: a working binary answers that it finds
    no daemon there (reference/mps.md section 3), which proves it executes on this host.
    """
    path = find_binary(control_binary)
    if path is None:
        return False, f"{control_binary} not found (PATH or absolute path)", ""
    with tempfile.TemporaryDirectory(prefix="gpushare-doctor-") as pipe_dir:
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir}
        try:
            result = run([path], input=HEALTH_COMMAND + "\n", timeout_s=10.0, env=env)
        except OSError as exc:
            return False, f"{path} cannot run: {exc.strerror or exc}", "check its permissions"
    answer = (result.stdout + result.stderr).strip()
    if "Cannot find MPS control daemon" in answer or result.ok:
        return True, path, ""
    return False, f"{path} ran but answered {answer[:80]!r} (exit {result.returncode})", ""


def supports_multiuser(control_binary: str | Path) -> bool:
    """Whether the control binary knows ``-multiuser-server`` (R555 man page has it, R535 not).

    The option appears as a literal in the binary; its help text does not list options.
    """
    path = Path(control_binary)
    if not path.is_absolute():
        found = shutil.which(str(control_binary))
        if found is None:
            return False
        path = Path(found)
    try:
        return b"-multiuser-server" in path.read_bytes()
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# The supervisor


EventCallback = Callable[[MpsEvent], None]


class MpsSupervisor:
    """Runs and keeps alive the MPS control daemon of one GPU (DESIGN D1).

    Life cycle: :meth:`start` prepares the directories, sets the compute mode, starts
    ``nvidia-cuda-mps-control -f`` (or adopts a daemon already answering on the pipe directory,
    left by a previous gpushare with ``stop_mps_on_exit = false``), waits until the health command
    answers and applies the defaults. A health thread checks the daemon every ``health_period_s``
    (and at once when its output ends); a dead or silent daemon is killed, its stale pipe entries
    removed, and it is restarted with exponential backoff between ``restart_backoff_min_s`` and
    ``restart_backoff_max_s``; the defaults are re-applied and ``DAEMON_RESTARTED`` is emitted.
    :meth:`stop` sends ``quit -t``, kills the daemon if it does not exit, removes its sockets and
    restores the compute mode.
    """

    def __init__(
        self,
        gpu_uuid: str,
        config: Config,
        *,
        extra_path: Sequence[str | Path] = (),
        compute_mode: ComputeModeControl | None = None,
        pinned_limits: Mapping[int | str, int | str] | None = None,
        client_priority: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """Build a stopped supervisor.

        Args:
            gpu_uuid: the GPU; its daemon gets ``CUDA_VISIBLE_DEVICES=<uuid>``.
            config: the daemon config (``paths.mps_*_dir``, ``mps.*``).
            extra_path: directories put first on the daemon's PATH (where
                ``nvidia-cuda-mps-server`` lives, when not on PATH).
            compute_mode: NVML compute-mode access; None skips compute mode with a warning.
            pinned_limits: default pinned-memory cap per device (ordinal or UUID) to apply.
            client_priority: default client priority to apply (None leaves the daemon's).
            clock: the time events are stamped with.

        Raises:
            InvalidValue: a bad pinned limit, device or priority.
            MpsSetupError: the pipe directory path is too long for a Unix socket.
        """
        self.gpu_uuid = gpu_uuid
        self.config = config
        cfg = config.mps
        self.pipe_dir = config.paths.resolved("mps_pipe_dir") / gpu_uuid
        self.log_dir = config.paths.resolved("mps_log_dir") / gpu_uuid
        longest = self.pipe_dir / "control_privileged"
        if len(os.fsencode(str(longest))) > _SUN_PATH_MAX:
            raise MpsSetupError(
                f"the MPS socket path {longest} is longer than a Unix socket allows "
                f"({_SUN_PATH_MAX} bytes); set paths.mps_pipe_dir (or paths.runtime_dir) to a shorter path"
            )
        self.control = MpsControl(
            cfg.control_binary, self.pipe_dir, timeout_s=cfg.command_timeout_s, log_dir=self.log_dir
        )
        self._extra_path = [str(p) for p in extra_path]
        self._compute = compute_mode
        self._pinned = {
            check_device(d): check_mps_size(v) for d, v in (pinned_limits or {}).items()
        }
        self._priority = None if client_priority is None else check_priority(client_priority)
        self._default_pct = check_pct(cfg.default_active_thread_pct)
        self._clock = clock

        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._reader: threading.Thread | None = None
        self._health: threading.Thread | None = None
        self._state = MpsState.DOWN
        self._fault = False
        self._faulted_servers: set[int | None] = set()
        self._adopted = False
        self._started = False
        self._prev_mode: str | None = None
        self._multiuser = False
        self._failures = 0
        self.restarts = 0
        self._events: collections.deque[MpsEvent] = collections.deque(maxlen=_EVENT_QUEUE_MAX)
        self._subscribers: tuple[EventCallback, ...] = ()
        self._fault_lock = threading.Lock()
        self._ui_reply = False
        self._reader_stop = threading.Event()
        self._log = log.bind(gpu=gpu_uuid)

    # Public view -----------------------------------------------------------------------------

    @property
    def child_pid(self) -> int | None:
        """PID of the supervised ``-f`` process (None when adopted or not running)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def multiuser(self) -> bool:
        """Whether the daemon was started with ``-multiuser-server``."""
        return self._multiuser

    def state(self) -> MpsState:
        """Health of this GPU's daemon and server."""
        with self._fault_lock:
            fault = self._fault
        state = self._state
        return MpsState.FAULT if state is MpsState.UP and fault else state

    def subscribe(self, callback: EventCallback) -> None:
        """Call ``callback`` with every event from now on (on the reader/health threads; keep it short)."""
        # Replaced, never mutated, so _emit can iterate it without a lock.
        self._subscribers = (*self._subscribers, callback)

    def drain_events(self) -> list[MpsEvent]:
        """Events since the last call (the queue keeps the newest 4096)."""
        out: list[MpsEvent] = []
        while True:
            try:
                out.append(self._events.popleft())
            except IndexError:
                return out

    # Start and stop --------------------------------------------------------------------------

    def start(self) -> None:
        """Start (or adopt) the daemon and wait until it answers; then supervise it.

        Raises:
            MpsSetupError: missing binary, ``multiuser = "on"`` unsupported, unusable directories.
            MpsError: the daemon did not answer within ``mps.ready_timeout_s``.
        """
        with self._lock:
            if self._started:
                return
            self._stop.clear()
            self._multiuser = self._decide_multiuser()
            self._prepare_dirs()
            self._set_compute_mode()
            self._state = MpsState.STARTING
            try:
                if self._answers():
                    self._adopted = True
                    self._log.warning("mps_daemon_adopted", pipe_dir=str(self.pipe_dir))
                else:
                    self._spawn()
                    self._wait_ready()
                self._apply_defaults()
            except BaseException:
                self._kill_child()
                self._restore_compute_mode()
                self._state = MpsState.DOWN
                raise
            self._state = MpsState.UP
            self._started = True
            self._emit(MpsEvent(MpsEventKind.DAEMON_STARTED, self.gpu_uuid, self._clock(),
                                "adopted" if self._adopted else "started",
                                server_pid=None))  # fmt: skip
            self._health = threading.Thread(
                target=self._health_loop, name=f"mps-health-{self.gpu_uuid[:12]}", daemon=True
            )
            self._health.start()
        self._log.info("mps_daemon_ready", pid=self.child_pid, adopted=self._adopted,
                       multiuser=self._multiuser)  # fmt: skip

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Stop supervising; with ``quit_daemon`` also stop the daemon and clean its pipe directory.

        ``quit -t <quit_timeout>`` first; the daemon is killed if it has not exited shortly after
        that timeout. Without ``quit_daemon`` the daemon keeps running for its clients and a later
        :meth:`start` adopts it.
        """
        self._stop.set()
        self._wake.set()
        health = self._health
        if health is not None and health is not threading.current_thread():
            health.join()
        with self._lock:
            if not self._started and self._proc is None:
                return
            if quit_daemon:
                self._quit_daemon()
                self._remove_pipe_entries()
                self._restore_compute_mode()
            else:
                self._detach()
            self._state = MpsState.DOWN
            self._started = False
            self._adopted = False
        self._log.info("mps_daemon_stopped", quit=quit_daemon)

    # Recovery --------------------------------------------------------------------------------

    def recover(
        self,
        offline_pids: Sequence[int] = (),
        online_pids: Sequence[int] = (),
        *,
        wait_s: float | None = None,
    ) -> bool:
        """Recover a faulted server: offline clients terminated first, then the rest.

        Finds the server in FAULT (``get_server_status`` where the daemon has it, else the servers
        named by ``FATAL_EXCEPTION`` events), runs ``terminate_client`` on its offline clients, then
        on its online and remaining clients, then waits for ACTIVE; where that cannot be observed or
        does not come in time the server is shut down (``-f``) so the next client starts a fresh
        one. Every step is logged and emitted as ``RECOVERY_STEP``.

        Returns:
            True when no faulted server is left.
        """
        wait = self.config.mps.ready_timeout_s if wait_s is None else wait_s
        ctl = self.control
        try:
            servers = ctl.get_server_list()
        except MpsError as exc:
            self._step("recovery_failed", f"cannot list servers: {exc}")
            return False
        has_status = True
        faulted: list[int] = []
        for spid in servers:
            try:
                if ctl.get_server_status(spid) is ServerStatus.FAULT:
                    faulted.append(spid)
            except UnknownCommand:
                has_status = False
                break
            except MpsError as exc:
                self._step("status_unreadable", f"server {spid}: {exc}", server_pid=spid)
        if not has_status:
            with self._fault_lock:
                named = set(self._faulted_servers)
            faulted = [s for s in servers if s in named or (None in named)]
        if not faulted:
            self._step("no_faulted_server", f"servers {list(servers)}: none in FAULT")
            with self._fault_lock:
                self._fault = False
                self._faulted_servers.clear()
            return True
        ok = True
        for spid in faulted:
            ok = self._recover_server(spid, offline_pids, online_pids, has_status, wait) and ok
        if ok:
            with self._fault_lock:
                self._fault = False
                self._faulted_servers.clear()
        return ok

    def _recover_server(
        self,
        spid: int,
        offline_pids: Sequence[int],
        online_pids: Sequence[int],
        has_status: bool,
        wait_s: float,
    ) -> bool:
        ctl = self.control
        self._step("server_faulted", f"server {spid} in FAULT", server_pid=spid)
        try:
            clients = set(ctl.get_client_list(spid))
        except MpsError as exc:
            self._step("clients_unreadable", f"server {spid}: {exc}", server_pid=spid)
            clients = set(offline_pids) | set(online_pids)
        order = [p for p in offline_pids if p in clients]
        order += [p for p in online_pids if p in clients and p not in order]
        order += sorted(clients - set(order))
        for cpid in order:
            which = (
                "offline"
                if cpid in offline_pids
                else "online"
                if cpid in online_pids
                else "unknown"
            )
            try:
                ctl.terminate_client(spid, cpid)
                self._step(
                    "client_terminated", f"{which} client {cpid}", server_pid=spid, client_pid=cpid
                )
            except MpsError as exc:
                self._step(
                    "terminate_failed",
                    f"{which} client {cpid}: {exc}",
                    server_pid=spid,
                    client_pid=cpid,
                )
        if has_status:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not self._stop.is_set():
                try:
                    if ctl.get_server_status(spid) is ServerStatus.ACTIVE:
                        self._step(
                            "server_active", f"server {spid} back to ACTIVE", server_pid=spid
                        )
                        return True
                except ServerNotFound:
                    self._step("server_gone", f"server {spid} exited", server_pid=spid)
                    return True
                except MpsError as exc:
                    self._step("status_unreadable", str(exc), server_pid=spid)
                self._stop.wait(0.1)
        try:
            ctl.shutdown_server(spid, force=True)
            self._step("server_shutdown", f"server {spid} shut down (-f); the next client starts a new one",
                       server_pid=spid)  # fmt: skip
        except ServerNotFound:
            self._step("server_gone", f"server {spid} already exited", server_pid=spid)
            return True
        except MpsError as exc:
            self._step("shutdown_failed", f"server {spid}: {exc}", server_pid=spid)
            return False
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                if spid not in ctl.get_server_list():
                    self._step("server_gone", f"server {spid} exited", server_pid=spid)
                    return True
            except MpsError as exc:
                self._step("server_list_unreadable", str(exc), server_pid=spid)
            self._stop.wait(0.05)
        self._step(
            "server_still_running", f"server {spid} did not exit within {wait_s}s", server_pid=spid
        )
        return False

    def _step(
        self,
        step: str,
        detail: str,
        *,
        server_pid: int | None = None,
        client_pid: int | None = None,
    ) -> None:
        self._log.info("mps_recovery_step", step=step, detail=detail, server_pid=server_pid,
                       client_pid=client_pid)  # fmt: skip
        self._emit(MpsEvent(MpsEventKind.RECOVERY_STEP, self.gpu_uuid, self._clock(),
                            f"{step}: {detail}", server_pid=server_pid,
                            client_pid=client_pid))  # fmt: skip

    def server_of(self, client_pid: int) -> int | None:
        """The server a client is connected to, or None."""
        for spid in self.control.get_server_list():
            with contextlib.suppress(ServerNotFound):
                if client_pid in self.control.get_client_list(spid):
                    return spid
        return None

    # Internals: set-up -----------------------------------------------------------------------

    def _decide_multiuser(self) -> bool:
        mode = self.config.mps.multiuser
        if mode == "off":
            return False
        supported = supports_multiuser(self.config.mps.control_binary)
        is_root = os.geteuid() == 0
        if mode == "on":
            if not supported:
                raise MpsSetupError(
                    f'mps.multiuser = "on" but {self.config.mps.control_binary} has no '
                    '-multiuser-server option (R535 lacks it); set mps.multiuser = "auto" or "off", '
                    "or install a driver whose MPS has it (R555+)"
                )
            if not is_root:
                raise MpsSetupError(
                    'mps.multiuser = "on" needs gpushare to run as root (only root may enable '
                    '-multiuser-server); run as root or set mps.multiuser = "auto"'
                )
            return True
        return supported and is_root

    def _prepare_dirs(self) -> None:
        for d in (self.pipe_dir, self.log_dir):
            try:
                d.mkdir(parents=True, exist_ok=True)
                # Servers run under each client's uid and must traverse these (a 0700 directory
                # makes a setuid'd server crash-loop: bottlerocket-os/bottlerocket#4673).
                d.chmod(0o755)
            except OSError as exc:
                raise MpsSetupError(
                    f"cannot create {d} with mode 0755: {exc.strerror or exc}; fix the permissions "
                    "or set paths.mps_pipe_dir / paths.mps_log_dir"
                ) from exc

    def _set_compute_mode(self) -> None:
        if self.config.mps.compute_mode != "exclusive_process":
            return
        if self._compute is None:
            self._log.warning(
                "mps_compute_mode_skipped", reason="no NVML compute-mode access given"
            )
            return
        try:
            prev = self._compute.get_compute_mode(self.gpu_uuid)
            if prev != EXCLUSIVE_PROCESS:
                self._compute.set_compute_mode(self.gpu_uuid, EXCLUSIVE_PROCESS)
                self._prev_mode = prev
                self._log.info("mps_compute_mode_set", mode=EXCLUSIVE_PROCESS, previous=prev)
        # The adapter may raise anything NVML raises; MPS still works without the mode.
        except Exception as exc:  # noqa: BLE001
            self._log.warning("mps_compute_mode_failed", error=str(exc))

    def _restore_compute_mode(self) -> None:
        prev, self._prev_mode = self._prev_mode, None
        if prev is None or self._compute is None:
            return
        try:
            self._compute.set_compute_mode(self.gpu_uuid, prev)
            self._log.info("mps_compute_mode_restored", mode=prev)
        except Exception as exc:  # noqa: BLE001 - as in _set_compute_mode
            self._log.warning("mps_compute_mode_restore_failed", mode=prev, error=str(exc))

    def _daemon_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _DAEMON_ENV_DROP}
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(self.pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(self.log_dir)
        env["CUDA_VISIBLE_DEVICES"] = self.gpu_uuid
        env["LC_ALL"] = "C"
        path: list[str] = list(self._extra_path)
        binary = Path(self.config.mps.control_binary)
        if binary.is_absolute():
            # A package unpacked elsewhere keeps the server in ../sbin next to bin/.
            path += [str(binary.parent), str(binary.parent.parent / "sbin")]
        path += [
            p
            for p in env.get(
                "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
            ).split(":")
            if p
        ]
        env["PATH"] = ":".join(dict.fromkeys(path))
        return env

    # Internals: the child --------------------------------------------------------------------

    def _answers(self) -> bool:
        try:
            self.control.get_default_active_thread_percentage()
        except DaemonNotReachable:
            return False
        return True

    def _remove_pipe_entries(self) -> None:
        for name in PIPE_ENTRIES:
            with contextlib.suppress(FileNotFoundError):
                (self.pipe_dir / name).unlink()

    def _spawn(self) -> None:
        self._prepare_dirs()  # the pipe directory may have been removed under a running daemon
        self._remove_pipe_entries()  # stale sockets/FIFO of a dead daemon
        argv = [self.config.mps.control_binary, "-f"]
        if self._multiuser:
            argv.append("-multiuser-server")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self._daemon_env(),
                cwd="/",
                # Its own session: a Ctrl-C or SIGTERM to gpushare's process group must not kill MPS
                # under running clients; gpushare stops it with quit.
                start_new_session=True,
            )
        except OSError as exc:
            raise MpsSetupError(
                f"cannot start {argv[0]}: {exc.strerror or exc}; install nvidia-cuda-mps or set "
                "mps.control_binary (tests: scripts/get-mps-control.sh)"
            ) from exc
        self._proc = proc
        self._adopted = False
        self._ui_reply = False
        self._reader_stop = threading.Event()
        assert proc.stdout is not None
        self._reader = threading.Thread(
            target=self._read_loop,
            args=(proc, proc.stdout.fileno(), self._reader_stop),
            name=f"mps-out-{self.gpu_uuid[:12]}",
            daemon=True,
        )
        self._reader.start()
        self._log.info("mps_daemon_spawned", pid=proc.pid, argv=argv)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.mps.ready_timeout_s
        last: MpsError | None = None
        while True:
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                raise DaemonNotReachable(
                    f"the MPS control daemon exited with status {proc.returncode} before answering "
                    f"(another daemon on {self.pipe_dir}? see the mps_daemon_output log lines)"
                )
            if self._started and self._stop.is_set():
                raise DaemonNotReachable("supervisor stopping")
            try:
                self.control.get_default_active_thread_percentage()
            except DaemonNotReachable as exc:
                last = exc
            else:
                return
            if time.monotonic() >= deadline:
                raise DaemonNotReachable(
                    f"the MPS control daemon on {self.pipe_dir} did not answer within "
                    f"{self.config.mps.ready_timeout_s}s: {last}"
                )
            time.sleep(0.01)

    def _apply_defaults(self) -> None:
        ctl = self.control
        ctl.set_default_active_thread_percentage(self._default_pct)
        for dev, limit in self._pinned.items():
            ctl.set_default_device_pinned_mem_limit(dev, limit)
        if self._priority is not None:
            ctl.set_default_client_priority(self._priority)
        self._log.debug("mps_defaults_applied", pct=self._default_pct, pinned=self._pinned,
                        priority=self._priority)  # fmt: skip

    def _kill_child(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self._join_reader()
        self._proc = None

    def _join_reader(self) -> None:
        reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5)
        self._reader = None

    def _quit_daemon(self) -> None:
        timeout = self.config.mps.quit_timeout_s
        try:
            self.control.quit(timeout)
        except MpsError as exc:
            self._log.warning("mps_quit_failed", error=str(exc))
        proc = self._proc
        if proc is not None:
            try:
                # quit -t forces servers down after the timeout; give the daemon a moment more.
                proc.wait(timeout=timeout + 2.0)
            except subprocess.TimeoutExpired:
                self._log.warning("mps_quit_timeout_kill", pid=proc.pid)
            self._kill_child()
            if proc.returncode is not None:
                self._emit(MpsEvent(MpsEventKind.DAEMON_EXITED, self.gpu_uuid, self._clock(),
                                    "stopped", status=proc.returncode))  # fmt: skip
            return
        # An adopted daemon is not our child: wait until it stops answering.
        deadline = time.monotonic() + timeout + 2.0
        while time.monotonic() < deadline and self._answers():
            time.sleep(0.05)

    def _detach(self) -> None:
        proc = self._proc
        self._proc = None
        # Stop the reader before closing its pipe: closing a file another thread reads blocks.
        self._reader_stop.set()
        self._join_reader()
        if proc is not None and proc.stdout is not None:
            # The daemon survives a closed stdout (checked on R535) and goes on serving clients.
            with contextlib.suppress(OSError):
                proc.stdout.close()

    # Internals: output and events ------------------------------------------------------------

    def _read_loop(self, proc: subprocess.Popen[bytes], fd: int, stop: threading.Event) -> None:
        pending = b""
        while not stop.is_set():
            try:
                ready, _, _ = select.select([fd], [], [], 0.1)
                if not ready:
                    continue
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                self._handle_line(raw.decode("utf-8", errors="replace"))
        if pending and not stop.is_set():
            self._handle_line(pending.decode("utf-8", errors="replace"))
        # EOF: the daemon exited; let the health thread look now.
        if proc is self._proc:
            self._wake.set()

    def _handle_line(self, line: str) -> None:
        text = line.rstrip("\r\n")
        if not text:
            return
        self._log.debug("mps_daemon_output", line=text)
        parsed = parse_log_line(text)
        if parsed is not None and parsed.message in CHATTER:
            self._ui_reply = False
            return
        if parsed is not None and parsed.message.startswith(_CHATTER_PREFIXES):
            return
        event = event_from_line(text, self.gpu_uuid, self._clock())
        kind = event.kind
        if kind is MpsEventKind.COMMAND:
            self._ui_reply = True
            if event.text.split()[:1] == [HEALTH_COMMAND]:
                return  # the supervisor's own probe, every health period
        elif (
            kind is MpsEventKind.RAW
            and self._ui_reply
            and parsed is not None
            and parsed.component == "Control"
        ):
            return  # the reply to a front-end command, already returned to its caller
        elif kind in (MpsEventKind.DAEMON_STARTED, MpsEventKind.DAEMON_EXITED):
            return  # the supervisor emits these itself, with its own view of the process
        elif kind is MpsEventKind.FATAL_EXCEPTION:
            with self._fault_lock:
                self._fault = True
                self._faulted_servers.add(event.server_pid)
            self._log.error("mps_server_fault", server_pid=event.server_pid)
        self._emit(event)

    def _emit(self, event: MpsEvent) -> None:
        # No lifecycle lock here: stop() holds it while it joins the reader thread that emits.
        self._events.append(event)
        for callback in self._subscribers:
            try:
                callback(event)
            except Exception as exc:  # noqa: BLE001 - one bad subscriber must not stop the stream
                self._log.warning("mps_subscriber_failed", error=str(exc))

    # Internals: health and restart -----------------------------------------------------------

    def _backoff(self, attempt: int) -> float:
        cfg = self.config.mps
        return float(
            min(cfg.restart_backoff_max_s, cfg.restart_backoff_min_s * (2 ** min(attempt, 30)))
        )

    def _health_loop(self) -> None:
        period = self.config.mps.health_period_s
        while not self._stop.is_set():
            self._wake.wait(period)
            self._wake.clear()
            if self._stop.is_set():
                return
            reason = self._check()
            if reason is None:
                self._failures = 0
                continue
            self._restart(reason)

    def _check(self) -> str | None:
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            return f"exited with status {proc.returncode}"
        if not self._adopted and proc is None:
            return "not running"
        try:
            self.control.get_default_active_thread_percentage()
        except CommandTimeout:
            return "not answering (timeout)"
        except DaemonNotReachable as exc:
            return f"not reachable: {exc}"
        except MpsError as exc:
            # It answered, just oddly: alive.
            self._log.warning("mps_health_odd_reply", error=str(exc))
        return None

    def _restart(self, reason: str) -> None:
        self._log.error("mps_daemon_unhealthy", reason=reason, pid=self.child_pid)
        with self._lock:
            proc = self._proc
            status = proc.poll() if proc is not None else None
            self._kill_child()
            self._state = MpsState.DOWN
            with self._fault_lock:
                self._fault = False
                self._faulted_servers.clear()
        self._emit(MpsEvent(MpsEventKind.DAEMON_EXITED, self.gpu_uuid, self._clock(), reason,
                            status=status))  # fmt: skip
        while not self._stop.is_set():
            delay = self._backoff(self._failures)
            self._failures += 1
            if self._stop.wait(delay):
                return
            with self._lock:
                if self._stop.is_set():
                    return
                self._state = MpsState.STARTING
                try:
                    self._spawn()
                    self._wait_ready()
                    self._apply_defaults()
                except MpsError as exc:
                    self._log.error("mps_restart_failed", error=str(exc), attempt=self._failures,
                                    next_delay_s=self._backoff(self._failures))  # fmt: skip
                    self._kill_child()
                    self._state = MpsState.DOWN
                    continue
                self._state = MpsState.UP
                self.restarts += 1
            self._log.warning("mps_daemon_restarted", pid=self.child_pid, reason=reason,
                              attempt=self._failures)  # fmt: skip
            self._emit(
                MpsEvent(MpsEventKind.DAEMON_RESTARTED, self.gpu_uuid, self._clock(), reason)
            )
            return


# --------------------------------------------------------------------------------------------
# The node-wide manager (gpushare.node.base.MpsNode)


class MpsNodeManager:
    """One :class:`MpsSupervisor` per shared GPU; implements :class:`gpushare.node.base.MpsNode`."""

    #: What answers MPS commands (``gpus[].mps_backend`` in ``gpushare status --json``).
    backend = "real"

    def __init__(
        self,
        config: Config,
        gpu_uuids: Iterable[str],
        *,
        extra_path: Sequence[str | Path] = (),
        compute_mode: ComputeModeControl | None = None,
        pinned_limits: Mapping[int | str, int | str] | None = None,
        client_priority: int | None = None,
        supervisor_factory: Callable[[str], MpsSupervisor] | None = None,
    ) -> None:
        """Build stopped supervisors for ``gpu_uuids`` (callers pass only the shared GPUs).

        ``pinned_limits`` and ``client_priority`` are the defaults every GPU's daemon gets (see
        :class:`MpsSupervisor`); ``supervisor_factory`` replaces the construction entirely.

        Raises:
            InvalidValue: a bad default. MpsSetupError: a pipe directory path too long.
        """
        self.config = config

        def default_factory(uuid: str) -> MpsSupervisor:
            return MpsSupervisor(
                uuid,
                config,
                extra_path=extra_path,
                compute_mode=compute_mode,
                pinned_limits=pinned_limits,
                client_priority=client_priority,
            )

        factory = supervisor_factory or default_factory
        self.supervisors: dict[str, MpsSupervisor] = {
            u: factory(u) for u in dict.fromkeys(gpu_uuids)
        }
        self._recoveries: dict[str, threading.Thread] = {}

    def _sup(self, gpu_uuid: str) -> MpsSupervisor:
        try:
            return self.supervisors[gpu_uuid]
        except KeyError:
            known = ", ".join(self.supervisors) or "none"
            raise KeyError(f"GPU {gpu_uuid} has no MPS daemon (shared GPUs: {known})") from None

    def start(self) -> None:
        """Start every GPU's daemon; on a failure the ones already started are stopped again.

        Raises:
            MpsError: a daemon could not be started (the message names the GPU).
        """
        started: list[MpsSupervisor] = []
        for uuid, sup in self.supervisors.items():
            try:
                sup.start()
            except MpsError:
                log.exception("mps_start_failed", gpu=uuid)
                for done in started:
                    done.stop()
                raise
            started.append(sup)

    def stop(self, *, quit_daemon: bool = True) -> None:
        """Stop every supervisor (see :meth:`MpsSupervisor.stop`) and wait out any recovery."""
        for sup in self.supervisors.values():
            sup.stop(quit_daemon=quit_daemon)
        # A stopped supervisor ends its recovery's waits at once; what is left is one command.
        for uuid in list(self._recoveries):
            self.wait_recovery(uuid, self.config.mps.ready_timeout_s)

    def pipe_dir(self, gpu_uuid: str) -> Path:
        """The ``CUDA_MPS_PIPE_DIRECTORY`` clients of this GPU must use."""
        return self._sup(gpu_uuid).pipe_dir

    def state(self, gpu_uuid: str) -> MpsState:
        """Health of the GPU's control daemon and server."""
        return self._sup(gpu_uuid).state()

    def drain_events(self, gpu_uuid: str) -> Sequence[MpsEvent]:
        """Events since the last call."""
        return self._sup(gpu_uuid).drain_events()

    def terminate_client(self, gpu_uuid: str, client_pid: int) -> bool:
        """``terminate_client`` on the server the client is connected to; True on success."""
        sup = self._sup(gpu_uuid)
        try:
            spid = sup.server_of(client_pid)
            if spid is None:
                log.warning("mps_terminate_no_server", gpu=gpu_uuid, client_pid=client_pid)
                return False
            sup.control.terminate_client(spid, client_pid)
        except MpsError as exc:
            log.warning("mps_terminate_failed", gpu=gpu_uuid, client_pid=client_pid, error=str(exc))
            return False
        log.info("mps_client_terminated", gpu=gpu_uuid, client_pid=client_pid, server_pid=spid)
        return True

    def recover(
        self, gpu_uuid: str, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        """Start recovering a FAULTed server (offline clients first) on a worker; return at once.

        :meth:`MpsSupervisor.recover` waits up to ``mps.ready_timeout`` twice for the server; run
        inline it would stop the daemon's loop, and so the control of every other GPU and the
        killing of this GPU's offline processes that the recovery waits for. The GPU reads FAULT
        until the recovery clears it. A request while one runs for the GPU is logged and ignored.
        """
        sup = self._sup(gpu_uuid)
        running = self._recoveries.get(gpu_uuid)
        if running is not None and running.is_alive():
            log.info("mps_recovery_in_progress", gpu=gpu_uuid)
            return
        worker = threading.Thread(
            target=self._recover_on_worker,
            args=(sup, tuple(offline_pids), tuple(online_pids)),
            name=f"mps-recover-{gpu_uuid}",
            daemon=True,
        )
        self._recoveries[gpu_uuid] = worker
        worker.start()

    @staticmethod
    def _recover_on_worker(
        sup: MpsSupervisor, offline_pids: Sequence[int], online_pids: Sequence[int]
    ) -> None:
        try:
            ok = sup.recover(offline_pids, online_pids)
        except Exception:  # a worker's crash must be logged, not lost with the thread
            log.exception("mps_recovery_crashed", gpu=sup.gpu_uuid)
            return
        log.info("mps_recovery_finished", gpu=sup.gpu_uuid, ok=ok)

    def wait_recovery(self, gpu_uuid: str, timeout_s: float) -> bool:
        """Wait for the GPU's running recovery, if any; False when it is still running."""
        worker = self._recoveries.get(gpu_uuid)
        if worker is None:
            return True
        worker.join(timeout_s)
        return not worker.is_alive()
