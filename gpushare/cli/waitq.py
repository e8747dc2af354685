"""A foreground ``gpushare submit`` waiting in the queue: its progress line, and daemon restarts.

The queued job is kept by the daemon across a restart (its record is in the registry), and the
daemon gives a foreground job whose submitter has not asked since the restart
:data:`gpushare.daemon.submitq.WAITER_GRACE_S` (30 s) to ask again. So a waiting submit that finds
the daemon gone does not exit: it says so on its progress line, tries the socket again with a
growing pause (at most :data:`RECONNECT_PAUSE_S` apart, well inside that grace) for up to
:data:`RECONNECT_FOR_S`, and then goes on waiting for the same client id.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import typer

from gpushare import protocol
from gpushare.client import ApiClient, ApiError, DaemonAccessError, DaemonUnreachableError
from gpushare.units import format_duration

WAIT_POLL_S = 1.0
"""How often a foreground submit waiting in the queue asks the daemon (it keeps its place
while it asks: gpushare/daemon/submitq.py)."""

RECONNECT_PAUSE_S = (0.2, 2.0)
"""The first and the longest pause between two tries to reach a daemon that went away."""

RECONNECT_FOR_S = 120.0
"""How long a waiting submit tries to reach the daemon again before it gives up (exit 3)."""

_TRANSIENT = (protocol.ErrorCode.BUSY,)  # the socket's connections all taken for now: try again


def queued_line(result: dict[str, Any]) -> str:
    """``c7 queued (position 2): GPU 0: needs 6G ...``: what a queued submit prints."""
    where = f" (position {result['position']})" if result.get("position") else ""
    why = f": {result['waiting']}" if result.get("waiting") else ""
    return f"{result['client_id']} queued{where}{why}"


class _Progress:
    """The one progress line on stderr: redrawn on a terminal, a line per change through a pipe."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self._shown = ""

    def show(self, text: str, elapsed_s: float) -> None:
        line = f"{text} (waiting {format_duration(int(elapsed_s))})"  # whole seconds
        if self.tty:
            sys.stderr.write("\r\x1b[K" + line[: shutil.get_terminal_size().columns - 1])
            sys.stderr.flush()
        elif text != self._shown:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        self._shown = text

    def end(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[K")


def _fail(message: str, code: int) -> typer.Exit:
    sys.stderr.write(f"\n{message}\n" if sys.stderr.isatty() else f"{message}\n")
    return typer.Exit(code=code)


def ask(
    socket: str | None,
    params: dict[str, Any],
    restarting: Callable[[], None],
    *,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """One ``submit`` call of a waiting submit; while the daemon cannot be reached, tries again.

    Args:
        socket: the API socket (None: the default).
        params: the request (``wait_for`` the queued client).
        restarting: called before each pause while the daemon is away (the progress line).
        sleep: the pause (tests pass their own).

    Raises:
        typer.Exit: the daemon answered with an error, refuses this user, or stayed away for
            :data:`RECONNECT_FOR_S`.
    """
    pause, away_since = RECONNECT_PAUSE_S[0], None
    while True:
        try:
            with ApiClient.connect(socket) as api:
                result: dict[str, Any] = api.call(protocol.SUBMIT, params)
                return result
        except DaemonAccessError as exc:
            raise _fail(str(exc), exc.exit_code) from None
        except DaemonUnreachableError as exc:
            reason: str = str(exc)
            code = exc.exit_code
        except ApiError as exc:
            if exc.code not in _TRANSIENT:
                raise _fail(f"gpushare: {exc.message}", exc.code.exit_code()) from None
            reason, code = f"gpushare: {exc.message}", exc.code.exit_code()
        now = time.monotonic()
        away_since = now if away_since is None else away_since
        if now - away_since >= RECONNECT_FOR_S:
            raise _fail(
                f"{reason} (tried again for {format_duration(RECONNECT_FOR_S)}; "
                f"{params['wait_for']} leaves the queue once the daemon sees no one waits for it)",
                code,
            )
        restarting()
        sleep(pause)
        pause = min(pause * 2, RECONNECT_PAUSE_S[1])


def wait_in_queue(socket: str | None, result: dict[str, Any]) -> dict[str, Any]:
    """Wait in the queue, one progress line on stderr, until the daemon starts the job here.

    A daemon that restarts meanwhile is waited for (module docstring). Ctrl-C takes the job out
    of the queue (exit 130).
    """
    client_id = result["client_id"]
    progress = _Progress()
    t0 = time.monotonic()
    params = {"cls": "offline", "argv": ["-"], "wait_for": client_id}
    restarting = f"{client_id} queued: daemon restarting, reconnecting..."
    try:
        while result["state"] == "queued":
            progress.show(queued_line(result), time.monotonic() - t0)
            time.sleep(WAIT_POLL_S)
            result = ask(socket, params, lambda: progress.show(restarting, time.monotonic() - t0))
    except KeyboardInterrupt:
        with (
            contextlib.suppress(DaemonUnreachableError, ApiError),
            ApiClient.connect(socket) as api,
        ):
            api.call(protocol.CANCEL, {"client_id": client_id})
        sys.stderr.write(f"\n{client_id}: left the queue\n")
        raise typer.Exit(code=130) from None
    progress.end()
    sys.stderr.write(f"{client_id}: started on {result['gpu_uuid']}\n")
    return result
