"""``submit``'s SM share over the real socket: only a finite percentage in [1, 100] is a share.

JSON as any local user can write it (NaN, Infinity, 1e999 and a 400-digit integer are all read by
the daemon's parser): each is refused with one line and changes nothing. Found at b0c0ecb: 5e-324
and 0.5 were accepted (5e-324 shown as 0 %), and the 400-digit integer was an internal error with
a traceback; NaN and the infinities were refused already and are kept here as guards.
"""

from __future__ import annotations

import json

import pytest

from bench.support.daemon_helpers import DaemonProc
from gpushare.protocol import ErrorCode


@pytest.fixture(scope="module")
def daemon():
    d = DaemonProc(gpus=1)
    d.start()
    try:
        yield d
    finally:
        d.cleanup()


def _ids(d: DaemonProc) -> set[str]:
    return {c["id"] for c in d.call("list", {"all": True})["clients"]}


def _raw_submit(d: DaemonProc, sm_text: str) -> dict:
    line = (
        '{"id": 7, "method": "submit", "params": {"cls": "offline", "argv": ["sleep", "30"], '
        '"detach": true, "cwd": "/", "env": {"PATH": "/usr/bin:/bin"}, '
        f'"sm_pct": {sm_text}}}}}\n'
    )
    with d.api() as api:
        api._sock.sendall(line.encode())
        reply = api._reader.read_line()
    assert reply is not None
    return json.loads(reply)


@pytest.mark.parametrize(
    ("sm_text", "says"),
    [
        (
            "5e-324",
            "--sm must be at least 1 (MPS rounds a share down to whole SMs), got 4.94066e-324",
        ),
        ("0.5", "--sm must be at least 1 (MPS rounds a share down to whole SMs), got 0.5"),
        ("0", "--sm must be a percentage in (0, 100], got 0"),
        ("100.5", "--sm must be a percentage in (0, 100], got 100.5"),
        # Refused by the protocol's check of every parameter, before the share's own rule.
        ("NaN", "parameter 'sm_pct' must be a finite number"),
        ("Infinity", "parameter 'sm_pct' must be a finite number"),
        ("-Infinity", "parameter 'sm_pct' must be a finite number"),
        ("1e999", "parameter 'sm_pct' must be a finite number"),
        ("1" + "0" * 400, "parameter 'sm_pct' is out of range (a 64-bit integer)"),
    ],
)
def test_a_share_that_is_no_percentage_is_refused_in_one_line(
    daemon: DaemonProc, sm_text: str, says: str
) -> None:
    before = _ids(daemon)
    reply = _raw_submit(daemon, sm_text)
    assert reply["error"]["code"] == ErrorCode.INVALID_PARAMS.value, reply
    message = reply["error"]["message"]
    assert says in message and "\n" not in message
    assert _ids(daemon) == before


def test_one_percent_is_a_share(daemon: DaemonProc) -> None:
    reply = _raw_submit(daemon, "1")
    assert "result" in reply, reply
    cid = reply["result"]["client_id"]
    assert reply["result"]["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"
    daemon.call("cancel", {"client_id": cid})
