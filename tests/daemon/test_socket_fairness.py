"""Fair use of the API socket (issue 27 item 6): no user can take the socket from the others.

Real daemons, real Unix sockets, real second accounts: one user holds 1,200 idle connections
(two processes of 600, as the issue found) while another user and root ask for ``status``; a
client that starts a request and stalls is dropped; one uid's slow requests never hold every
worker; the daemon run out of file descriptors (its RLIMIT_NOFILE lowered with prlimit) warns
once and recovers.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.accounts import Account
from bench.support.daemon_helpers import DaemonProc, call_as, python_for_others, wait_for
from bench.support.holder import HOLDER
from gpushare import config, protocol
from gpushare.daemon.server import ApiServer, Caller, Limits, server_limits


def _hold(account: Account, path: Path, n: int) -> subprocess.Popen[str]:
    python = python_for_others()
    assert python is not None
    return subprocess.Popen(
        [python, "-c", HOLDER, str(path), str(n)],
        cwd="/", user=account.uid, group=account.gid, extra_groups=[],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _timed_status(uid: int, gid: int, path: Path) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    reply = call_as(uid, gid, path, "status", {})
    return reply, time.monotonic() - t0


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    """A daemon with short timeouts (1 s), for the tests of the timeouts."""
    d = DaemonProc(daemon_toml='idle_timeout = "1s"\nrequest_timeout = "1s"')
    d.start()
    yield d
    d.cleanup()


@pytest.fixture
def patient() -> Iterator[DaemonProc]:
    """A daemon with the shipped timeouts: idle connections stay open, only the limits act."""
    d = DaemonProc()
    d.start()
    yield d
    d.cleanup()


def test_one_users_1200_idle_connections_leave_others_served(
    patient: DaemonProc, accounts: tuple[Account, Account, Account]
) -> None:
    daemon = patient
    a, b, _ = accounts
    holders = [_hold(a, daemon.socket, 600) for _ in range(2)]
    try:
        counts = []
        for h in holders:
            assert h.stdout is not None
            counts.append(json.loads(h.stdout.readline()))
        for uid, gid in ((b.uid, b.gid), (0, 0)):
            for _ in range(3):
                reply, took_s = _timed_status(uid, gid, daemon.socket)
                assert "result" in reply, reply  # never "too many connections"
                assert took_s < 5.0
        # Root's reserve is not the only way in: another unprivileged user has its own share.
        assert call_as(b.uid, b.gid, daemon.socket, "list", {})["result"]["clients"] == []
        # The per-uid limit (64 by default) refused the rest at once, with an answer.
        held = sum(c["connected"] - c["refused"] for c in counts)
        assert held == 64, counts  # the limit, all still open while the others were served
    finally:
        for h in holders:
            h.communicate(timeout=30)


def _connect(path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(str(path))
    return s


def _closed_by_daemon(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def test_a_stalled_partial_request_is_dropped(daemon: DaemonProc) -> None:
    with _connect(daemon.socket) as s:
        s.sendall(b'{"id":1,"method":"hello","params":{"api_ver')
        assert _closed_by_daemon(s, within_s=4.0), "a half-sent request held its connection"
    assert daemon.call("status")["daemon"]["ready"] is True


def test_an_idle_connection_is_closed(daemon: DaemonProc) -> None:
    with _connect(daemon.socket) as s:
        s.sendall(b'{"id":1,"method":"hello","params":{"api_version":1}}\n')
        reply = json.loads(s.makefile("rb").readline())
        assert reply["result"]["api_version"] == protocol.API_VERSION
        assert _closed_by_daemon(s, within_s=4.0), "an idle connection was kept past idle_timeout"


def test_a_client_that_never_reads_its_answers_is_dropped(daemon: DaemonProc) -> None:
    sent = 3000  # ~6 MB of status answers: far more than the socket buffers hold
    with _connect(daemon.socket) as s:
        s.sendall(
            b'{"id":0,"method":"hello","params":{"api_version":1}}\n'
            + b'{"id":1,"method":"status","params":{}}\n' * sent
        )
        time.sleep(3.0)  # request_timeout is 1 s: the daemon gives up on the stalled reader
        assert daemon.call("status")["daemon"]["ready"] is True  # others are served meanwhile
        s.settimeout(5)
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := s.recv(1 << 20):
                got += chunk
    answered = got.count(b"\n")
    assert answered < sent, "the daemon kept answering a client that did not read"


# ------------------------------------------------------------------------------ in-flight limits


class _Slow:
    """A handler that blocks until released, counting how many run at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0

    def __call__(self, caller: Caller, params: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        self.release.wait(10)
        with self.lock:
            self.running -= 1
        return {"uid": caller.uid}


def _send(s: socket.socket, method: str) -> None:
    s.sendall(
        b'{"id":0,"method":"hello","params":{"api_version":1}}\n'
        + json.dumps({"id": 1, "method": method, "params": {}}).encode()
        + b"\n"
    )


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other uids may enter (pytest's tmp_path is root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="gs-fair-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_one_uid_cannot_hold_every_worker(
    open_dir: Path, accounts: tuple[Account, Account, Account]
) -> None:
    a, b, _ = accounts
    slow = _Slow()
    path = open_dir / "api.sock"
    server = ApiServer(
        path, {"slow": slow, "fast": lambda c, p: {"uid": c.uid}}, max_request_bytes=4096,
        limits=Limits(api_workers=4, admin_reserve_workers=1, max_inflight_per_uid=2),
        privileged=lambda c: c.uid == b.uid,  # b stands for the admin group here
    )  # fmt: skip
    server.start()
    conns = []
    try:
        for _ in range(6):  # root's uid is an ordinary one for this server
            s = _connect(path)
            _send(s, "slow")
            conns.append(s)
        wait_for(lambda: slow.running == 2, 5.0, "two slow requests of one uid to run")
        time.sleep(0.3)
        assert slow.most == 2, "one uid ran more requests at once than max_inflight_per_uid"
        # Another ordinary user still gets a worker, and the admin one the reserved worker.
        assert call_as(a.uid, a.gid, path, "fast", {})["result"] == {"uid": a.uid}
        assert call_as(b.uid, b.gid, path, "fast", {})["result"] == {"uid": b.uid}
        slow.release.set()
        for s in conns:  # every waiting request is answered in its turn
            f = s.makefile("rb")
            assert "result" in json.loads(f.readline())
            assert json.loads(f.readline())["result"] == {"uid": os.getuid()}
    finally:
        slow.release.set()
        for s in conns:
            s.close()
        server.close()


def test_past_max_connections_only_root_and_the_admin_group_get_in(
    open_dir: Path, accounts: tuple[Account, Account, Account]
) -> None:
    a, b, _ = accounts
    path = open_dir / "api.sock"
    server = ApiServer(
        path, {"fast": lambda c, p: {"uid": c.uid}}, max_request_bytes=4096,
        limits=Limits(max_connections=4, admin_reserve_connections=2, max_connections_per_uid=10),
        privileged=lambda c: c.uid == b.uid,  # b stands for the admin group here
    )  # fmt: skip
    server.start()
    held = []
    try:
        for _ in range(4):  # this process's uid is an ordinary one for this server
            s = _connect(path)
            s.sendall(b'{"id":0,"method":"hello","params":{"api_version":1}}\n')
            assert "result" in json.loads(s.makefile("rb").readline())
            held.append(s)
        holder = _hold(a, path, 1)  # an ordinary user: refused with an answer, at once
        assert holder.stdout is not None
        assert json.loads(holder.stdout.readline())["refused"] == 1
        holder.communicate(timeout=30)
        assert call_as(b.uid, b.gid, path, "fast", {})["result"] == {"uid": b.uid}
    finally:
        for s in held:
            s.close()
        server.close()


# ------------------------------------------------------------------------------ EMFILE


def _log_lines(daemon: DaemonProc, event: str) -> list[str]:
    return [line for line in daemon.stderr_path.read_text().splitlines() if event in line]


def test_emfile_on_accept_warns_once_and_recovers(patient: DaemonProc) -> None:
    daemon = patient
    assert daemon.proc is not None
    pid = daemon.proc.pid
    used = len(os.listdir(f"/proc/{pid}/fd"))
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (used + 8, old[1]))
    held: list[socket.socket] = []
    try:
        # Root is let in up to its reserve: the descriptors run out first.
        for _ in range(40):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(daemon.socket))
            held.append(s)
        wait_for(lambda: _log_lines(daemon, "api_accept_failed"), 5.0, "the EMFILE warning")
        time.sleep(1.5)  # the old server logged it every 50 ms
        assert len(_log_lines(daemon, "api_accept_failed")) == 1
    finally:
        for s in held:
            s.close()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
    st = wait_for(lambda: _status_or_none(daemon), 10.0, "status after the descriptors came back")
    assert st["daemon"]["ready"] is True
    wait_for(lambda: _log_lines(daemon, "api_accept_recovered"), 5.0, "the recovery line")


