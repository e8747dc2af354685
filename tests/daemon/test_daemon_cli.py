"""The daemon end to end through its CLI and API client: status, list, events (and --follow), an
unreachable socket, another API version, the fast status path, app-reported latency in status.

A real daemon process, real socket, SQLite, signals and workloads; only the GPU
(tests/fakes/fake_gpu.py) and the MPS side (tests/fakes/fake_mps.py) are fakes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.support.daemon_helpers import REPO, DaemonProc, wait_for
from gpushare.client import ApiClient
from tests.fakes.fake_gpu import fake_uuid
from tests.support.daemon_e2e import _state, run_cli


def test_cli_unreachable_socket_exit_3(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "gpushare", "status", "--socket", str(tmp_path / "none.sock")],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 3
    assert r.stderr.strip() == (
        f"cannot reach gpushare at {tmp_path / 'none.sock'}: is gpushare.service running? "
        "(systemctl status gpushare)"
    )


def test_cli_status_list_events(daemon: DaemonProc) -> None:
    cid = daemon.submit_detached(["sleep", "30"], name="listed")["client_id"]
    r = run_cli(daemon, "status", "-o", "wide")  # UUIDs whole: -o wide
    assert r.returncode == 0, r.stderr
    assert fake_uuid(0) in r.stdout
    assert "listed" in r.stdout
    js = json.loads(run_cli(daemon, "status", "--json", "--gpu", "1").stdout)
    assert js["schema_version"] == 2
    assert [g["index"] for g in js["gpus"]] == [1]
    assert js["gpus"][0]["gpu_util_pct"] is None  # unknown is null, never 0
    assert "N/A" in r.stdout
    assert cid in run_cli(daemon, "list").stdout
    assert "client_submitted" in run_cli(daemon, "events").stdout
    r = run_cli(daemon, "cancel", "c9999")
    assert r.returncode == 2
    assert "no client 'c9999'" in r.stderr
    assert run_cli(daemon, "cancel", cid).returncode == 0
    r = run_cli(daemon, "submit", "--online", "--offline", "--", "true")
    assert r.returncode == 2


def test_api_client_refuses_other_version(daemon: DaemonProc) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(daemon.socket))
    with s:
        s.sendall(
            b'{"id":1,"method":"status"}\n{"id":2,"method":"hello","params":{"api_version":99}}\n'
        )
        f = s.makefile("rb")
        first, second = json.loads(f.readline()), json.loads(f.readline())
    assert first["error"]["name"] == "HELLO_REQUIRED"
    assert second["error"]["name"] == "VERSION_MISMATCH"
    assert ApiClient.connect(daemon.socket).hello["api_version"] == 1


def test_status_fast_path_matches_typer_command(daemon: DaemonProc) -> None:
    from gpushare.cli.fast import _parse_status

    assert _parse_status(["--json", "--gpu", "1"]) == {"json": True, "gpu": "1"}
    assert _parse_status(["--socket=/x"]) == {"socket": "/x"}
    for unknown in (["--watch", "1"], ["--gpu"], ["--gpu", "1", "--gpu", "2"], ["--help"], ["-h"]):
        assert _parse_status(unknown) is None  # left to Typer
    fast = run_cli(daemon, "status", "--gpu", "0")
    typer_path = subprocess.run(
        [sys.executable, "-c", "import sys; from gpushare.cli.app import main; sys.argv[0] = 'gpushare'; main()",
         "status", "--gpu", "0", "--socket", str(daemon.socket)],
        cwd=REPO, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert (fast.returncode, typer_path.returncode) == (0, 0)
    strip = lambda text: [line for line in text.splitlines() if "UPTIME" not in line]  # noqa: E731
    assert strip(fast.stdout)[:4] == strip(typer_path.stdout)[:4]


REPORTER = (
    "import time; from gpushare.client import report_latency, flush_latency\n"
    "for _ in range(40): report_latency(0.05)\n"
    "flush_latency(); time.sleep(30)\n"
)


def test_app_reported_latency_reaches_status(daemon: DaemonProc) -> None:
    res = daemon.submit_detached([sys.executable, "-c", REPORTER], cls="online", gpu="1",
                                 slo_p99_ms=40.0)  # fmt: skip
    cid = res["client_id"]

    def p99() -> float | None:
        st = daemon.call("status", {"gpu": "1"})
        c = next(c for c in st["clients"] if c["id"] == cid)
        return c["latency"]["p99_ms"]

    assert wait_for(p99, what="app p99 in status") == pytest.approx(50.0)
    st = daemon.call("status", {"gpu": "1"})
    lat = next(c for c in st["clients"] if c["id"] == cid)["latency"]
    assert (lat["source"], lat["slo_p99_ms"]) == ("app", 40.0)
    assert lat["ratio"] == pytest.approx(50.0 / 40.0)
    assert lat["samples"] > 0
    r = run_cli(daemon, "status", "--gpu", "1", "-o", "wide")  # ratio and source: -o wide
    row = next(line for line in r.stdout.splitlines() if line.startswith(cid + " "))
    assert "50ms" in row and "40ms" in row and "1.25" in row and "app" in row
    slo = daemon.call("status", {"gpu": "1"})["gpus"][0]["online_slo"]
    assert slo["state"] == "degraded"
    assert slo["violating_clients"] == [cid]
    daemon.call("cancel", {"client_id": cid})
    wait_for(lambda: _state(daemon, cid) == "exited", what="cancel")


def test_events_follow_prints_new_events(daemon: DaemonProc) -> None:
    import threading

    follow = subprocess.Popen(
        [sys.executable, "-m", "gpushare", "events", "--follow", "--socket", str(daemon.socket)],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        assert follow.stdout is not None
        for line in follow.stdout:
            lines.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        wait_for(lambda: any("daemon_started" in line for line in lines), what="history printed")
        cid = daemon.submit_detached(["true"], name="followed")["client_id"]
        # A new event shows up while --follow keeps running.
        wait_for(
            lambda: any(f" {cid} " in line and "client_exited" in line for line in lines),
            what="the new client's exit in --follow",
        )
        assert follow.poll() is None
    finally:
        follow.kill()
        follow.wait()
        reader.join(timeout=5)
