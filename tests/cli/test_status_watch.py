"""``gpushare status --watch``: redrawn in place on a terminal, plain snapshots when piped."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from bench.support.daemon_helpers import DaemonProc

CLI = [sys.executable, "-m", "gpushare"]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=1).start()
    try:
        yield d
    finally:
        d.cleanup()


def _watch_piped(d: DaemonProc, *extra: str, snapshots: int = 2) -> str:
    """Run ``status --watch`` into a pipe until it has printed `snapshots` snapshots, then Ctrl-C.

    Reads until the snapshots are there rather than for a fixed time: on a loaded machine the
    CLI's start-up alone can take longer than any fixed sleep.
    """
    # With --json a snapshot is one line; otherwise each starts with a "--- <time>" line.
    marker = "\n" if "--json" in extra else "--- "
    proc = subprocess.Popen(
        [*CLI, "status", "--watch", "0.2", "--socket", str(d.socket), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    out = ""
    deadline = time.monotonic() + 30
    while out.count(marker) < snapshots and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            out += line
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=20)
    return out + rest


def test_piped_watch_prints_plain_timestamped_snapshots(daemon: DaemonProc) -> None:
    out = _watch_piped(daemon)
    assert "\x1b[" not in out
    assert out.count("--- ") >= 2
    assert out.count("GPU") >= 2


def test_piped_json_watch_is_one_document_per_line(daemon: DaemonProc) -> None:
    lines = [line for line in _watch_piped(daemon, "--json").splitlines() if line]
    assert len(lines) >= 2
    for line in lines:
        doc = json.loads(line)
        assert doc["gpus"][0]["index"] == 0


def test_watch_on_a_terminal_redraws_in_place(daemon: DaemonProc) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: its stdout is the pty
        argv = [*CLI, "status", "--watch", "0.2", "--socket", str(daemon.socket)]
        os.execv(argv[0], argv)
    out = b""
    deadline = time.monotonic() + 10
    try:
        while out.count(b"\x1b[H\x1b[2J") < 2 and time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    break
    finally:
        os.kill(pid, signal.SIGINT)
        os.waitpid(pid, 0)
        os.close(fd)
    assert out.count(b"\x1b[H\x1b[2J") >= 2
    assert b"--- " not in out
