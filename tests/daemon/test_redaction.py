"""What one user sees of another user's client (issue 27 item 5), with real accounts.

A submits an online client with a secret in its environment and a ``--latency-from`` endpoint
whose answer carries a secret (a line that is not the Prometheus format, which the scrape error
quotes for its owner). B's
``status``, ``list`` and ``events`` show A's client (its argv, as ``ps`` does) but neither
secret; A, root and the admin group see the endpoint's text.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from bench.support.accounts import Account
from bench.support.daemon_helpers import DaemonProc, call_as, wait_for
from gpushare.daemon import rights
from gpushare.node.procs.visibility import hides_others

ENDPOINT_SECRET = "tok-7f3a9c-from-the-endpoint"
ENV_SECRET = "hunter2-in-the-environment"


class _Leaky(http.server.BaseHTTPRequestHandler):
    """Not the Prometheus text format: the scrape error quotes the line it cannot read."""

    def do_GET(self) -> None:
        body = f"{ENDPOINT_SECRET}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Leaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _submit_as(d: DaemonProc, owner: Account, port: int) -> str:
    out = call_as(owner.uid, owner.gid, d.socket, "submit", {
        "cls": "online", "argv": ["sleep", "60"], "detach": True, "cwd": "/",
        "env": {"PATH": os.environ["PATH"], "APP_SECRET": ENV_SECRET},
        "latency_from": f"prometheus:http://127.0.0.1:{port}/metrics#req_latency_seconds",
    })  # fmt: skip
    assert "result" in out, out
    client_id: str = out["result"]["client_id"]
    return client_id


def _entry(reply: dict[str, Any], client_id: str) -> dict[str, Any]:
    return next(c for c in reply["result"]["clients"] if c["id"] == client_id)


def test_another_users_view_has_no_environment_and_no_endpoint_text(
    accounts: tuple[Account, Account, Account], endpoint: int
) -> None:
    a, b, admin = accounts
    d = DaemonProc('[latency]\nscrape_period = "100ms"')
    d.config_path.write_text(
        d.config_text('[latency]\nscrape_period = "100ms"').replace(
            'admin_group = ""', f'admin_group = "{admin.name}"'
        )
    )
    d.start()
    try:
        cid = _submit_as(d, a, endpoint)
        # Root sees what the endpoint answered: the scrape error is real and reaches status.
        wait_for(lambda: ENDPOINT_SECRET in json.dumps(d.call("status")), 10, "the scrape error")
        for viewer in (a, admin):
            reply = call_as(viewer.uid, viewer.gid, d.socket, "status", {})
            assert ENDPOINT_SECRET in json.dumps(_entry(reply, cid)["latency"])
        for method in ("status", "list", "events"):
            reply = call_as(b.uid, b.gid, d.socket, method, {})
            text = json.dumps(reply)
            assert "result" in reply, reply
            assert ENDPOINT_SECRET not in text, f"{method} showed b the text of a's endpoint"
            assert ENV_SECRET not in text, f"{method} showed b a's environment"
            assert f"127.0.0.1:{endpoint}" not in text, f"{method} showed b a's endpoint"
        seen = _entry(call_as(b.uid, b.gid, d.socket, "status", {}), cid)
        assert seen["latency"]["reason"] == rights.HIDDEN
        # The command line, as ps shows it to b on this host.
        assert seen["argv"] == ([] if hides_others() else ["sleep", "60"])
        assert seen["user"] == a.name
    finally:
        d.cleanup()


def test_owner_only_events_are_redacted_for_others() -> None:
    rows = [
        {"kind": "latency_source_failed", "client_id": "c1", "message": ENDPOINT_SECRET},
        {"kind": "latency_source_failed", "client_id": "c2", "message": "own"},
        {"kind": "client_exited", "client_id": "c1", "message": "c1 exited"},
    ]
    caller = _Id(uid=1000)
    viewer = rights.Viewer(caller, "", argv_hidden=False)
    out = viewer.events(rows, {"c1": 2000, "c2": 1000}.get)
    assert ENDPOINT_SECRET not in json.dumps(out)
    assert out[1]["message"] == "own"
    assert out[2]["message"] == "c1 exited"


def test_owner_only_fields_are_nulled_for_others_at_any_depth() -> None:
    entry = {
        "id": "c1", "argv": ["serve"],
        "latency": {"reason": "scrape failed", "error_detail_owner_only": ENDPOINT_SECRET},
    }  # fmt: skip
    other = rights.Viewer(_Id(uid=1000), "", argv_hidden=False)
    seen = other.client(entry, owner_uid=2000, url_sourced=True)
    assert seen["latency"] == {"reason": rights.HIDDEN, "error_detail_owner_only": None}
    assert seen["argv"] == ["serve"]
    assert other.client(entry, owner_uid=1000, url_sourced=True) == entry  # its owner
    root = rights.Viewer(_Id(uid=0), "", argv_hidden=True)
    assert root.client(entry, owner_uid=2000, url_sourced=True) == entry
    hidden = rights.Viewer(_Id(uid=1000), "", argv_hidden=True)
    assert hidden.client(entry, owner_uid=2000, url_sourced=False)["argv"] == []


class _Id:
    def __init__(self, uid: int) -> None:
        self.uid = uid
        self.gid = uid
        self.groups: tuple[int, ...] = ()


def test_hidepid_is_read_from_mountinfo() -> None:
    line = "22 27 0:21 / /proc rw,nosuid - proc proc rw{}"
    assert not hides_others(line.format(""))
    assert hides_others(line.format(",hidepid=invisible"))
    assert hides_others(line.format(",hidepid=2"))
    assert not hides_others(line.format(",hidepid=0"))
    # A later mount on /proc is the one users see.
    assert not hides_others(line.format(",hidepid=2") + "\n" + line.format(""))
