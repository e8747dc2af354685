"""Request gating end to end: a real daemon process (socket, SQLite, the gpushare controller, the
real pauser: cgroup v2 where writable, else signals), an online client that says when its requests
start and end through gpushare.client, and an offline client frozen exactly while they are in flight.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.support.daemon_helpers import DaemonProc, library_for_others, wait_for
from gpushare import client, native

# The online service: acts on command files the test drops into its directory.
SERVICE = """
import os, sys, time
from gpushare import client
d = sys.argv[1]
while True:
    for cmd in sorted(os.listdir(d)):
        os.unlink(os.path.join(d, cmd))
        if cmd.endswith("ping"):
            client.request_started(); client.request_ended()
        elif cmd.endswith("go"):
            client.request_started()
        elif cmd.endswith("stop"):
            client.request_ended()
        elif cmd.endswith("die"):
            client.request_started(); os._exit(0)
    time.sleep(0.005)
"""
IDLE = "import time\nwhile True: time.sleep(0.002)"


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc('[gate]\ninflight_timeout = "3s"\nhold = "2ms"\n', gpus=1)
    try:
        yield d.start()
    finally:
        d.cleanup()


def _frozen(d: DaemonProc, client_id: str, pid: int) -> bool:
    if d.cgroup_dir is not None:
        events = (d.cgroup_dir / f"client-{client_id}" / "cgroup.events").read_text()
        return "frozen 1" in events
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def _gate(d: DaemonProc) -> dict[str, object]:
    gate = d.call("status")["gpus"][0]["request_gate"]
    assert isinstance(gate, dict)
    return gate


def test_requests_in_flight_freeze_offline_work_and_a_dead_client_frees_it(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    cmd = tmp_path / "cmd"
    cmd.mkdir()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    off = daemon.submit_detached([sys.executable, "-c", IDLE], env=env)
    on = daemon.submit_detached([sys.executable, "-c", SERVICE, str(cmd)], cls="online", env=env)
    n = iter(range(1000))

    def send(what: str) -> None:
        (cmd / f"{next(n):04d}-{what}").touch()

    # Its first boundaries make it a signalled client: the controller turns gating on.
    send("ping")
    wait_for(lambda: _gate(daemon)["enabled"], 10.0, "gating on")
    assert not _frozen(daemon, off["client_id"], off["pid"])
    send("go")
    wait_for(lambda: _frozen(daemon, off["client_id"], off["pid"]), 5.0, "offline frozen")
    gate = _gate(daemon)
    assert gate["closed"] and gate["inflight"] == 1
    send("stop")
    wait_for(lambda: not _frozen(daemon, off["client_id"], off["pid"]), 5.0, "offline thawed")
    # The service dies with a request in flight: the gate must not stay closed.
    send("die")
    wait_for(lambda: daemon.client(on["client_id"])["state"] == "exited", 10.0, "online exit")
    wait_for(lambda: not _frozen(daemon, off["client_id"], off["pid"]), 5.0, "thawed after death")
    gate = _gate(daemon)
    assert not gate["closed"] and gate["inflight"] == 0
    # No online client left: the controller turns gating off at a coming tick.
    wait_for(lambda: not _gate(daemon)["enabled"], 5.0, "gating off")
    events = [e["kind"] for e in daemon.events()]
    assert "gating_on" in events
    assert "gating_off" in events


def test_boundaries_from_a_process_that_is_no_client_are_rejected_and_counted(
    daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = daemon.base / "run" / "latency.sock"
    # The API answers before the latency socket is bound (daemon start order).
    wait_for(sock.exists, 5.0, "the latency socket")
    monkeypatch.setenv("GPUSHARE_LATENCY_SOCKET", str(sock))
    monkeypatch.setenv("GPUSHARE_CLIENT_ID", "c1")  # claims a client it is not
    client.request_started()
    client.request_ended()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.sendto(b'{"v":1,"n":"many"}', str(daemon.base / "run" / "latency.sock"))
    raw.close()

    def counts() -> dict[str, int]:
        got = daemon.call("status")["daemon"]["inflight_rejections"]
        assert isinstance(got, dict)
        return got

    wait_for(lambda: counts().get("malformed datagram") == 1, 5.0, "malformed counted")
    assert counts().get("sender is not a client of gpushare") == 2
    # The submit refuses a malformed gauge and a --queue on an online client, changing nothing.
    for params, message in (
        ({"cls": "online", "inflight_from": "prometheus:http://10.0.0.1/m#g"}, "on this host"),
        ({"cls": "online", "queue": "shallow"}, "--queue applies to --offline"),
        ({"queue": "sometimes"}, "--queue must be one of"),
    ):
        with pytest.raises(client.ApiError, match=message):
            daemon.submit_detached(["true"], **params)
    assert daemon.call("list", {"all": True})["clients"] == []


def test_an_auto_queue_client_is_relaunched_shallow_once_gating_is_on(tmp_path: Path) -> None:
    # Debug logs: the offline_queue lines are checked below.
    d = DaemonProc(
        '[control]\nshare_min_interval = "1s"\n[gate]\nshallow_queue = "blocking"\n',
        gpus=1,
        env={"GPUSHARE_TEST_DEBUG": "1"},
    )
    try:
        d.start()
        cmd = tmp_path / "cmd"
        cmd.mkdir()
        env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
        off = d.submit_detached(
            [sys.executable, "-c", IDLE], env=env, restartable=True, queue="auto"
        )
        blocking = b"CUDA_LAUNCH_BLOCKING=1"
        # (Launched deep: its first offline_queue line says so, checked below. Its environment
        # is not read here, since on a loaded machine it can be restarted before this line.)
        d.submit_detached([sys.executable, "-c", SERVICE, str(cmd)], cls="online", env=env)
        (cmd / "0000-ping").touch()
        wait_for(lambda: _gate(d)["enabled"], 10.0, "gating on")
        # No app latency reported: no room known for a gate delay, so the gate closes at once.
        assert _gate(d)["delay_ms"] == 0.0

        def relaunched_shallow() -> bool:
            c = d.client(off["client_id"])
            if c["state"] not in ("running", "throttled") or c["pid"] == off["pid"]:
                return False
            try:
                return blocking in Path(f"/proc/{c['pid']}/environ").read_bytes()
            except FileNotFoundError:
                return False  # relaunched again since: look at the next one

        wait_for(relaunched_shallow, 20.0, "a relaunch with CUDA_LAUNCH_BLOCKING=1")
        # One offline_queue line per launch: deep at submit, shallow at the relaunch. On a
        # loaded machine the online client's admission can come a tick before its first request
        # boundary, and the offline job is then restarted once more, deep, to give up SM share.
        lines = d.stderr_path.read_text().splitlines()
        mine = f"\"client_id\": \"{off['client_id']}\""
        queues = [ln for ln in lines if "offline_queue" in ln and mine in ln]
        exits = [ln for ln in lines if "client_process_exited" in ln and mine in ln]
        assert len(queues) == len(exits) + 1 >= 2, queues  # the last launch is running
        assert '"queue": "deep"' in queues[0] and '"queue": "shallow"' in queues[-1], queues
    finally:
        d.cleanup()


def test_a_flood_of_datagrams_neither_stops_the_daemon_nor_the_gate(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    cmd = tmp_path / "cmd"
    cmd.mkdir()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    off = daemon.submit_detached([sys.executable, "-c", IDLE], env=env)
    daemon.submit_detached([sys.executable, "-c", SERVICE, str(cmd)], cls="online", env=env)
    (cmd / "0000-ping").touch()
    wait_for(lambda: _gate(daemon)["enabled"], 10.0, "gating on")
    # 10^5 datagrams a second for half a second from a process that is no client.
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    tx.setblocking(False)
    path = str(daemon.base / "run" / "latency.sock")
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:
        for _ in range(100):
            with contextlib.suppress(BlockingIOError):
                tx.sendto(b'{"v":1,"n":1}', path)
        time.sleep(0.001)
    tx.close()
    t0 = time.monotonic()
    status = daemon.call("status")
    assert time.monotonic() - t0 < 2.0, "the daemon still answers at once"
    assert sum(status["daemon"]["inflight_rejections"].values()) > 0
    (cmd / "0001-go").touch()
    wait_for(lambda: _frozen(daemon, off["client_id"], off["pid"]), 5.0, "offline frozen")
    (cmd / "0002-stop").touch()
    wait_for(lambda: not _frozen(daemon, off["client_id"], off["pid"]), 5.0, "offline thawed")


# Writes the variables a shallow queue sets, as the process sees them, then idles.
DUMP_ENV = """
import json, os, sys, time
keys = ("LD_PRELOAD", "GPUSHARE_MAX_INFLIGHT", "CUDA_LAUNCH_BLOCKING")
with open(sys.argv[1] + ".tmp", "w") as f:
    json.dump({k: os.environ.get(k) for k in keys}, f)
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True: time.sleep(0.05)
"""


def _shallow_env(
    tmp_path: Path, gate_toml: str, library: Path | None = None
) -> tuple[dict[str, str | None], DaemonProc, dict[str, Any]]:
    d = DaemonProc(gate_toml, gpus=1, inflight_library=library)
    d.start()
    out = tmp_path / "env.json"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    sub = d.submit_detached(
        [sys.executable, "-c", DUMP_ENV, str(out)], env=env, queue="shallow", cwd=str(tmp_path)
    )
    wait_for(out.exists, 10.0, "the shallow client's environment")
    # status/list say how its queue is kept.
    return json.loads(out.read_text()), d, d.client(sub["client_id"])["offline"]["queue"]


@pytest.mark.skipif(
    not native.built(), reason="the in-flight library is not built (make native needs a C compiler)"
)
def test_a_bounded_shallow_client_runs_preloaded_with_its_bound(tmp_path: Path) -> None:
    # The real library is preloaded into a real (CUDA-free) process, which must run unharmed.
    # A root-owned copy, named by [paths] inflight_library: the clone may be private (0700).
    lib = library_for_others()
    env, d, queue = _shallow_env(
        tmp_path, '[gate]\nshallow_queue = "bounded"\ninflight_kernels = 3\n', lib
    )
    try:
        assert queue == {"asked": "shallow", "now": "shallow", "shallow": "3 in flight"}
        assert env == {
            "LD_PRELOAD": str(lib),
            "GPUSHARE_MAX_INFLIGHT": "3",
            "CUDA_LAUNCH_BLOCKING": None,
        }
        events = [e["kind"] for e in d.call("events", {"limit": 50})["events"]]
        assert "shallow_queue_blocking" not in events
    finally:
        d.cleanup()


def test_a_blocking_shallow_client_runs_with_cuda_launch_blocking(tmp_path: Path) -> None:
    env, d, queue = _shallow_env(tmp_path, '[gate]\nshallow_queue = "blocking"\n')
    try:
        assert queue == {"asked": "shallow", "now": "shallow", "shallow": "blocking"}
        assert env == {
            "LD_PRELOAD": None,
            "GPUSHARE_MAX_INFLIGHT": None,
            "CUDA_LAUNCH_BLOCKING": "1",
        }
    finally:
        d.cleanup()
