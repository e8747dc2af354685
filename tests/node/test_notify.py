"""gpushare.node.notify against real AF_UNIX datagram sockets (path and abstract)."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpushare.node.notify import NOTIFY_VARS, clean_env, notify, status_field, watchdog_period_s


@pytest.fixture
def path_socket() -> Iterator[tuple[socket.socket, str]]:
    # A short directory: sun_path holds 107 bytes and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="gs-notify-") as tmp:
        address = os.path.join(tmp, "notify.sock")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(address)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.settimeout(5)
        yield sock, address
        sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[socket.socket, str]]:
    name = f"gpushare-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    yield sock, "@" + name
    sock.close()


def test_notify_path_socket_one_datagram_with_credentials(
    path_socket: tuple[socket.socket, str],
) -> None:
    sock, address = path_socket
    assert notify("READY=1", "STATUS=2 GPUs, MPS up", env={"NOTIFY_SOCKET": address})
    data, ancdata, _flags, _addr = sock.recvmsg(4096, socket.CMSG_SPACE(12))
    assert data == b"READY=1\nSTATUS=2 GPUs, MPS up"
    creds = [d for level, kind, d in ancdata if kind == socket.SCM_CREDENTIALS]
    assert creds, "the kernel attaches SCM_CREDENTIALS that systemd checks for NotifyAccess="
    pid, uid, _gid = struct.unpack("iII", creds[0])
    assert (pid, uid) == (os.getpid(), os.getuid())


def test_notify_abstract_socket(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    assert notify("WATCHDOG=1", env={"NOTIFY_SOCKET": address})
    assert sock.recv(4096) == b"WATCHDOG=1"


def test_notify_reads_os_environ(
    monkeypatch: pytest.MonkeyPatch, abstract_socket: tuple[socket.socket, str]
) -> None:
    sock, address = abstract_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert notify("STOPPING=1")
    assert sock.recv(4096) == b"STOPPING=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not notify("STOPPING=1")


def test_notify_without_systemd_is_a_noop() -> None:
    assert not notify("READY=1", env={})
    assert not notify("READY=1", env={"NOTIFY_SOCKET": ""})
    assert not notify("READY=1", env={"NOTIFY_SOCKET": "vsock:2:1234"})


def test_notify_to_dead_socket_returns_false(tmp_path: Path) -> None:
    assert not notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert not notify("READY=1", env={"NOTIFY_SOCKET": f"@gpushare-nobody-{uuid.uuid4().hex}"})


def test_notify_rejects_bad_fields(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    for bad in ["READY", "=1", "STATUS=two\nREADY=1"]:
        with pytest.raises(ValueError, match="KEY=VALUE"):
            notify(bad, env={"NOTIFY_SOCKET": address})
    sock.settimeout(0.1)
    with pytest.raises(TimeoutError):
        sock.recv(4096)  # nothing was sent for the refused calls


def test_watchdog_period() -> None:
    me = str(os.getpid())
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": me}) == 15.0
    assert watchdog_period_s({"WATCHDOG_USEC": "3000000"}) == 1.5
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_period_s({}) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "me"}) is None


def test_watchdog_period_from_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_period_s() == 1.0


def test_clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "HOME": "/h"}
    cleaned = clean_env(env)
    assert cleaned == {"HOME": "/h"}
    assert env["NOTIFY_SOCKET"] == "/x"  # a copy: the input is untouched
    monkeypatch.setenv("NOTIFY_SOCKET", "/y")
    from_os = clean_env()
    assert not set(NOTIFY_VARS) & set(from_os)
    assert from_os.get("PATH") == os.environ.get("PATH")


def test_status_field_is_one_line(abstract_socket: tuple[socket.socket, str]) -> None:
    sock, address = abstract_socket
    field = status_field("2 GPUs\n  MPS up\r\tclients: 3")
    assert field == "STATUS=2 GPUs MPS up clients: 3"
    assert notify("READY=1", field, env={"NOTIFY_SOCKET": address})
    assert sock.recv(4096).decode().split("\n") == ["READY=1", field]


def test_notify_reuses_one_socket_and_a_child_makes_its_own(
    monkeypatch: pytest.MonkeyPatch,
    path_socket: tuple[socket.socket, str],
    abstract_socket: tuple[socket.socket, str],
) -> None:
    from gpushare.node import notify as sd

    made: list[int] = []
    real = socket.socket

    def counting(*args: object, **kwargs: object) -> socket.socket:
        made.append(os.getpid())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    psock, paddress = path_socket
    asock, aaddress = abstract_socket
    monkeypatch.setattr(sd, "_sock", None)  # whatever an earlier test left
    monkeypatch.setattr(socket, "socket", counting)
    for _ in range(3):
        assert notify("WATCHDOG=1", env={"NOTIFY_SOCKET": paddress})
        assert psock.recv(4096) == b"WATCHDOG=1"
    assert notify("WATCHDOG=1", env={"NOTIFY_SOCKET": aaddress})
    assert asock.recv(4096) == b"WATCHDOG=1"
    assert made == [os.getpid()], "one socket for every call and address"
    pid = os.fork()
    if pid == 0:  # the child: its datagram, from a socket of its own
        ok = notify("STATUS=child", env={"NOTIFY_SOCKET": paddress})
        ok = ok and sd._sock_pid == os.getpid()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    data, ancdata, _flags, _addr = psock.recvmsg(4096, socket.CMSG_SPACE(12))
    assert data == b"STATUS=child"
    creds = [d for _level, kind, d in ancdata if kind == socket.SCM_CREDENTIALS]
    assert struct.unpack("iII", creds[0])[0] == pid
