"""The daemon end to end: its life as a service (kill -9 and re-adoption, SIGTERM, SIGHUP with a bad
config, sd_notify readiness and watchdog, not ready while MPS is down, a corrupted database, the
socket's mode, group and directory).

A real daemon process, real socket, SQLite, signals and workloads; only the GPU
(tests/fakes/fake_gpu.py) and the MPS side (tests/fakes/fake_mps.py) are fakes.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from bench.support.daemon_helpers import DaemonProc, cpu_ticks, wait_for
from gpushare.client import ApiError
from gpushare.protocol import ErrorCode
from tests.fakes.fake_gpu import fake_uuid
from tests.support.daemon_e2e import run_cli


def test_kill9_leaves_workloads_and_restart_readopts(tmp_path: Path) -> None:
    d = DaemonProc()
    try:
        d.start()
        a = d.submit_detached(["sleep", "60"], name="a")
        b = d.submit_detached(["sleep", "60"], name="b")
        q = d.submit_detached([sys.executable, "-c", "while True: pass"], name="busy")
        d.call("pause", {"client_id": q["client_id"]})
        d.kill9()
        # The workloads outlive the daemon.
        for r in (a, b, q):
            os.kill(r["pid"], 0)
        os.killpg(b["pid"], signal.SIGKILL)  # b dies while the daemon is down
        wait_for(lambda: not Path(f"/proc/{b['pid']}").exists() or b"Z" in Path(f"/proc/{b['pid']}/stat").read_bytes().split(b") ")[1][:1],
                 what="b to die")  # fmt: skip
        d.start()
        ca, cb, cq = d.client(a["client_id"]), d.client(b["client_id"]), d.client(q["client_id"])
        assert (ca["state"], ca["pid"]) == ("running", a["pid"])
        assert cb["state"] == "lost"
        assert "gone while the daemon was down" in cb["reason"]
        # The held client stays held (and frozen) across the restart.
        assert (cq["state"], cq["held"]) == ("frozen", True)
        t0 = cpu_ticks(q["pid"])
        import time

        time.sleep(0.4)
        assert cpu_ticks(q["pid"]) - t0 <= 1
        kinds = [e["kind"] for e in d.events()]
        assert kinds.count("client_readopted") == 2
        # The re-adopted client's exit is still noticed.
        d.call("cancel", {"client_id": a["client_id"]})
        wait_for(lambda: d.client(a["client_id"])["state"] == "exited", what="readopted exit")
        d.call("cancel", {"client_id": q["client_id"]})
        wait_for(lambda: d.client(q["client_id"])["state"] == "exited", what="frozen cancel")
        assert d.stop() == 0
    finally:
        d.cleanup()


def test_sigterm_leaves_workloads_running_and_exits_0() -> None:
    d = DaemonProc()
    try:
        d.start()
        r = d.submit_detached(["sleep", "60"])
        assert d.stop(signal.SIGTERM) == 0
        os.kill(r["pid"], 0)  # still alive
        assert not d.socket.exists()
        d.start()
        assert d.client(r["client_id"])["state"] == "running"
    finally:
        d.cleanup()


def test_bad_config_on_sighup_keeps_old_config() -> None:
    d = DaemonProc()
    try:
        d.start()
        d.config_path.write_text(d.config_text() + '\n[control]\nperiod = "fast"\n')
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)
        ev = wait_for(
            lambda: [e for e in d.events() if e["kind"] == "config_reload_failed"],
            what="reload failure",
        )
        assert "control.period" in ev[0]["message"]
        assert ev[0]["severity"] == "error"
        assert d.call("status")["daemon"]["ready"] is True
        # A good file is taken: cancel grace becomes 1s.
        d.config_path.write_text(
            d.config_text().replace('cancel_grace = "2s"', 'cancel_grace = "1s"')
        )
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: any(e["kind"] == "config_reloaded" for e in d.events()), what="reload")
        cid = d.submit_detached(["sleep", "30"])["client_id"]
        assert d.call("cancel", {"client_id": cid})["grace_s"] == 1.0
    finally:
        d.cleanup()


def test_sd_notify_ready_status_and_watchdog() -> None:
    base_sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    d = DaemonProc()
    notify_path = d.base / "notify.sock"
    base_sock.bind(str(notify_path))
    base_sock.settimeout(10)
    d.env = {"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "200000"}
    try:
        d.start()
        got: list[str] = []
        while not ({"READY=1", "WATCHDOG=1"} <= set(got)):
            got += base_sock.recv(4096).decode().split("\n")
        ready_at = got.index("READY=1")
        assert any(f.startswith("STATUS=2 GPU(s), MPS up 2/2") for f in got)
        assert ready_at < got.index("WATCHDOG=1") or "WATCHDOG=1" in got[ready_at:]
        # A workload never inherits the daemon's systemd variables.
        r = d.submit_detached(["sh", "-c", "echo ${NOTIFY_SOCKET-none} ${WATCHDOG_USEC-none}"],
                              env={"PATH": os.environ["PATH"], "NOTIFY_SOCKET": "/x"})  # fmt: skip
        wait_for(lambda: d.client(r["client_id"])["state"] == "exited", what="exit")
        assert Path(r["log_path"]).read_text().strip() == "none none"
        d.stop()
        tail = base_sock.recv(4096).decode()
        while "STOPPING=1" not in tail:
            tail = base_sock.recv(4096).decode()
    finally:
        base_sock.close()
        d.cleanup()


def test_not_ready_while_mps_down() -> None:
    d = DaemonProc(gpus=1)
    notify_path = d.base / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(0.5)
    d.env = {"NOTIFY_SOCKET": str(notify_path)}
    state_file = d.base / "run" / "mps" / f"{fake_uuid(0)}.state"
    state_file.parent.mkdir(parents=True)
    state_file.write_text("down")
    try:
        d.start()
        assert d.call("status")["daemon"]["ready"] is False
        with pytest.raises(ApiError) as info:
            d.submit_detached(["true"])
        assert info.value.code is ErrorCode.UNAVAILABLE
        r = run_cli(d, "status")
        assert r.returncode == 1
        assert "down" in r.stdout
        state_file.write_text("up")
        wait_for(lambda: d.call("status")["daemon"]["ready"], what="ready after MPS up")
        fields: list[str] = []
        while "READY=1" not in fields:
            fields += sock.recv(4096).decode().split("\n")
    finally:
        sock.close()
        d.cleanup()


def test_corrupted_database_is_moved_aside_and_reported() -> None:
    d = DaemonProc()
    try:
        d.db.parent.mkdir(parents=True)
        d.db.write_bytes(b"\x00garbage, not SQLite\x00" * 64)
        d.start()
        ev = next(e for e in d.events() if e["kind"] == "registry_corrupt")
        assert ev["severity"] == "error"
        aside = [p for p in d.db.parent.iterdir() if ".corrupt-" in p.name]
        assert len(aside) == 1
        assert aside[0].read_bytes().startswith(b"\x00garbage")
        assert str(aside[0]) in ev["message"]
        wait_for(lambda: d.call("status")["daemon"]["ready"], what="ready on the fresh database")
    finally:
        d.cleanup()


def test_socket_mode_and_group_from_config() -> None:
    import grp
    import stat as st

    d = DaemonProc()
    d.config_path.write_text(
        d.config_text().replace(
            "[daemon]\n", '[daemon]\nsocket_mode = "0660"\nsocket_group = "nogroup"\n'
        )
    )
    bad = DaemonProc()
    bad.config_path.write_text(
        bad.config_text().replace("[daemon]\n", '[daemon]\nsocket_group = "no-such-group-xyz"\n')
    )
    try:
        d.start()
        info = d.socket.stat()
        assert st.S_IMODE(info.st_mode) == 0o660
        assert info.st_gid == grp.getgrnam("nogroup").gr_gid
        # A group that does not exist stops the start with a message that names the fix.
        bad.start(wait=False)
        assert bad.proc is not None
        assert bad.proc.wait(timeout=20) == 1
        assert "socket_group 'no-such-group-xyz' does not exist" in bad.stderr_path.read_text()
    finally:
        d.cleanup()
        bad.cleanup()


def test_socket_directory_that_cannot_be_created_is_a_clear_startup_error(tmp_path: Path) -> None:
    from gpushare.daemon.server import ApiServer, ServerError

    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the socket's directory should be
    server = ApiServer(blocker / "run" / "gpushare.sock", {}, max_request_bytes=1024)
    with pytest.raises(ServerError, match=r"cannot create .*paths\.socket"):
        server.start()
    assert blocker.read_text() == ""
