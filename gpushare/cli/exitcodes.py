"""The CLI's exit statuses, in one place: the README's table and the ``--help`` epilog come from here.

No Typer here: the fast path (:mod:`gpushare.cli.fast`) uses these numbers too.
"""

from __future__ import annotations

from gpushare import protocol

OK = 0
FAILED = 1
BAD_INPUT = 2
UNREACHABLE = protocol.EXIT_UNREACHABLE
PERMISSION_DENIED = protocol.EXIT_PERMISSION_DENIED
NO_CAPACITY = protocol.EXIT_NO_CAPACITY
CANNOT_EXECUTE = 126
NOT_FOUND = 127
INTERRUPTED = 130
CLOSED_PIPE = 141

EXIT_CODES: dict[int, str] = {
    OK: "success",
    FAILED: "the operation failed (status: a shared GPU's MPS is down; doctor: a check failed)",
    BAD_INPUT: "bad usage or bad input (nothing was changed)",
    UNREACHABLE: "the daemon is not reachable (no socket, nobody listening, or no answer)",
    PERMISSION_DENIED: "permission denied (the socket's mode, or another user's client)",
    NO_CAPACITY: "no capacity: no GPU can hold the job now (an --offline job queues instead)",
    CANNOT_EXECUTE: "submit (foreground): the command was found but cannot be run",
    NOT_FOUND: "submit (foreground): the command was not found",
    INTERRUPTED: "interrupted (Ctrl-C)",
    CLOSED_PIPE: "status, list, events: the reader of the output went away (e.g. head -1 in a pipe)",
}
"""Every exit status a ``gpushare`` command can end with, and what it means."""


def epilog() -> str:
    """The exit-status table at the end of ``gpushare --help`` (click keeps its lines as they are)."""
    lines = [f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items()]
    return "\b\nExit status:\n" + "\n".join(lines)
