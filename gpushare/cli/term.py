"""Writing to the terminal: output that stops quietly when its reader goes away, and colour.

``gpushare status | head -1`` closes the pipe after one line; the rest of the output then has
nowhere to go. :func:`emit` ends the command quietly with :data:`~gpushare.cli.exitcodes.CLOSED_PIPE`
(like a program killed by SIGPIPE) instead of a ``BrokenPipeError`` traceback. Colour is used only
on a terminal and never with ``NO_COLOR`` set (https://no-color.org).
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

from gpushare.cli.exitcodes import CLOSED_PIPE


def closed_pipe() -> SystemExit:
    """Point stdout at /dev/null (so the interpreter's last flush is quiet) and exit 141."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass  # stdout has no descriptor (a test's capture): nothing will flush there
    return SystemExit(CLOSED_PIPE)


def emit(text: str, *, end: str = "\n", stream: TextIO | None = None) -> None:
    """Write a line (or a block) to stdout and flush it; a closed pipe ends the command quietly."""
    out = stream or sys.stdout
    try:
        out.write(text + end)
        out.flush()
    except BrokenPipeError:
        raise closed_pipe() from None


def use_colour(stream: TextIO | None = None) -> bool:
    """Colour only on a terminal, never with ``NO_COLOR`` set, never on a dumb terminal."""
    out = stream or sys.stdout
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False
