"""Params that reached a handler as an internal error, and the secrets its traceback logged.

On b0c0ecb each of these was an ``INTERNAL`` error whose traceback the daemon logged with every
frame's local variables: the request line and its params among them, so a submitted
environment's ``SECRET=xyz`` ended in the daemon's log. Each is now one clear error, and a
traceback (of a real bug) carries no locals (``tests/test_logs.py``).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from bench.support.daemon_helpers import DaemonProc

SECRET = "xyz-5ecret-d0-not-log"


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc(env={"GPUSHARE_TEST_DEBUG": "1"}).start()  # debug: the most the log says
    try:
        yield d
    finally:
        d.cleanup()


def raw_call(d: DaemonProc, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """One request as any program could send it (json.dumps keeps a lone surrogate escaped)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10.0)
        s.connect(str(d.socket))
        f = s.makefile("rwb")
        hello = {"id": 0, "method": "hello", "params": {"api_version": 1, "client": "t"}}
        f.write(json.dumps(hello).encode() + b"\n")
        f.flush()
        f.readline()
        f.write(json.dumps({"id": 1, "method": method, "params": params}).encode() + b"\n")
        f.flush()
        reply: dict[str, Any] = json.loads(f.readline())
        return reply


def submit(**extra: Any) -> dict[str, Any]:
    env = {"PATH": os.environ["PATH"], "SECRET": SECRET}
    return {"cls": "offline", "argv": ["sleep", "1"], "detach": True, "cwd": "/", "env": env,
            **extra}  # fmt: skip


CASES = [
    pytest.param("events", {"since_id": 2**63}, "since_id", id="since_id-2**63"),
    pytest.param("events", {"since_id": 0, "limit": -(2**70)}, "limit", id="limit-2**70"),
    pytest.param("submit", submit(gpu="²"), "no GPU", id="gpu-superscript-two"),
    pytest.param("status", {"gpu": "²"}, "no GPU", id="status-gpu-superscript-two"),
    pytest.param("pause", {"client_id": "\ud800"}, "client_id", id="lone-surrogate-id"),
    pytest.param("cancel", {"client_id": "c1\x00"}, "client_id", id="nul-in-id"),
    pytest.param("submit", submit(sm_pct=float("inf")), "sm_pct", id="sm_pct-1e400"),
    pytest.param("submit", submit(name="\udfff"), "name", id="lone-surrogate-name"),
]


@pytest.mark.parametrize(("method", "params", "names"), CASES)
def test_a_hostile_param_gets_one_clear_error_and_no_secret_is_logged(
    daemon: DaemonProc, method: str, params: dict[str, Any], names: str
) -> None:
    before = daemon.stderr_path.read_text()
    reply = raw_call(daemon, method, params)
    error = reply["error"]
    assert error["name"] in {"INVALID_PARAMS", "NOT_FOUND"}, error
    assert names in error["message"] and "\n" not in error["message"]
    assert "internal error" not in error["message"]
    log = daemon.stderr_path.read_text()[len(before) :]
    assert SECRET not in log
    assert "api_handler_failed" not in log


def test_the_daemon_log_never_holds_a_submitted_environment(daemon: DaemonProc) -> None:
    reply = raw_call(daemon, "submit", submit())
    assert "result" in reply, reply
    assert SECRET not in daemon.stderr_path.read_text()
