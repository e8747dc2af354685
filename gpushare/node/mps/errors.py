"""The errors of the MPS adapter: one :class:`MpsError` subclass per kind of reply or failure.

The reply texts that map to each class are in :mod:`gpushare.node.mps.parse` (``parse_error``).
"""

from __future__ import annotations


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
