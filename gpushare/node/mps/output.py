"""The control daemon's output, read line by line on the supervisor's reader thread.

:func:`read_output` sleeps in ``select`` until the daemon writes or the supervisor wakes it
through a pipe (no polling), splits what arrives into lines and hands each to ``on_line``
(:meth:`~gpushare.node.mps.supervisor.MpsSupervisor._handle_line` turns them into events).
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable


def read_output(fd: int, stop: threading.Event, wake: int, on_line: Callable[[str], None]) -> None:
    """Read ``fd`` until EOF, an error, ``stop``, or the supervisor closing its end of ``wake``.

    Closes ``wake`` (the read end of the wake-up pipe) before it returns. The last partial line is
    handed over at EOF, unless ``stop`` is set.
    """
    pending = b""
    try:
        while not stop.is_set():
            try:
                # The timeout only bounds a lost wake-up; stop comes through ``wake``.
                ready, _, _ = select.select([fd, wake], [], [], 5.0)
                if wake in ready:
                    if not os.read(wake, 64):
                        break  # the supervisor closed its end: it is done with this reader
                    continue  # woken: the loop condition looks at stop
                if not ready:
                    continue
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                on_line(raw.decode("utf-8", errors="replace"))
    finally:
        os.close(wake)
    if pending and not stop.is_set():
        on_line(pending.decode("utf-8", errors="replace"))