def _status_or_none(daemon: DaemonProc) -> dict[str, Any] | None:
    try:
        with daemon.api() as api:
            result: dict[str, Any] = api.call("status")
            return result
    except Exception:
        return None


@pytest.mark.parametrize(
    ("lines", "key"),
    [
        ("api_workers = 4\nadmin_reserve_workers = 4", "daemon.admin_reserve_workers"),
        ("max_connections_per_uid = 0", "daemon.max_connections_per_uid"),
        ("max_inflight_per_uid = 0", "daemon.max_inflight_per_uid"),
        ('idle_timeout = "0s"', "daemon.idle_timeout"),
        ('request_timeout = "-1s"', "daemon.request_timeout"),
    ],
)
def test_socket_limits_are_validated(lines: str, key: str) -> None:
    with pytest.raises(config.ConfigError) as caught:
        config.loads(f"version = 1\n[daemon]\n{lines}\n")
    assert caught.value.key == key


def test_socket_limits_come_from_the_config() -> None:
    cfg = config.loads('version = 1\n[daemon]\nmax_connections_per_uid = 7\nidle_timeout = "5s"\n')
    limits = server_limits(cfg.daemon)
    assert (limits.max_connections_per_uid, limits.idle_timeout_s) == (7, 5.0)


def test_a_reload_applies_the_per_uid_limit(
    patient: DaemonProc, accounts: tuple[Account, Account, Account]
) -> None:
    a, d = accounts[0], patient
    d.config_path.write_text(
        d.config_text().replace("[daemon]\n", "[daemon]\nmax_connections_per_uid = 3\n")
    )
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: any(e["kind"] == "config_reloaded" for e in d.events()), what="reload")
    holder = _hold(a, d.socket, 10)
    try:
        assert holder.stdout is not None
        counts = json.loads(holder.stdout.readline())
        assert counts["connected"] - counts["refused"] == 3, counts
    finally:
        holder.communicate(timeout=30)
