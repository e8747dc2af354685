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

from tests.daemon_helpers import DaemonProc

CLI = [sys.executable, "-m", "gpushare"]


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=1).start()
    try:
        yield d
    finally:
        d.cleanup()


def _watch_piped(d: DaemonProc, *extra: str, seconds: float = 1.5) -> str:
    proc = subprocess.Popen(
        [*CLI, "status", "--watch", "0.2", "--socket", str(d.socket), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(seconds)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=20)
    return out


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
