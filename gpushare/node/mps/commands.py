"""The command adapter: :class:`MpsControl`, one typed method per control command, and the binary.

:class:`MpsControl` wraps each Legacy (v2) control command of one control daemon (one pipe
directory) as a typed method. The front end exits 0 even when it rejects a command, so every
reply is read and each known error string becomes an :class:`~gpushare.node.mps.errors.MpsError`
subclass. One command per invocation (replies to several cannot be told apart), a timeout on every
call, values validated before they are sent (the ``check_*`` functions), and echoed values
compared with the request (an invalid percentage makes the daemon print the *unchanged* value).

The binary itself is looked up, version-read and probed here too (:func:`find_binary`,
:func:`binary_status`, :func:`supports_multiuser`). Short commands go through
:func:`gpushare.node.exec.run`.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from gpushare import trust
from gpushare.node.exec import run
from gpushare.node.mps.errors import (
    CommandFailed,
    CommandTimeout,
    DaemonNotReachable,
    InvalidValue,
    MpsParseError,
    MpsSetupError,
    ServerNotFound,
)
from gpushare.node.mps.parse import (
    GIB,
    MIB,
    DeviceClients,
    LspartRow,
    PsRow,
    ServerStatus,
    parse_device_client_list,
    parse_error,
    parse_lspart,
    parse_mps_size,
    parse_pct,
    parse_pid_list,
    parse_priority,
    parse_ps,
    parse_server_status,
    parse_terminate_status,
)

log = structlog.get_logger(__name__)

SERVER_BINARY = "nvidia-cuda-mps-server"
CONTROL_ROLE = "the MPS control binary"
SERVER_ROLE = "the MPS server binary"
"""How :mod:`gpushare.trust` names the two binaries in its lines and its refusal counter."""
#: The command the supervisor's health check and :func:`binary_status` send (harmless, read-only).
HEALTH_COMMAND = "get_default_active_thread_percentage"
# Variables the control daemon reads as its own defaults: a stale value from the caller's
# environment would override the configured defaults or stop the daemon from starting.
DAEMON_ENV_DROP = (
    "NOTIFY_SOCKET",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_CLIENT_PRIORITY",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_PROTOCOL_VERSION",
)
_T = TypeVar("_T")


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
        if size < MIB:
            raise InvalidValue(
                f"pinned memory limit must be at least 1M (1048576 bytes), got {size}"
            )
        if size % GIB == 0:
            return f"{size // GIB}G"
        return f"{size // MIB}M"
    if isinstance(size, str) and _MPS_SIZE_RE.match(size):
        return size
    raise InvalidValue(
        f"pinned memory limit must be written <int>M or <int>G (e.g. 512M, 2G), got {size!r}"
    )


def mps_size_bytes(spelling: str) -> int:
    """Bytes of a valid ``<int>M|G`` spelling (see :func:`check_mps_size`)."""
    number, unit = spelling[:-1], spelling[-1]
    return int(number) * (GIB if unit == "G" else MIB)


def expected_readback(num_bytes: int) -> int:
    """What the getter prints for a limit: whole GiB when >= 1 GiB (floored), else MiB [obs535]."""
    return (num_bytes // GIB) * GIB if num_bytes >= GIB else (num_bytes // MIB) * MIB


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
        env = {k: v for k, v in os.environ.items() if k not in DAEMON_ENV_DROP}
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
        # Root runs the front end at every command (the health check: every few seconds), so a
        # binary swapped after start by a user who can write a directory above it is refused.
        found = find_binary(self.control_binary)
        if found is not None and (why := trust.refusal(found, what=CONTROL_ROLE)) is not None:
            raise MpsSetupError(f"refusing to run it: {why}", command=line)
        binary = found or self.control_binary  # missing: the error below names the fix
        try:
            done = run([binary], input=line + "\n", timeout_s=timeout, env=self._env())
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
# The binary


def find_binary(control_binary: str | Path, path: str | None = None) -> str | None:
    """Where ``mps.control_binary`` resolves (an absolute path, or a name on PATH); None if absent.

    The one lookup :func:`binary_status`, ``gpushare doctor`` and the daemon share; ``path`` is
    the search path (default: ``$PATH``).
    """
    return shutil.which(str(control_binary), path=path)


def binary_refusal(control_binary: str | Path, path: str | None = None) -> str | None:
    """Why root may not run the control binary or the server it starts (:mod:`gpushare.trust`).

    None when both are trusted or are not found (a missing binary has its own error). ``path`` is
    the search path the control daemon gets, where it finds ``nvidia-cuda-mps-server``.
    """
    control = find_binary(control_binary, path)
    server = shutil.which(SERVER_BINARY, path=path)
    for role, found in ((CONTROL_ROLE, control), (SERVER_ROLE, server)):
        if found is not None and (why := trust.refusal(found, what=role)) is not None:
            return why
    return None


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
    no daemon there (NVIDIA's MPS documentation, docs/sources.md), which proves it executes on this host.
    """
    path = find_binary(control_binary)
    if path is None:
        return False, f"{control_binary} not found (PATH or absolute path)", ""
    # Not run at all when untrusted: doctor runs as root too.
    if (why := binary_refusal(path)) is not None:
        return False, why, "the daemon refuses to start MPS with it"
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
