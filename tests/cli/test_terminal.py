"""The human output in a real terminal (a pty made by script(1)), not only through a pipe.

On a terminal states are coloured; with ``NO_COLOR`` set, or through a pipe, there is no escape
sequence at all, and the text is the same (b0c0ecb had no colour anywhere).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from bench.support.daemon_helpers import REPO, DaemonProc

ESC = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc(gpus=1)
    try:
        d.start()
        d.submit_detached(["sleep", "60"], name="coloured")
        yield d
    finally:
        d.cleanup()


def _in_terminal(d: DaemonProc, *args: str, env: dict[str, str] | None = None) -> str:
    if shutil.which("script") is None:
        pytest.skip("no script(1) to make a terminal with")
    command = shlex.join([sys.executable, "-m", "gpushare", *args])
    r = subprocess.run(
        ["script", "-qec", command, "/dev/null"], cwd=REPO, capture_output=True, text=True,
        timeout=60, check=False, stdin=subprocess.DEVNULL,
        env={**os.environ, "GPUSHARE_SOCKET": str(d.socket), "TERM": "xterm", "COLUMNS": "100",
             **(env or {})},
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.replace("\r\n", "\n")


def _piped(d: DaemonProc, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    return subprocess.run(
        [sys.executable, "-m", "gpushare", *args], cwd=REPO, capture_output=True, text=True,
        timeout=60, check=True, env={**env, "GPUSHARE_SOCKET": str(d.socket)},
    ).stdout  # fmt: skip


@pytest.mark.parametrize("args", [("status",), ("list",), ("status", "-o", "wide")])
def test_colour_on_a_terminal_none_with_no_color_or_a_pipe(
    daemon: DaemonProc, args: tuple[str, ...]
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    on_tty = _in_terminal(daemon, *args, env={"NO_COLOR": ""} if "NO_COLOR" in env else None)
    assert "\x1b[32mrunning" in on_tty  # a running client is green
    plain = ESC.sub("", on_tty)
    assert "coloured" in plain
    assert not ESC.search(_in_terminal(daemon, *args, env={"NO_COLOR": "1"}))
    piped = _piped(daemon, *args)
    assert not ESC.search(piped)
    # The same table either way (its first columns: readings and ages move between runs).
    rows = lambda t: [line.split()[:7] for line in t.splitlines()[-2:]]  # noqa: E731
    assert rows(plain) == rows(piped)
    if args == ("status",):
        assert max(len(line) for line in plain.splitlines()) <= 100
